"""Hedged rollouts: a straggler that the next batch waits for is started again elsewhere.

A rollout whose sampler stops answering (its host's link cut, a wedged process) ends only
when the liveness watcher names that sampler unresponsive (`[faults] unresponsive_after_s`),
and a step whose batch needs its group waits that long. So when the batch due next waits
for rollouts in flight (the oldest incomplete groups, as many as complete groups are
missing), one of those that has run `[faults] hedge_after_p90` times its pool's p90 rollout
duration (over its recent finished rollouts; all pools' while it has few), and at least
`hedge_min_s`, gets a duplicate: on another rank of any pool with a free scheduler slot,
holding weights no older than the original asked for nor its own pool's budget allows, and
not on the original's `flotilla host` (ranks on the controller's machine are separate
processes, so another one of them serves).

Contracts:

- One trajectory per slot. The first attempt to *finish* (it returned a trajectory, failed
  or not; one lost with its sampler's link did not finish) is the slot's; its twin is
  cancelled and whatever the twin returns is discarded. An attempt that ends unfinished
  while its twin runs leaves the slot to the twin; the last one to end unfinished re-queues
  the slot, as without hedging. At most two attempts of a slot run at once.
- Accounting: each attempt holds its own scheduler slot (a hedge takes it with
  `Scheduler.take`), rank and env-rank counters; each frees them when it ends (`complete`
  when it returned a trajectory, `release` otherwise), kept or discarded.
- Counts: per pool `hedges` (duplicates started on it) and `hedges_won` (those whose
  trajectory was kept), in each step's `pools` record of metrics.jsonl; each hedge is a
  `rollout.hedge` span.

Single trio thread, no I/O: the producer asks `due`/`stragglers` and starts the hedges.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from orchestrator.state.buffer import Slot

if TYPE_CHECKING:
    from orchestrator.controller._pools import PoolView

__all__ = ["Attempt", "Hedger"]

DURATIONS_KEPT = 256
"""Finished rollout durations kept per pool for its p90."""

MIN_DURATIONS = 8
"""A pool with fewer finished rollouts than this is judged by every pool's durations."""

REFRESH_EVERY = 16
"""The limits are recomputed once this many rollouts finished since they last were."""

RECHECK_S = 0.5
"""Longest wait between two looks for stragglers while rollouts run (the looks that changes
in the buffer or the trainer's version prompt come sooner)."""


@dataclass(eq=False)
class Attempt:
    """One run of a slot's rollout on sampler `rank` of `pool` with env rank `env`."""

    slot: Slot
    pool: PoolView
    rank: int
    env: int
    min_version: int
    started: float  # trio time
    hedge: bool = False  # a duplicate of a straggler
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    discarded: bool = False  # its twin finished first: its result goes nowhere

    @property
    def key(self) -> tuple[str, int]:
        return self.slot.group_id, self.slot.index


class Hedger:
    """The attempts in flight per slot, recent rollout durations per pool and the hedge
    counts (see the module docstring). `after_p90` None: nothing is ever hedged."""

    def __init__(self, after_p90: float | None, min_s: float, pools: Iterable[str]) -> None:
        self.after_p90 = after_p90
        self.min_s = min_s
        self.attempts: dict[tuple[str, int], list[Attempt]] = {}
        names = list(pools)
        self._durations: dict[str, deque[float]] = {n: deque(maxlen=DURATIONS_KEPT) for n in names}
        self._limit: dict[str, float | None] = {}  # per pool, cached (see REFRESH_EVERY)
        self._new = 0  # durations since the limits were last recomputed
        self.hedges = dict.fromkeys(names, 0)
        self.won = dict.fromkeys(names, 0)
        self.next_check = -math.inf
        self._seen: Any = None

    # -- attempts --------------------------------------------------------------------
    def started(self, attempt: Attempt) -> None:
        self.attempts.setdefault(attempt.key, []).append(attempt)
        if attempt.hedge:
            self.hedges[attempt.pool.name] += 1

    def ended(self, attempt: Attempt, finished: bool, seconds: float | None) -> bool:
        """`attempt` ended; whether its outcome is the slot's. `finished`: it returned a
        trajectory (not one lost with its sampler's link); `seconds`: its duration when it
        succeeded (it joins its pool's durations). Finishing first cancels its twin, whose
        result is then discarded; ending unfinished while the twin runs leaves the slot to it."""
        twins = self.attempts[attempt.key]
        twins.remove(attempt)
        if not twins:
            del self.attempts[attempt.key]
        if attempt.discarded:
            return False
        if not finished:
            return not twins
        for t in twins:
            t.discarded = True
            t.scope.cancel()
        if attempt.hedge:
            self.won[attempt.pool.name] += 1
        if seconds is not None:
            durations = self._durations[attempt.pool.name]
            durations.append(seconds)
            self._new += 1
            if self._new >= REFRESH_EVERY or len(durations) <= MIN_DURATIONS:
                self._limit.clear()
                self._new = 0
        return True

    # -- stragglers ------------------------------------------------------------------
    def limit(self, pool: str) -> float | None:
        """Seconds after which a rollout on `pool` is a straggler; None: no durations known yet."""
        if pool in self._limit:
            return self._limit[pool]
        window: Iterable[float] = self._durations[pool]
        if len(self._durations[pool]) < MIN_DURATIONS:
            window = [d for ds in self._durations.values() for d in ds]
        ordered = sorted(window)
        out = None
        if len(ordered) >= MIN_DURATIONS and self.after_p90 is not None:
            p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
            out = max(self.min_s, self.after_p90 * p90)
        self._limit[pool] = out
        return out

    def due(self, now: float, seen: Any) -> bool:
        """Whether to look for stragglers now: hedging is on, rollouts run, and a straggler's
        time came or what the next batch waits for may have changed (`seen` differs from
        the last look's)."""
        if self.after_p90 is None or not self.attempts:
            return False
        return now >= self.next_check or seen != self._seen

    def stragglers(self, awaited: list[tuple[str, int]], now: float, seen: Any) -> list[Attempt]:
        """The lone, not discarded attempts of slots in `awaited` that have run past their
        pool's limit; sets the time of the next look (the next of them to pass it, or
        RECHECK_S from now)."""
        self._seen = seen
        out, nxt = [], now + RECHECK_S
        for key in awaited:
            running = self.attempts.get(key)
            if running is None or len(running) != 1:
                continue
            a = running[0]
            if a.discarded:  # its twin finished (failed: the slot is queued again); it is ending
                continue
            limit = self.limit(a.pool.name)
            if limit is None:
                continue
            if a.started + limit <= now:
                out.append(a)
            else:
                nxt = min(nxt, a.started + limit)
        self.next_check = nxt
        return out

    def wake_at(self) -> float:
        """When a waiting producer should look for stragglers again (inf: on a change only)."""
        return self.next_check if self.after_p90 is not None and self.attempts else math.inf

    def stats(self, pool: str) -> dict[str, int]:
        """`hedges` started on `pool` and `hedges_won` (kept), for metrics.jsonl."""
        return {"hedges": self.hedges[pool], "hedges_won": self.won[pool]}
