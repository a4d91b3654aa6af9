"""The controller's view of each sampler pool: the weights each rank holds, the rollouts it
runs, its liveness, and which ranks can take a rollout now (kept current cheaply: placement
asks several times per decision, over pools of hundreds of ranks)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import trio

from orchestrator.controller._liveness import Health
from orchestrator.controller.links import PoolLink

__all__ = ["Loads", "PoolView", "Versions"]


class Versions(list[int]):
    """Each rank's held weights version (-1: none, -2: must forget first); counts writes, so
    views derived from it (`PoolView.usable`) know when to recompute: `writes` counts every
    write, `holds` only those that change whether a rank holds weights at all (one that
    moves a rank from one version to a newer one leaves the usable ranks as they were)."""

    writes = 0
    holds = 0

    def __setitem__(self, index: int, value: int) -> None:  # type: ignore[override]
        if (self[index] < 0) != (value < 0):
            self.holds += 1
        super().__setitem__(index, value)
        self.writes += 1


class Loads(list[int]):
    """Rollouts in flight on each rank (written `loads[r] += 1` and `-= 1`), and `least`: the
    least loaded of a set of ranks without a pass over all of them. Placement asks once per
    decision, over hundreds of ranks; every write pushes the rank's new load on a heap of the
    set last asked about, and `least` drops the entries that later writes made stale."""

    def __init__(self, n: int) -> None:
        super().__init__([0] * n)
        self._ranks: list[int] | None = None  # the set the heap is for (the caller's list)
        self._members: set[int] = set()
        self._heap: list[tuple[int, int]] = []  # (load, rank); stale where the load moved on

    def __setitem__(self, rank: int, value: int) -> None:  # type: ignore[override]
        super().__setitem__(rank, value)
        if rank in self._members:
            heap = self._heap
            heapq.heappush(heap, (value, rank))
            if len(heap) > 4 * len(self._members) + 64:  # stale entries that never came up
                self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self[r], r) for r in self._ranks or ()]
        heapq.heapify(self._heap)

    def least(self, ranks: list[int]) -> int | None:
        """The rank in `ranks` with the fewest rollouts in flight, the lowest of equals; None
        if `ranks` is empty. `ranks` is a list its owner does not change: a view's cached
        usable ranks (the heap is rebuilt when another list is asked about)."""
        if ranks is not self._ranks:
            self._ranks, self._members = ranks, set(ranks)
            self._rebuild()
        heap = self._heap
        while heap:
            load, rank = heap[0]
            if self[rank] == load:
                return rank
            heapq.heappop(heap)
        return None


@dataclass
class PoolView:
    """The controller's view of one pool: what each rank holds and runs, and its liveness."""

    link: PoolLink
    versions: Versions  # weights each rank holds; -1: none (start, respawn, refused update)
    in_flight: Loads  # rollouts running on each rank
    marks: list[tuple[int, float]]  # each rank's (tokens, busy seconds) at the last step
    health: list[Health]  # each rank's liveness (`_liveness`)
    stats: list[dict[str, Any] | None]  # each rank's latest counters; None: none yet, or dead
    stats_call: list[trio.Event | None]  # set when the rank's outstanding stats call ends
    epochs: list[int]  # bumped when a rank's process is replaced
    flips: int = 0  # liveness changes of any rank (invalidates the usable-ranks cache)
    # (version holds, flips, the link's state changes) it was computed for, (usable ranks,
    # oldest, newest version), when an avoidance it excluded a rank for runs out, and the
    # version writes the oldest and newest were taken at
    _cache: tuple[int, int, Hashable, tuple[list[int], int, int], float, int] | None = None

    @classmethod
    def of(cls, link: PoolLink) -> PoolView:
        n = link.size
        view = cls(
            link,
            Versions([-1] * n),
            Loads(n),
            [(0, 0.0)] * n,
            [_sampler_health(link, r) for r in range(n)],
            [None] * n,
            [None] * n,
            [0] * n,
        )
        for h in view.health:
            h.on_flip = view._flipped
        return view

    def _flipped(self) -> None:
        self.flips += 1

    @property
    def name(self) -> str:
        return self.link.config.name

    def _usable(self) -> tuple[list[int], int, int]:
        """(usable ranks ascending, oldest and newest version among them). The ranks are
        recomputed only when a rank's holding weights at all, liveness, death, start,
        retirement or avoidance changed since the last call, or an avoidance it excluded a
        rank for has run out; the versions only when one was written."""
        changes = self.link.state_changes()
        cache = self._cache
        versions = self.versions
        # The check runs several times per placement decision: plain comparisons, and the
        # clock only while an avoidance is due to run out.
        if (
            cache is not None
            and cache[0] == versions.holds
            and cache[1] == self.flips
            and cache[2] == changes
            and (cache[4] == math.inf or trio.current_time() < cache[4])
        ):
            if cache[5] == versions.writes:
                return cache[3]
            # A rank moved to other weights (each rank's weights update once per step):
            # the same ranks, their oldest and newest taken again.
            ranks = cache[3][0]
            held = list(map(versions.__getitem__, ranks))
            usable = (ranks, min(held, default=-1), max(held, default=-1))
            self._cache = (*cache[:3], usable, cache[4], versions.writes)
            return usable
        now = trio.current_time()
        down = set(self.link.dead_ranks()) | set(self.link.starting_ranks())
        ranks, expires = [], math.inf
        for r, h in enumerate(self.health):
            if h.since is not None or h.retired or r in down or versions[r] < 0:
                continue
            if h.avoid_until > now:
                expires = min(expires, h.avoid_until)
                continue
            ranks.append(r)
        held = [versions[r] for r in ranks]
        usable = (ranks, min(held, default=-1), max(held, default=-1))
        self._cache = (versions.holds, self.flips, changes, usable, expires, versions.writes)
        return usable

    def usable(self) -> list[int]:
        """Ranks that can take a rollout now: constructed, answering, holding weights, not
        given up, not avoided."""
        return list(self._usable()[0])

    def present_hosts(self) -> list[str]:
        """Hosts serving the pool now: joined, not given up, answering."""
        return [h.host for h in self.health if h.host is not None and not h.retired and h.lost_at is None]

    def outage_stats(self, now: float) -> dict[str, Any]:
        """`up` (ranks usable now), `outages` (times a rank was lost) and `outage_s` (rank-
        seconds lost, the outages in progress included), for `metrics.jsonl`."""
        return {
            "up": len(self.usable()),
            "hosts": sum(1 for h in self.health if h.host is not None and not h.retired),
            "outages": sum(h.outages for h in self.health),
            "outage_s": round(sum(h.outage_total(now) for h in self.health), 3),
        }

    def held_version(self) -> int:
        """The oldest weights among the usable ranks (-1 when none is usable)."""
        return self._usable()[1]

    def newest_version(self) -> int:
        """The newest weights among the usable ranks (-1 when none is usable)."""
        return self._usable()[2]

    def pick_rank(self, min_version: int) -> int | None:
        """The usable rank holding weights no older than `min_version` with the fewest
        rollouts in flight (ties: the lowest rank); None if there is none."""
        ranks, oldest, newest = self._usable()
        if newest < min_version or not ranks:
            return None
        if oldest < min_version:  # some ranks still hold older weights: a pass over the rest
            versions = self.versions
            return min((r for r in ranks if versions[r] >= min_version), key=self.in_flight.__getitem__)
        return self.in_flight.least(ranks)

    def receiver(self, rank: int) -> str:
        return f"{self.name}/{rank}"


def _sampler_health(link: PoolLink, rank: int) -> Health:
    """A sampler rank's liveness record; a vacant rank of an elastic pool starts retired."""
    health = Health(f"sampler {link.config.name}/{rank}", host=link.host_of(rank))
    if link.config.elastic and health.host is None:
        health.retire()
    return health
