"""Cost-aware rollout placement.

Pools are ranked by expected cost per token at full batch. Let j be the cheapest pool within
its staleness budget that has a free slot. j takes the rollout when no cheaper pool is within
budget, or when the trainer's steady consumption needs all of j; it takes it into a warm slot
of a busy replica (nothing more billed) while the trainer will need more rollouts within the
look-ahead, and then tops that replica up; when the trainer would otherwise starve, the
rollout goes to the pool, j or dearer, with the lowest marginal cost per token at the batch
its replica would run. Otherwise `place` returns None: wait for a slot on a cheaper pool.

The rule in full (the state it reads, its five steps, the trainer's shortfall and the
supply it is measured against, the mean rollout length) is docs/placement.md, written for
this code: change both together.

A decision is O(pools) over plain lists. Policy "round_robin" (a baseline): pools in name
order, in turn, skipping full or lagging ones, regardless of cost and demand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hardware._lengths import PoolLengthState, RolloutLengths
from hardware._state import parse_state
from hardware.pools import PoolConfig
from hardware.throughput import ThroughputModel

__all__ = ["PoolState", "Scheduler"]

_EPS = 1e-6  # rollouts: shortfalls below this are rounding, not need


@dataclass(frozen=True, slots=True)
class PoolState:
    """A read-only view of one pool's scheduling state."""

    name: str
    capacity: int
    in_flight: int
    version: int
    staleness_budget: int
    eligible: bool
    usd_per_mtok: float
    """Expected cost per million tokens at full batch (the ranking key)."""
    tokens_per_s_per_gpu: float
    """Estimated tokens/s per GPU at full batch."""
    rank: int
    replica_gpus: int
    """GPUs per replica (0: the model does not fit)."""
    busy_replicas: int
    """Replicas busy with the rollouts in flight, packed."""


class _SchedulerState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lengths: dict[str, PoolLengthState] = Field(default_factory=dict)
    """The rollout-length flow per pool name."""
    round_robin_next: int = Field(default=0, ge=0)
    """Position (in name order) where the round-robin policy looks first."""
    throughput: dict[str, Any] = Field(default_factory=dict)
    """ThroughputModel.state()."""


class Scheduler:
    """Places rollouts on pools. Synchronous and not thread-safe: one controller task owns it.

    `place()` never raises for an unplaceable rollout; it returns None (wait). Unknown pool
    names raise KeyError naming the known pools.
    """

    def __init__(
        self,
        pools: Sequence[PoolConfig],
        throughput: ThroughputModel,
        *,
        policy: Literal["cost", "round_robin"] = "cost",
        mean_rollout_tokens: float = 1024.0,
        lookahead_steps: float = 1.0,
        length_window: float = 4.0,
    ) -> None:
        if not pools:
            raise ValueError("a scheduler needs at least one pool")
        if policy not in ("cost", "round_robin"):
            raise ValueError(f"policy must be 'cost' or 'round_robin', got {policy!r}")
        if not mean_rollout_tokens > 0:
            raise ValueError(f"mean_rollout_tokens must be > 0, got {mean_rollout_tokens}")
        if not lookahead_steps >= 0:
            raise ValueError(f"lookahead_steps must be ≥ 0, got {lookahead_steps}")
        if not length_window > 0:
            raise ValueError(f"length_window must be > 0, got {length_window}")
        self.policy = policy
        self.throughput = throughput
        self._lookahead = float(lookahead_steps)
        # Parallel lists indexed by pool position in name order: attribute-free inner loops.
        ordered = sorted(pools, key=lambda p: p.name)
        n = len(ordered)
        self._pools = ordered
        self._names = [p.name for p in ordered]
        self._index = {name: i for i, name in enumerate(self._names)}
        self._cap = [p.capacity for p in ordered]
        self._budget = [p.staleness_budget for p in ordered]
        self._price_s = [p.price / 3600.0 for p in ordered]
        self._g = [throughput.replica_gpus(name) for name in self._names]
        # Slots per replica; a pool the model does not fit gets one huge "replica" so that
        # n mod S stays defined; it is never chosen (infinite cost).
        self._S = [throughput.slots_per_replica(name) or 1 << 62 for name in self._names]
        # Roofline tokens/s per GPU with m sequences per replica, filled on first use; the
        # online factor multiplies it, so it never needs recomputing.
        self._curve: list[dict[int, float]] = [{} for _ in ordered]
        self._inflight = [0] * n
        self._ver = [0] * n
        self._down = [False] * n  # no rank can take a rollout (set_available)
        self._fill_to = [0] * n  # top-up target (rule 2); 0: none
        self._fill_from = [0] * n  # in flight when the top-up began; draining back to it ends it
        self._lengths = RolloutLengths(self._cap, float(mean_rollout_tokens), float(length_window))
        self._trainer_version = 0
        self._demand = 0
        self._horizon = 0.0
        self._consume = 0.0
        self._batch = 0
        self._rr_next = 0
        self._rerank()

    # -- estimates -------------------------------------------------------------------------

    def _rerank(self) -> None:
        tp = self.throughput
        self._factor = [tp.factor(name) for name in self._names]
        self._cost = [tp.usd_per_token(name) for name in self._names]
        self._tps = [tp.estimate(name) for name in self._names]
        # slot_s: seconds one sequence takes per token on a full pool, so R_i = tokens × slot_s.
        self._slot_s = [
            tp.batch_per_gpu(name) / t if t > 0 else math.inf for name, t in zip(self._names, self._tps, strict=False)
        ]
        # Tokens/s of each whole pool at full batch.
        self._pool_tps = [p.count * t for p, t in zip(self._pools, self._tps, strict=False)]
        self._order = sorted(range(len(self._pools)), key=lambda i: (self._cost[i], self._names[i]))

    def _replica_tps(self, i: int, m: int) -> float:
        """Estimated tokens/s per GPU of pool i's replicas with m sequences each."""
        curve = self._curve[i]
        t = curve.get(m)
        if t is None:
            g = self._g[i]
            t = self.throughput.roofline(self._names[i], m / g) if g else 0.0
            curve[m] = t
        return t * self._factor[i]

    def _seq_seconds(self, i: int, n: int) -> float:
        """Seconds per token of one sequence on pool i with n > 0 rollouts in flight, packed."""
        m = -(-n // -(-n // self._S[i]))  # sequences per busy replica, spread evenly
        tps = self._replica_tps(i, m)
        return m / (self._g[i] * tps) if tps > 0 else math.inf

    # -- inputs from the controller ---------------------------------------------------------

    def set_trainer(
        self, version: int, demand: int, horizon_s: float = 0.0, consume_per_s: float = 0.0, batch: int = 0
    ) -> None:
        """The trainer's version; `demand`, the rollouts its next step still needs that have not
        finished (in-flight ones are not subtracted); `horizon_s`, seconds until that step
        starts (0: it is waiting now); `consume_per_s`, rollouts per second it takes when never
        starved (batch ÷ train-step seconds; 0 looks at the next step only); `batch`, rollouts
        per step (0: unknown, consumption is taken as continuous)."""
        self._trainer_version = version
        self._demand = demand
        self._horizon = max(0.0, horizon_s)
        self._consume = max(0.0, consume_per_s)
        self._batch = max(0, batch)

    def set_pool_version(self, pool: str, version: int) -> None:
        """The weight version `pool` now holds (after a sync)."""
        self._ver[self._idx(pool)] = version

    def set_available(self, pool: str, available: bool) -> None:
        """Whether `pool` can take rollouts now (some rank is up, answering and holding
        weights). An unavailable pool is never chosen and, like a pool beyond its budget,
        counts only for the rollouts it still has in flight."""
        self._down[self._idx(pool)] = not available

    def complete(self, pool: str, tokens: int | None = None) -> None:
        """A rollout on `pool` finished or failed: its slot is free again. `tokens`
        (generated) stands in for the pool's generated tokens until it is observed."""
        i = self._free(pool, "complete")
        self._lengths.finished(i, tokens)

    def release(self, pool: str) -> None:
        """Undo a `place()` whose rollout never started (held back, or its sampler died
        before it ran): the slot is free again, and neither throughput nor rollout-length
        statistics see it."""
        self._free(pool, "release")

    def _free(self, pool: str, what: str) -> int:
        i = self._idx(pool)
        if self._inflight[i] <= 0:
            raise ValueError(f"{what}({pool!r}) with no rollout in flight there")
        self._inflight[i] -= 1
        if self._inflight[i] <= self._fill_from[i]:
            self._fill_to[i] = 0
        return i

    def _eligible(self, i: int) -> bool:
        """Pool i is available and its weights are within its staleness budget of the
        trainer's version."""
        return not self._down[i] and self._trainer_version - self._ver[i] <= self._budget[i]

    def observe(self, pool: str, tokens: float, gpu_seconds: float, batch_per_gpu: float | None = None) -> float:
        """A throughput measurement for `pool`: `tokens` generated in `gpu_seconds` busy
        GPU-seconds since its last one (see ThroughputModel.observe); when the batch is not
        given, the pool's current rollouts in flight per GPU stand for it. Also feeds the mean
        rollout length. Re-ranks the pools; returns the pool's new factor."""
        i = self._idx(pool)
        if batch_per_gpu is None:
            batch_per_gpu = max(1.0, self._inflight[i] / self._pools[i].count)
        f = self.throughput.observe(pool, tokens, gpu_seconds, batch_per_gpu)
        self._lengths.generated(i, tokens)
        self._rerank()
        return f

    # -- the decision ---------------------------------------------------------------------

    def place(self) -> str | None:
        """The pool for the next rollout, its slot taken; None means wait."""
        if self.policy == "round_robin":
            return self._place_round_robin()
        inflight = self._inflight
        cap = self._cap
        order = self._order
        pool_tps = self._pool_tps
        first = True
        jpos = -1
        prod = 0.0  # tokens/s of the eligible full pools before j
        lagging: list[int] = []  # pools before j that lag beyond their budget, with rollouts
        for pos, i in enumerate(order):
            if not self._eligible(i):
                if inflight[i]:
                    lagging.append(i)
                continue
            if inflight[i] < cap[i]:
                jpos = pos
                break
            first = False
            prod += pool_tps[i]
        if jpos < 0:
            return None
        j = order[jpos]
        if math.isinf(self._cost[j]):
            return None  # the cheapest pool with room cannot run the model: nor can dearer ones
        n = inflight[j]
        if first or prod + pool_tps[j] <= self._consume * self._lengths.mean or n < self._fill_to[j]:
            return self._take(j)
        now, ahead = self._shortfall(jpos, j, prod, lagging)
        S = self._S[j]
        r = n % S
        if r and ahead > _EPS:
            self._top_up(j, n - r + S, n + math.ceil(ahead - _EPS) + self._extra(j))
            return self._take(j)
        if now <= _EPS:
            return None
        k = self._spill_target(jpos, now)
        if k < 0:
            return None
        if k == j:
            self._top_up(j, n - r + S, n + math.ceil(now - _EPS) + self._extra(j))
        return self._take(k)

    def take(self, pool: str) -> bool:
        """Take a slot on `pool` chosen by the caller, not by the rule (a duplicate of a
        straggling rollout): True if it had room and is eligible (the slot is then taken and
        `complete` or `release` frees it), else False and nothing changes."""
        i = self._idx(pool)
        if not self._eligible(i) or self._inflight[i] >= self._cap[i]:
            return False
        self._inflight[i] += 1
        return True

    def _top_up(self, j: int, replica_full: int, enough: int) -> None:
        self._fill_to[j] = min(replica_full, enough)
        self._fill_from[j] = self._inflight[j]

    def _take(self, i: int) -> str:
        self._inflight[i] += 1
        if self._inflight[i] >= self._fill_to[i]:
            self._fill_to[i] = 0
        return self._names[i]

    def _extra(self, j: int) -> int:
        """Rollouts beyond the need a top-up of j may start: one batch (without a batch, what
        the trainer takes while one rollout runs on j)."""
        if self._batch:
            return self._batch
        R = self._lengths.mean * self._slot_s[j]
        return 0 if math.isinf(R) else int(self._consume * R)

    def _shortfall(self, jpos: int, j: int, prod: float, lagging: list[int]) -> tuple[float, float]:
        """(shortfall at T₁, shortfall at T₂) for j, the first eligible pool with room, at
        ranking position jpos; `prod`: tokens/s of the eligible full pools before j; `lagging`:
        the pools before j beyond their staleness budget that have rollouts in flight.
        -inf where there is no need."""
        mt = self._lengths.mean
        h = self._horizon
        D = self._demand
        c = self._consume
        R = mt * self._slot_s[j]
        if math.isinf(R):
            return -math.inf, -math.inf
        T = max(h, R)
        if self._batch and c > 0.0:
            B = self._batch
            step = B / c
            nj = self._inflight[j]
            rate = prod + (nj / self._seq_seconds(j, nj) if nj else 0.0)
            h_eff = h if D <= 0 else (max(h, D * mt / rate) if rate > 0.0 else math.inf)
            if h >= T or h_eff > T:  # lands before the next step can start: helps that step
                T1, need1 = T, float(D)
            else:  # helps the first step that starts once it has landed
                m = math.ceil((T - h_eff) / step - 1e-9)
                T1, need1 = h_eff + m * step, float(D + m * B)
            T2 = T1 + self._lookahead * step
            if self._lookahead <= 0.0:
                need2 = -math.inf
            elif h_eff > T2:  # h_eff may be inf: nothing delivers D
                need2 = float(D)
            else:  # the steps that start by T2
                need2 = float(D + B * math.floor((T2 - h_eff) / step + 1e-9))
        else:
            T1, need1 = T, D + c * (T - h)
            T2 = T + self._lookahead * R
            need2 = D + c * (T2 - h) if self._lookahead > 0.0 and c > 0.0 else -math.inf
        if need1 <= 0.0 and need2 <= 0.0:
            return -math.inf, -math.inf
        inflight = self._inflight
        # The eligible full pools before j finish prod ÷ mt rollouts per second.
        supply1 = prod / mt * T1
        supply2 = prod / mt * T2
        order = self._order
        for pos in range(jpos, len(order) + len(lagging)):
            i = order[pos] if pos < len(order) else lagging[pos - len(order)]
            n = inflight[i]
            if not n:
                continue
            Ri = mt * self._seq_seconds(i, n)
            supply1 += n * T1 / Ri if i == j or Ri > T1 else n
            supply2 += n if Ri <= T2 else n * T2 / Ri
        return need1 - supply1, need2 - supply2

    def _spill_target(self, jpos: int, shortfall: float) -> int:
        """The eligible pool with room, from ranking position jpos on, whose marginal cost per
        token is lowest (see the module docstring); -1 if none can run the model."""
        inflight = self._inflight
        cap = self._cap
        S = self._S
        order = self._order
        want = math.ceil(shortfall - _EPS)
        best = -1
        best_cost = math.inf
        for pos in range(jpos, len(order)):
            k = order[pos]
            if not self._eligible(k) or inflight[k] >= cap[k]:
                continue
            if best >= 0 and self._cost[k] >= best_cost:
                continue  # even at full batch k costs more than the best so far
            r = inflight[k] % S[k]
            m = min(S[k], r + want + (self._extra(k) if pos == jpos else 0))
            tps = self._replica_tps(k, m)
            cost = self._price_s[k] / tps if tps > 0 else math.inf
            if cost < best_cost:
                best, best_cost = k, cost
        return best

    def _place_round_robin(self) -> str | None:
        n = len(self._names)
        start = self._rr_next
        for k in range(n):
            i = (start + k) % n
            if self._eligible(i) and self._inflight[i] < self._cap[i]:
                self._inflight[i] += 1
                self._rr_next = i + 1
                return self._names[i]
        return None

    # -- resume -------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a resumed controller needs, JSON-serialisable: the throughput model's online
        corrections, the rollout-length flow and the round-robin position. Rollouts in flight,
        top-up targets and pool versions are not saved: a resumed run restarts its rollouts.
        Nor are rollouts finished since their pool's last `observe`: their tokens are not
        measured yet, and a resumed run's samplers count from zero."""
        return {
            "lengths": {name: self._lengths.state(i).model_dump() for i, name in enumerate(self._names)},
            "round_robin_next": self._rr_next,
            "throughput": self.throughput.state(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state()` returned and re-rank. An empty dict changes nothing; a
        malformed one, or one naming a pool this scheduler does not have, raises ValueError
        naming the field or pool, and changes nothing."""
        if not state:
            return
        parsed = parse_state(_SchedulerState, state, "scheduler state", lambda s: s.lengths, self._names)
        self.throughput.load_state(parsed.throughput)  # validates before changing anything
        for name, st in parsed.lengths.items():
            self._lengths.load(self._index[name], st)
        self._lengths.refresh()
        self._rr_next = parsed.round_robin_next % len(self._names)
        self._rerank()

    # -- views ----------------------------------------------------------------------------

    def _idx(self, pool: str) -> int:
        try:
            return self._index[pool]
        except KeyError:
            raise KeyError(f"no pool {pool!r}; pools: {', '.join(self._names)}") from None

    @property
    def demand(self) -> int:
        return self._demand

    @property
    def trainer_version(self) -> int:
        return self._trainer_version

    @property
    def mean_rollout_tokens(self) -> float:
        """The current estimate of generated tokens per rollout."""
        return self._lengths.mean

    def in_flight(self, pool: str) -> int:
        return self._inflight[self._idx(pool)]

    def capacity(self, pool: str) -> int:
        return self._cap[self._idx(pool)]

    def ranking(self) -> list[str]:
        """Pool names from cheapest to dearest expected cost per token at full batch."""
        return [self._names[i] for i in self._order]

    def would_spill(self, pool: str) -> bool:
        """Whether the starvation test of rule 4 passes for `pool` now, as if it were the first
        eligible pool with a free slot (a diagnostic)."""
        i = self._idx(pool)
        pos = self._order.index(i)
        before = self._order[:pos]
        eligible = [k for k in before if self._eligible(k)]
        lagging = [k for k in before if not self._eligible(k) and self._inflight[k]]
        return self._shortfall(pos, i, sum(self._pool_tps[k] for k in eligible), lagging)[0] > _EPS

    def states(self) -> list[PoolState]:
        """Every pool's state, cheapest first."""
        return [
            PoolState(
                name=self._names[i],
                capacity=self._cap[i],
                in_flight=self._inflight[i],
                version=self._ver[i],
                staleness_budget=self._budget[i],
                eligible=self._eligible(i),
                usd_per_mtok=self._cost[i] * 1e6,
                tokens_per_s_per_gpu=self._tps[i],
                rank=rank,
                replica_gpus=self._g[i],
                busy_replicas=-(-self._inflight[i] // self._S[i]),
            )
            for rank, i in enumerate(self._order)
        ]
