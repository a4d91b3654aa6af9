"""Cost-aware rollout placement.

State per pool: capacity (its `max_concurrent_rollouts`), rollouts in flight, the version of
the weights it holds and its staleness budget. State of the trainer, set by the controller:
its version; its *demand* D (rollouts its next step still needs that have not finished); the
*horizon* h (seconds until that step starts; 0 when it is already waiting); and its
consumption rate c (rollouts per second it takes when never starved, batch ÷ train-step
seconds; 0 to look one step ahead only).

Rule (policy "cost"). Pools are ranked by expected cost per token, price per GPU-hour ÷
estimated tokens/s per GPU at full batch (roofline × online factor), ties broken by name;
the ranking is recomputed only when an estimate changes. A pool is *eligible* when
trainer_version − pool_version ≤ its staleness budget. Walking the ranking over eligible pools:

- the cheapest eligible pool takes the rollout whenever it has a free slot (its tokens are
  the cheapest there are, so generating ahead of need costs nothing extra);
- the first dearer eligible pool with a free slot, k, takes it only if the trainer would
  otherwise starve: need(T) > supply(T) at T = max(h, R_k), the later of when the trainer
  needs rollouts and when one started on k now would finish. Otherwise `place` returns None
  (wait for a slot on a cheaper pool). Here
    R_i       = mean rollout tokens ÷ per-sequence tokens/s of pool i at full batch,
    need(T)   = D + c · max(0, T − h),
    supply(T) = Σ over the cheaper eligible pools (all full) of capacity_i · T ÷ R_i
                  (a full pool finishes a rollout per slot every R_i: those in flight and
                   those it starts in freed slots)
              + Σ over every other pool of in_flight_i · min(1, T ÷ R_i)
                  (rollouts already running finish uniformly over the next R_i).

A decision is O(pools) over plain lists: the walk, plus one supply sum when a spill is
considered. Each placement on a dearer pool raises its in-flight count and so the supply of
the next decision: spills stop once the shortfall is covered.

Policy "round_robin" (a baseline): pools in name order, in turn, skipping full or lagging ones,
regardless of cost and demand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hardware.pools import PoolConfig
from hardware.throughput import ThroughputModel

__all__ = ["Scheduler", "PoolState"]


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
    tokens_per_s_per_gpu: float
    rank: int


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
        tokens_alpha: float = 0.05,
    ) -> None:
        if not pools:
            raise ValueError("a scheduler needs at least one pool")
        if policy not in ("cost", "round_robin"):
            raise ValueError(f"policy must be 'cost' or 'round_robin', got {policy!r}")
        if mean_rollout_tokens <= 0:
            raise ValueError(f"mean_rollout_tokens must be > 0, got {mean_rollout_tokens}")
        self.policy = policy
        self.throughput = throughput
        self._mean_tokens = float(mean_rollout_tokens)
        self._tokens_alpha = tokens_alpha
        # Parallel lists indexed by pool position in name order: attribute-free inner loops.
        ordered = sorted(pools, key=lambda p: p.name)
        self._pools = ordered
        self._names = [p.name for p in ordered]
        self._index = {n: i for i, n in enumerate(self._names)}
        self._cap = [p.capacity for p in ordered]
        self._budget = [p.staleness_budget for p in ordered]
        self._inflight = [0] * len(ordered)
        self._ver = [0] * len(ordered)
        self._trainer_version = 0
        self._demand = 0
        self._horizon = 0.0
        self._consume = 0.0
        self._rr_next = 0
        self._rerank()

    # -- ranking ---------------------------------------------------------------------------

    def _rerank(self) -> None:
        n = len(self._pools)
        self._cost = [self.throughput.usd_per_token(name) for name in self._names]
        self._tps = [self.throughput.estimate(name) for name in self._names]
        # slot_s: seconds one sequence takes per token on a full pool, so R_i = tokens × slot_s.
        self._slot_s = [
            (p.capacity / p.count) / tps if tps > 0 else math.inf for p, tps in zip(self._pools, self._tps, strict=True)
        ]
        self._order = sorted(range(n), key=lambda i: (self._cost[i], self._names[i]))

    # -- inputs from the controller ---------------------------------------------------------

    def set_trainer(self, version: int, demand: int, horizon_s: float = 0.0, consume_per_s: float = 0.0) -> None:
        """The trainer's version; `demand`, the rollouts its next step still needs that have not
        finished (in flight ones are not subtracted); `horizon_s`, seconds until that step
        starts (0: it is waiting now); `consume_per_s`, rollouts per second it takes when never
        starved (batch ÷ train-step seconds; 0 looks at the next step only)."""
        self._trainer_version = version
        self._demand = demand
        self._horizon = max(0.0, horizon_s)
        self._consume = max(0.0, consume_per_s)

    def set_pool_version(self, pool: str, version: int) -> None:
        """The weight version `pool` now holds (after a sync)."""
        self._ver[self._idx(pool)] = version

    def complete(self, pool: str, tokens: int | None = None) -> None:
        """A rollout on `pool` finished, failed or was aborted: its slot is free again.
        `tokens` (generated) refines the mean rollout length used for the starvation test."""
        i = self._idx(pool)
        if self._inflight[i] <= 0:
            raise ValueError(f"complete({pool!r}) with no rollout in flight there")
        self._inflight[i] -= 1
        if tokens is not None and tokens > 0:
            self._mean_tokens += self._tokens_alpha * (tokens - self._mean_tokens)

    def observe(self, pool: str, tokens: float, gpu_seconds: float, batch_per_gpu: float | None = None) -> float:
        """A throughput measurement for `pool` (see ThroughputModel.observe); when the batch is
        not given, the pool's current rollouts in flight per GPU stand for it. Re-ranks the
        pools; returns the pool's new factor."""
        i = self._idx(pool)
        if batch_per_gpu is None:
            batch_per_gpu = max(1.0, self._inflight[i] / self._pools[i].count)
        f = self.throughput.observe(pool, tokens, gpu_seconds, batch_per_gpu)
        self._rerank()
        return f

    # -- the decision ---------------------------------------------------------------------

    def place(self) -> str | None:
        """The pool for the next rollout, its slot taken; None means wait."""
        if self.policy == "round_robin":
            return self._place_round_robin()
        tv = self._trainer_version
        inflight = self._inflight
        cap = self._cap
        ver = self._ver
        budget = self._budget
        first = True
        for pos, i in enumerate(self._order):
            if tv - ver[i] > budget[i]:
                continue
            if inflight[i] < cap[i]:
                if first or self._starving(pos, i):
                    inflight[i] += 1
                    return self._names[i]
                return None
            first = False
        return None

    def _starving(self, pos: int, k: int) -> bool:
        """Would the trainer starve without a rollout on pool k (at ranking position pos)?"""
        mt = self._mean_tokens
        slot_s = self._slot_s
        h = self._horizon
        T = max(h, mt * slot_s[k])
        if math.isinf(T):  # the model does not run on pool k
            return False
        need = self._demand + self._consume * max(0.0, T - h)
        if need <= 0.0:
            return False
        tv = self._trainer_version
        ver = self._ver
        budget = self._budget
        inflight = self._inflight
        cap = self._cap
        supply = 0.0
        for r, i in enumerate(self._order):
            R = mt * slot_s[i]
            if r < pos and tv - ver[i] <= budget[i]:
                supply += cap[i] * T / R
            else:
                n = inflight[i]
                if n:
                    supply += n if T >= R else n * T / R
            if supply >= need:
                return False
        return True

    def _place_round_robin(self) -> str | None:
        n = len(self._names)
        tv = self._trainer_version
        start = self._rr_next
        for k in range(n):
            i = (start + k) % n
            if tv - self._ver[i] <= self._budget[i] and self._inflight[i] < self._cap[i]:
                self._inflight[i] += 1
                self._rr_next = i + 1
                return self._names[i]
        return None

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
        return self._mean_tokens

    def in_flight(self, pool: str) -> int:
        return self._inflight[self._idx(pool)]

    def capacity(self, pool: str) -> int:
        return self._cap[self._idx(pool)]

    def ranking(self) -> list[str]:
        """Pool names from cheapest to dearest expected cost per token."""
        return [self._names[i] for i in self._order]

    def would_spill(self, pool: str) -> bool:
        """Whether the starvation test passes for `pool` now, as if it were the first pool with a
        free slot (a diagnostic: `place` asks this only of that pool)."""
        i = self._idx(pool)
        return self._starving(self._order.index(i), i)

    def states(self) -> list[PoolState]:
        """Every pool's state, cheapest first."""
        rank = {i: r for r, i in enumerate(self._order)}
        tv = self._trainer_version
        return [
            PoolState(
                name=self._names[i],
                capacity=self._cap[i],
                in_flight=self._inflight[i],
                version=self._ver[i],
                staleness_budget=self._budget[i],
                eligible=tv - self._ver[i] <= self._budget[i],
                usd_per_mtok=self._cost[i] * 1e6,
                tokens_per_s_per_gpu=self._tps[i],
                rank=rank[i],
            )
            for i in self._order
        ]
