"""A discrete-event simulation of a large sampler fleet: spot preemptions, links, controller cost.

Where `hardware.simulate.FleetSim` tests the placement policy on a few pools with a roofline
speed model, this one asks what a fleet of hundreds or thousands of GPUs across providers
costs, how stale its trajectories are, and when the single controller saturates. The model,
stated so its results can be read:

- Every GPU of a pool holds `slots_per_gpu` rollouts at once and decodes each at
  `tokens_per_s_per_gpu / slots_per_gpu` tokens/s, whatever its occupancy (the full-batch
  speed; a GPU the controller cannot fill is credited no faster decoding).
- A rollout decodes `rollout_tokens(rng)` tokens on one GPU in turns of `tokens_per_turn`
  tokens (None: one turn). The controller (with the environment behind it) spends
  `controller_s_per_rollout` CPU-seconds on each rollout, half before its first turn
  (admission, environment reset) and half after its last (the finished trajectory), and
  `controller_s_per_token` × a turn's tokens before each turn's decode. The `controller_cores` cores serve the rollouts
  waiting for them side by side (processor sharing: n waiting get min(1, cores ÷ n) of a
  core each). A rollout holds its GPU slot until the controller has served it (the
  controller is what starts the next rollout), so a saturated controller idles GPUs; its
  ceiling is `controller_cores ÷ controller_s_per_rollout` rollouts/s (per-token cost 0).
- The controller starts rollouts while in flight + finished-and-waiting < batch × (1 +
  max_ahead_steps), on the cheapest pool (price ÷ tokens/s) with a free slot whose weights lag
  the trainer by at most its staleness budget. A rollout carries the version its pool held
  at its first decoded token.
- The trainer takes the `batch` oldest finished rollouts, drops those staler than their pool's
  budget (trainer version − start version; their cost stays spent), trains `step_seconds`,
  then publishes version k+1. It reaches pool p after `update_s` = delta bytes × 8 ÷ link
  bits/s (one copy per pool over its link to the trainer, fanned out inside the pool).
- Spot GPUs are preempted at `preemptions_per_gpu_hour` (exponential gaps). A preempted GPU
  loses its rollouts in flight (their tokens so far count as generated, none is trained); its
  replacement boots for `restart_s`, then loads the full weights over the pool's link
  (`keyframe_bytes`) and takes rollouts again.
- Billing `rented`: every GPU costs its price for the whole simulated time (a replacement is
  billed while it boots). Billing `busy`: a pool costs its tokens ÷ tokens_per_s_per_gpu
  GPU-seconds (what a per-second serverless bill charges for work done at full batch).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Literal

from hardware._scale import ScalePool, ScalePoolStats, ScaleResult, ScaleStep

__all__ = ["ScalePool", "ScalePoolStats", "ScaleResult", "ScaleSim", "ScaleStep"]

_DECODED, _TRAINED, _SYNC, _PREEMPT, _UP = range(5)
_TURN, _FINISHED = range(2)  # what a rollout waits for at the controller


class _Roll:
    """One rollout in flight."""

    __slots__ = ("decode_start", "decoded", "epoch", "gpu", "rid", "tokens", "turns", "turns_left", "version")

    def __init__(self, rid: int, gpu: int, epoch: int, tokens: float, turns: int) -> None:
        self.rid, self.gpu, self.epoch, self.tokens = rid, gpu, epoch, tokens
        self.turns = self.turns_left = turns
        self.decoded = 0.0
        self.decode_start: float | None = None
        self.version: int | None = None  # the pool's weights at its first decoded token


class ScaleSim:
    """Runs one fleet against a trainer for `steps` steps. Single use: call `run` once."""

    def __init__(
        self,
        pools: Sequence[ScalePool],
        *,
        batch: int,
        step_seconds: float,
        steps: int,
        rollout_tokens: Callable[[random.Random], float],
        max_ahead_steps: float = 1.0,
        controller_s_per_rollout: float = 0.0005,
        controller_cores: int = 1,
        controller_s_per_token: float = 0.0,
        tokens_per_turn: float | None = None,
        billing: Literal["rented", "busy"] = "rented",
        seed: int = 0,
    ) -> None:
        names = [p.name for p in pools]
        if not pools or len(set(names)) != len(names):
            raise ValueError(f"pools must be non-empty with unique names, got {names}")
        if batch < 1 or steps < 1 or step_seconds < 0 or max_ahead_steps < 0:
            raise ValueError("batch and steps must be ≥ 1, step_seconds and max_ahead_steps ≥ 0")
        if controller_s_per_rollout < 0 or controller_s_per_token < 0 or controller_cores < 1:
            raise ValueError("controller_s_per_rollout and _per_token must be ≥ 0, controller_cores ≥ 1")
        if billing not in ("rented", "busy"):
            raise ValueError(f"billing must be 'rented' or 'busy', got {billing!r}")
        self.pools = list(pools)
        self.batch, self.step_seconds, self.steps = batch, step_seconds, steps
        self.rollout_tokens = rollout_tokens
        self.max_outstanding = batch * (1.0 + max_ahead_steps)
        self.c, self.cores, self.billing = controller_s_per_rollout, controller_cores, billing
        self.c_token = controller_s_per_token
        if tokens_per_turn is not None and tokens_per_turn <= 0:
            raise ValueError(f"tokens_per_turn must be > 0, got {tokens_per_turn}")
        self.tokens_per_turn = tokens_per_turn
        self.rng = random.Random(seed)
        # Cheapest tokens first; ties keep configuration order.
        self.order = sorted(range(len(self.pools)), key=lambda i: (self.pools[i].usd_per_mtok, i))
        self.pool_of: list[int] = [i for i, p in enumerate(self.pools) for _ in range(p.count)]

    def _cost(self, t: float, stats: list[ScalePoolStats]) -> float:
        if self.billing == "rented":
            return sum(p.count * p.price_per_gpu_hour * t / 3600.0 for p in self.pools)
        return sum(
            (s.tokens + s.tokens_lost) / p.tokens_per_s_per_gpu * p.price_per_gpu_hour / 3600.0
            for p, s in zip(self.pools, stats, strict=True)
        )

    def run(self) -> ScaleResult:
        pools, P = self.pools, len(self.pools)
        G = len(self.pool_of)
        rate = [p.tokens_per_s_per_gpu / p.slots_per_gpu for p in pools]
        stats = [ScalePoolStats() for _ in pools]
        up = [True] * G
        epoch = [0] * G
        running: list[dict[int, _Roll]] = [{} for _ in range(G)]  # not yet fully decoded, per GPU
        self._last_staleness = math.nan
        free: list[list[tuple[int, int]]] = [[] for _ in range(P)]  # (gpu, epoch), one entry per free slot
        for g, i in enumerate(self.pool_of):
            free[i].extend([(g, 0)] * pools[i].slots_per_gpu)
        version = [0] * P
        events: list[tuple[float, int, int, tuple]] = []
        seq = 0

        def push(t: float, kind: int, data: tuple) -> None:
            nonlocal seq
            heapq.heappush(events, (t, seq, kind, data))
            seq += 1

        rng = self.rng
        for g, i in enumerate(self.pool_of):
            lam = pools[i].preemptions_per_gpu_hour / 3600.0
            if lam > 0:
                push(rng.expovariate(lam), _PREEMPT, (g, 0))
        controller_busy = 0.0
        buffer: deque[tuple[int, int, float]] = deque()  # (start version, pool, tokens)
        staleness: Counter[int] = Counter()
        log: list[ScaleStep] = []
        t = 0.0
        k = 0
        training = False
        t_first: float | None = None
        idle = 0.0
        idle_since: float | None = None
        outstanding = 0
        rid = 0
        trained_tokens = 0.0
        dropped = trained = served_n = 0

        def begin_turn(roll: _Roll) -> None:
            work = self.c_token * roll.tokens / roll.turns
            if roll.turns_left == roll.turns:
                work += self.c / 2.0
            if work > 0:
                to_controller(work, _TURN, roll)
            else:
                decode(roll)

        def decode(roll: _Roll) -> None:
            i = self.pool_of[roll.gpu]
            if roll.version is None:
                roll.version = version[i]
            roll.decode_start = t
            push(t + roll.tokens / roll.turns / rate[i], _DECODED, (roll,))

        def fill() -> None:
            nonlocal outstanding, rid
            for i in self.order:
                if k - version[i] > pools[i].staleness_budget:
                    continue
                f = free[i]
                while f and outstanding < self.max_outstanding:
                    g, e = f.pop()
                    if not up[g] or e != epoch[g]:
                        continue
                    tokens = max(1e-9, float(self.rollout_tokens(rng)))
                    turns = max(1, math.ceil(tokens / self.tokens_per_turn - 1e-9)) if self.tokens_per_turn else 1
                    roll = _Roll(rid, g, e, tokens, turns)
                    running[g][rid] = roll
                    begin_turn(roll)
                    rid += 1
                    outstanding += 1
                    stats[i].started += 1
                if outstanding >= self.max_outstanding:
                    return

        def try_consume() -> None:
            nonlocal training, t_first, outstanding, dropped, trained, trained_tokens, idle, idle_since
            if training or len(buffer) < self.batch:
                return
            taken: list[tuple[int, int, float]] = []
            while buffer and len(taken) < self.batch:
                item = buffer.popleft()
                v, i, _ = item
                if k - v > pools[i].staleness_budget:
                    dropped += 1
                    stats[i].dropped += 1
                    outstanding -= 1
                else:
                    taken.append(item)
            if len(taken) < self.batch:
                buffer.extendleft(reversed(taken))
                return
            s_sum = 0
            for v, i, tokens in taken:
                staleness[k - v] += 1
                s_sum += k - v
                stats[i].trained += 1
                trained_tokens += tokens
            trained += len(taken)
            outstanding -= len(taken)
            training = True
            self._last_staleness = s_sum / len(taken)
            if t_first is None:
                t_first = t
            if idle_since is not None:
                idle += t - idle_since
                idle_since = None
            push(t + self.step_seconds, _TRAINED, ())

        # The controller serves the rollouts waiting for it side by side (processor sharing):
        # with n waiting, each gets min(1, cores / n) of a core; `ctl_v` is the service each has
        # received since t = 0 and a rollout is done when it reaches its entry's finish value.
        ctl: list[tuple[float, int, int, _Roll]] = []
        ctl_v = 0.0
        ctl_t = 0.0

        def ctl_rate() -> float:
            return min(1.0, self.cores / len(ctl)) if ctl else 0.0

        def advance(to: float) -> None:
            nonlocal ctl_v, ctl_t, controller_busy
            if ctl:
                ctl_v += (to - ctl_t) * ctl_rate()
                controller_busy += (to - ctl_t) * min(len(ctl), self.cores)
            ctl_t = to

        def ready(roll: _Roll) -> None:
            nonlocal served_n
            i = self.pool_of[roll.gpu]
            served_n += 1
            assert roll.version is not None
            buffer.append((roll.version, i, roll.tokens))
            if roll.epoch == epoch[roll.gpu]:
                free[i].append((roll.gpu, roll.epoch))
            try_consume()
            fill()

        def to_controller(work: float, what: int, roll: _Roll) -> None:
            nonlocal seq
            heapq.heappush(ctl, (ctl_v + work, seq, what, roll))
            seq += 1

        fill()
        while k < self.steps:
            t_ctl = ctl_t + (ctl[0][0] - ctl_v) / ctl_rate() if ctl else math.inf
            if events and events[0][0] < t_ctl:
                t, _, kind, data = heapq.heappop(events)
                advance(t)
            elif ctl:
                t = t_ctl
                advance(t)
                _, _, what, roll = heapq.heappop(ctl)
                if what == _FINISHED:
                    ready(roll)
                elif roll.epoch == epoch[roll.gpu]:  # its GPU was not preempted meanwhile
                    decode(roll)
                continue
            else:
                raise RuntimeError(f"simulation stalled at t={t:.1f}s: nothing in flight, trainer waiting")
            if kind == _DECODED:
                (roll,) = data
                if roll.epoch != epoch[roll.gpu]:
                    continue
                roll.decoded += roll.tokens / roll.turns
                roll.decode_start = None
                roll.turns_left -= 1
                if roll.turns_left:
                    begin_turn(roll)
                    continue
                i = self.pool_of[roll.gpu]
                del running[roll.gpu][roll.rid]
                stats[i].completed += 1
                stats[i].tokens += roll.tokens
                if self.c > 0:
                    to_controller(self.c / 2.0, _FINISHED, roll)
                else:
                    ready(roll)
            elif kind == _TRAINED:
                k += 1
                training = False
                idle_since = t
                cost = self._cost(t, stats)
                tok = sum(s.tokens + s.tokens_lost for s in stats)
                by_pool = {p.name: s.tokens + s.tokens_lost for p, s in zip(pools, stats, strict=True)}
                log.append(ScaleStep(k, t, tok, cost, trained_tokens, self._last_staleness, by_pool))
                for i, p in enumerate(pools):
                    push(t + p.update_s, _SYNC, (i, k))
                try_consume()
                fill()
            elif kind == _SYNC:
                i, v = data
                version[i] = max(version[i], v)
                fill()
            elif kind == _PREEMPT:
                g, e = data
                if e != epoch[g] or not up[g]:
                    continue
                i = self.pool_of[g]
                up[g] = False
                epoch[g] += 1
                stats[i].preemptions += 1
                for roll in running[g].values():
                    partial = 0.0 if roll.decode_start is None else (t - roll.decode_start) * rate[i]
                    stats[i].tokens_lost += roll.decoded + partial
                    stats[i].lost += 1
                    outstanding -= 1
                running[g].clear()  # fully decoded ones have reached the controller: not lost
                push(t + pools[i].restart_s + pools[i].keyframe_s, _UP, (g,))
                fill()
            else:  # _UP
                (g,) = data
                i = self.pool_of[g]
                up[g] = True
                free[i].extend([(g, epoch[g])] * pools[i].slots_per_gpu)
                lam = pools[i].preemptions_per_gpu_hour / 3600.0
                if lam > 0:
                    push(t + rng.expovariate(lam), _PREEMPT, (g, epoch[g]))
                fill()
        span = t - (t_first or 0.0)
        for p, s in zip(pools, stats, strict=True):
            if self.billing == "rented":
                s.cost_usd = p.count * p.price_per_gpu_hour * t / 3600.0
            else:
                s.cost_usd = (s.tokens + s.tokens_lost) / p.tokens_per_s_per_gpu * p.price_per_gpu_hour / 3600.0
        return ScaleResult(
            sim_seconds=t,
            steps=k,
            cost_usd=sum(s.cost_usd for s in stats),
            tokens=sum(s.tokens for s in stats),
            tokens_lost=sum(s.tokens_lost for s in stats),
            tokens_trained=trained_tokens,
            rollouts_completed=sum(s.completed for s in stats),
            rollouts_served=served_n,
            rollouts_trained=trained,
            rollouts_dropped=dropped,
            rollouts_lost=sum(s.lost for s in stats),
            preemptions=sum(s.preemptions for s in stats),
            staleness=staleness,
            controller_s_per_rollout=self.c,
            controller_cores=self.cores,
            controller_busy_fraction=controller_busy / (self.cores * t) if t > 0 else 0.0,
            trainer_idle_fraction=idle / span if span > 0 else 0.0,
            pools={p.name: s for p, s in zip(pools, stats, strict=True)},
            log=log,
        )
