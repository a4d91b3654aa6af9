"""A discrete-event simulation of sampler pools feeding a trainer, to test and compare placement.

Model (stated so results can be read):
- Each pool's true decode speed is the roofline (hardware.throughput) of its replicas (the
  tensor-parallel size that holds its full batch) at its current batch × a speed multiplier
  (1 unless changed by `speed_changes`). Every rollout in flight on a pool advances at the
  same per-sequence rate; the rate changes when the batch changes.
- Billing, the same rule for every policy: a pool packs its n rollouts onto as few replicas
  as hold them (serverless-style scaling), ceil(n / slots per replica) replicas are busy, and
  each busy GPU is billed the pool's price per second, whatever its batch (one sequence costs
  as much as a full replica). Idle GPUs cost nothing. The n rollouts share the busy GPUs
  evenly (n ÷ busy GPUs sequences each).
- A rollout is pure decode of `rollout_tokens(rng)` tokens; prefill and environment time are
  not modelled. It carries the version its pool held when it started.
- The trainer takes `batch` finished rollouts (oldest first), trains `step_seconds`, then
  publishes version k+1, which reaches each pool `sync_delay_s` later. Rollouts staler than
  their pool's budget when the trainer takes them are dropped (their cost stays spent).
- The controller starts rollouts while in-flight + buffered < batch × (1 + max_ahead_steps),
  asking the scheduler each time; it stops at the first None until the next event. It tells
  the scheduler the demand (batch − finished rollouts waiting), the horizon (time left in
  the current train step, 0 while waiting), the consumption rate (batch ÷ step seconds) and
  (unless `tell_batch=False`) the batch, reports every finished rollout with its tokens, and
  every `observe_every_s` reports each pool's tokens, busy GPU-seconds and mean batch per
  busy GPU.
- Trainer idle fraction is measured from the first batch taken (the initial fill, equal for
  all policies in kind, is excluded) to the end of the last step.
- Tokens and cost count everything generated, including rollouts dropped as too stale and
  those still in flight at the end; `tokens_trained` counts the tokens of the rollouts the
  trainer took.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from hardware.pools import PoolConfig
from hardware.scheduler import Scheduler
from hardware.throughput import ModelSpec, RooflineAssumptions, replica_gpus, roofline_tokens_per_s

__all__ = ["FleetSim", "SimPlacement", "SimPoolStats", "SimResult"]

_EPS = 1e-9


@dataclass
class SimPoolStats:
    """What one pool did during a simulation."""

    placed: int = 0
    completed: int = 0
    dropped: int = 0
    tokens: float = 0.0
    gpu_seconds: float = 0.0
    cost_usd: float = 0.0
    max_in_flight: int = 0


@dataclass(frozen=True)
class SimPlacement:
    """One placement, with the state the scheduler saw (recorded when `trace=True`)."""

    t: float
    pool: str
    lag: int
    demand: int
    horizon_s: float
    in_flight: dict[str, int]


@dataclass
class SimResult:
    """Totals of a simulation run."""

    sim_seconds: float
    steps: int
    cost_usd: float
    tokens: float
    tokens_trained: float
    rollouts_completed: int
    rollouts_dropped: int
    trainer_idle_fraction: float
    capped_fraction: float
    """Fraction of the measured time the controller could start nothing: rollouts in flight
    plus finished ones waiting reached its limit (batch × (1 + max_ahead_steps))."""
    decisions: int
    decision_seconds: float
    pools: dict[str, SimPoolStats]
    placements: list[SimPlacement] = field(default_factory=list)

    @property
    def usd_per_mtok(self) -> float:
        return self.cost_usd / self.tokens * 1e6 if self.tokens else math.nan

    @property
    def usd_per_mtok_trained(self) -> float:
        """Cost per million tokens the trainer used (dropped and unfinished rollouts are waste)."""
        return self.cost_usd / self.tokens_trained * 1e6 if self.tokens_trained else math.nan

    @property
    def decision_us(self) -> float:
        return self.decision_seconds / self.decisions * 1e6 if self.decisions else math.nan


class FleetSim:
    """Runs one scheduler against simulated pools and a trainer. Single use: call `run` once."""

    def __init__(
        self,
        pools: Sequence[PoolConfig],
        model: ModelSpec,
        scheduler: Scheduler,
        *,
        batch: int,
        step_seconds: float,
        steps: int,
        rollout_tokens: Callable[[random.Random], int],
        sync_delay_s: float | Mapping[str, float] = 0.0,
        max_ahead_steps: float = 1.0,
        speed_changes: Sequence[tuple[float, str, float]] = (),
        observe_every_s: float = 10.0,
        assumptions: RooflineAssumptions | None = None,
        seed: int = 0,
        trace: bool = False,
        tell_batch: bool = True,
    ) -> None:
        self.pools = list(pools)
        self.model = model
        self.sched = scheduler
        self.a = assumptions or RooflineAssumptions()
        self.batch = batch
        self.step_seconds = step_seconds
        self.steps = steps
        self.rollout_tokens = rollout_tokens
        self.max_outstanding = batch * (1.0 + max_ahead_steps)
        self.observe_every_s = observe_every_s
        self.rng = random.Random(seed)
        self.trace = trace
        self.tell_batch = tell_batch
        self.names = [p.name for p in self.pools]
        self.idx = {n: i for i, n in enumerate(self.names)}
        self.delay = [
            float(sync_delay_s.get(p.name, 0.0)) if isinstance(sync_delay_s, Mapping) else float(sync_delay_s)
            for p in self.pools
        ]
        self.speed_changes = sorted((t, self.idx[name], m) for t, name, m in speed_changes)
        for _, _, m in self.speed_changes:
            if m <= 0:
                raise ValueError(f"speed multipliers must be > 0, got {m}")
        # Full-batch replica size and slots per GPU fix how rollouts pack onto GPUs.
        self.slots = [p.capacity / p.count for p in self.pools]
        self.g: list[int] = []
        for p, s in zip(self.pools, self.slots, strict=True):
            g = replica_gpus(p.spec, p.precision, model, s, self.a)
            if g is None or g > p.count:
                raise ValueError(f"pool {p.name!r}: the model does not fit its {p.count} × {p.gpu}")
            self.g.append(g)

    def _tps(self, i: int, b: float) -> float:
        p = self.pools[i]
        return roofline_tokens_per_s(p.spec, p.precision, self.model, b, self.a, replica=self.g[i]) * self.mult[i]

    def _recompute(self, i: int) -> None:
        n = self.n[i]
        if n == 0:
            self.rate[i] = 0.0
            self.busy[i] = 0
            return
        per_replica = self.slots[i] * self.g[i]
        busy = min(self.pools[i].count, math.ceil(n / per_replica - 1e-12) * self.g[i])
        b = n / busy
        self.busy[i] = busy
        self.rate[i] = self._tps(i, b) / b  # tokens/s of one sequence

    def run(self) -> SimResult:
        P = len(self.pools)
        self.n = [0] * P
        self.V = [0.0] * P
        self.rate = [0.0] * P
        self.busy = [0] * P
        self.mult = [1.0] * P
        self.version = [0] * P
        heaps: list[list[tuple[float, int, int, int]]] = [[] for _ in range(P)]
        stats = {name: SimPoolStats() for name in self.names}
        st = [stats[name] for name in self.names]
        obs_tokens = [0.0] * P
        obs_gpu_s = [0.0] * P
        obs_nsum = [0.0] * P
        arrivals: list[tuple[float, int, int]] = []
        speed = deque(self.speed_changes)
        buffer: deque[tuple[int, int, int]] = deque()  # (start version, pool, tokens)
        placements: list[SimPlacement] = []
        seq = 0
        t = 0.0
        k = 0  # trainer version
        steps_done = 0
        training_until: float | None = None
        t_first: float | None = None
        idle = 0.0
        capped = 0.0
        trained = 0.0
        dropped = 0
        completed = 0
        decisions = 0
        decision_s = 0.0
        next_obs = self.observe_every_s
        in_flight_total = 0
        sched = self.sched
        perf = time.perf_counter

        def tell_scheduler() -> None:
            horizon = 0.0 if training_until is None else training_until - t
            sched.set_trainer(
                k,
                self.batch - len(buffer),
                horizon,
                self.batch / self.step_seconds,
                self.batch if self.tell_batch else 0,
            )

        def fill() -> None:
            nonlocal seq, in_flight_total, decisions, decision_s
            while in_flight_total + len(buffer) < self.max_outstanding:
                demand_before = sched.demand
                t0 = perf()
                name = sched.place()
                decision_s += perf() - t0
                decisions += 1
                if name is None:
                    return
                i = self.idx[name]
                if self.trace:
                    snapshot = {nm: self.n[j] for j, nm in enumerate(self.names)}
                    h = 0.0 if training_until is None else training_until - t
                    placements.append(SimPlacement(t, name, k - self.version[i], demand_before, h, snapshot))
                tokens = max(1, int(self.rollout_tokens(self.rng)))
                heapq.heappush(heaps[i], (self.V[i] + tokens, seq, self.version[i], tokens))
                seq += 1
                self.n[i] += 1
                in_flight_total += 1
                st[i].placed += 1
                st[i].max_in_flight = max(st[i].max_in_flight, self.n[i])
                self._recompute(i)

        def try_consume() -> None:
            nonlocal training_until, t_first, dropped, trained
            # Drop what is already too stale to train on; the controller retries those prompts.
            keep: deque[tuple[int, int, int]] = deque()
            for item in buffer:
                v, i, _ = item
                if k - v > self.pools[i].staleness_budget:
                    dropped += 1
                    st[i].dropped += 1
                else:
                    keep.append(item)
            buffer.clear()
            buffer.extend(keep)
            if len(buffer) >= self.batch:
                for _ in range(self.batch):
                    trained += buffer.popleft()[2]
                training_until = t + self.step_seconds
                if t_first is None:
                    t_first = t

        tell_scheduler()
        fill()
        while steps_done < self.steps:
            tn = next_obs
            for i in range(P):
                if self.n[i]:
                    tn = min(tn, t + max(0.0, heaps[i][0][0] - self.V[i]) / self.rate[i])
            if training_until is not None:
                tn = min(tn, training_until)
            if arrivals:
                tn = min(tn, arrivals[0][0])
            if speed:
                tn = min(tn, speed[0][0])
            dt = max(0.0, tn - t)
            for i in range(P):
                if self.n[i]:
                    r = self.rate[i]
                    self.V[i] += r * dt
                    tok = self.n[i] * r * dt
                    gs = self.busy[i] * dt
                    st[i].tokens += tok
                    st[i].gpu_seconds += gs
                    st[i].cost_usd += gs * self.pools[i].price / 3600.0
                    obs_tokens[i] += tok
                    obs_gpu_s[i] += gs
                    obs_nsum[i] += self.n[i] * dt
            if training_until is None and t_first is not None:
                idle += dt
            if t_first is not None and in_flight_total + len(buffer) >= self.max_outstanding:
                capped += dt
            t = tn
            for i in range(P):
                h = heaps[i]
                changed = False
                while h and h[0][0] <= self.V[i] + 1e-6:
                    _, _, v, tokens = heapq.heappop(h)
                    self.n[i] -= 1
                    in_flight_total -= 1
                    completed += 1
                    st[i].completed += 1
                    sched.complete(self.names[i], tokens)
                    buffer.append((v, i, tokens))
                    changed = True
                if changed:
                    self._recompute(i)
            while arrivals and arrivals[0][0] <= t + _EPS:
                _, i, v = heapq.heappop(arrivals)
                if v > self.version[i]:
                    self.version[i] = v
                    sched.set_pool_version(self.names[i], v)
            while speed and speed[0][0] <= t + _EPS:
                _, i, m = speed.popleft()
                self.mult[i] = m
                self._recompute(i)
            if training_until is not None and t >= training_until - _EPS:
                k += 1
                steps_done += 1
                training_until = None
                for i in range(P):
                    heapq.heappush(arrivals, (t + self.delay[i], i, k))
                while arrivals and arrivals[0][0] <= t + _EPS:  # zero-delay syncs land now
                    _, i, v = heapq.heappop(arrivals)
                    if v > self.version[i]:
                        self.version[i] = v
                        sched.set_pool_version(self.names[i], v)
            if t >= next_obs - _EPS:
                for i in range(P):
                    if obs_gpu_s[i] > 0.0:
                        sched.observe(self.names[i], obs_tokens[i], obs_gpu_s[i], obs_nsum[i] / obs_gpu_s[i])
                    obs_tokens[i] = obs_gpu_s[i] = obs_nsum[i] = 0.0
                next_obs += self.observe_every_s
            if training_until is None and steps_done < self.steps:
                try_consume()
            tell_scheduler()
            fill()
            stalled = in_flight_total == 0 and training_until is None and not arrivals and not speed
            if stalled and steps_done < self.steps:
                raise RuntimeError(f"simulation stalled at t={t:.1f}s: nothing in flight, trainer waiting")
        span = t - (t_first or 0.0)
        return SimResult(
            sim_seconds=t,
            steps=steps_done,
            cost_usd=sum(s.cost_usd for s in st),
            tokens=sum(s.tokens for s in st),
            tokens_trained=trained,
            rollouts_completed=completed,
            rollouts_dropped=dropped,
            trainer_idle_fraction=idle / span if span > 0 else 0.0,
            capped_fraction=capped / span if span > 0 else 0.0,
            decisions=decisions,
            decision_seconds=decision_s,
            pools=stats,
            placements=placements,
        )
