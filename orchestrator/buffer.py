"""Rollout bookkeeping: GRPO groups, slots, staleness drops and retries.

Pure Python, no I/O. The controller asks it which rollout to start next, hands it
finished trajectories, and takes training batches from it. Every rollout slot
that enters is accounted for until the end of the run: it is trained, still
buffered (queued, in flight or done but not yet trained), or its group was
abandoned after repeated environment failures. Nothing is lost silently.

Staleness (DESIGN §4): a trajectory trained at trainer version k has staleness
k − (oldest policy version among its tokens). When a batch is assembled, a
trajectory over its pool's budget is dropped and its slot re-queued ahead of new
work; its group waits until the slot is filled again by a fresh rollout.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

__all__ = ["Drop", "Group", "RolloutBuffer", "Slot"]


class _Trajectory(Protocol):
    pool: str
    failed: bool

    @property
    def min_version(self) -> int: ...


@dataclass(frozen=True)
class Slot:
    """One rollout to produce: sample `index` of group `group_id`."""

    group_id: str
    prompt_id: str
    index: int
    attempt: int = 0


@dataclass
class Group:
    group_id: str
    prompt_id: str
    task: Any
    size: int
    done: dict[int, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.done) == self.size


@dataclass(frozen=True)
class Drop:
    """A trajectory that was not trained on, and why."""

    slot: Slot
    pool: str
    reason: str  # "stale" | "failed"
    staleness: int | None
    error: str | None


class RolloutBuffer:
    """Groups in flight and done, in arrival order; see the module docstring.

    `min_version_of(traj)` returns the oldest policy version among a trajectory's
    generated tokens. `max_attempts` bounds retries of one slot after environment
    failures; a group whose slot fails that often is abandoned (counted).
    """

    def __init__(self, group_size: int, min_version_of: Callable[[Any], int],
                 max_attempts: int = 3) -> None:
        self.group_size = group_size
        self.max_attempts = max_attempts
        self._min_version = min_version_of
        self._groups: dict[str, Group] = {}
        self._fresh: deque[Slot] = deque()
        self._retry: deque[Slot] = deque()
        self._in_flight: set[tuple[str, int]] = set()
        self.groups_in = 0
        self.groups_trained = 0
        self.groups_abandoned = 0
        self.rollouts_trained = 0
        self.dropped_stale = 0
        self.dropped_failed = 0

    # -- producing -------------------------------------------------------------
    def add_group(self, group_id: str, prompt_id: str, task: Any) -> None:
        if group_id in self._groups:
            raise ValueError(f"group {group_id!r} already in the buffer")
        self._groups[group_id] = Group(group_id, prompt_id, task, self.group_size)
        self._fresh.extend(Slot(group_id, prompt_id, i) for i in range(self.group_size))
        self.groups_in += 1

    def next_slot(self) -> Slot | None:
        """The next rollout to start: retries first, then new work; None when there is none."""
        queue = self._retry if self._retry else self._fresh
        if not queue:
            return None
        slot = queue.popleft()
        self._in_flight.add((slot.group_id, slot.index))
        return slot

    def requeue(self, slot: Slot) -> None:
        """Put back a slot that was taken but never started (e.g. no pool had capacity)."""
        self._in_flight.discard((slot.group_id, slot.index))
        self._retry.appendleft(slot)

    def task_of(self, slot: Slot) -> Any:
        return self._groups[slot.group_id].task

    def complete(self, slot: Slot, traj: Any) -> Drop | None:
        """Record a finished rollout. A failed one is retried (or abandons its group)."""
        self._in_flight.discard((slot.group_id, slot.index))
        group = self._groups.get(slot.group_id)
        if group is None:  # abandoned meanwhile
            return None
        if getattr(traj, "failed", False):
            self.dropped_failed += 1
            drop = Drop(slot, traj.pool, "failed", None, getattr(traj, "error", None))
            if slot.attempt + 1 >= self.max_attempts:
                self._abandon(group)
            else:
                self._retry.append(Slot(slot.group_id, slot.prompt_id, slot.index, slot.attempt + 1))
            return drop
        group.done[slot.index] = (slot, traj)
        return None

    def _abandon(self, group: Group) -> None:
        del self._groups[group.group_id]
        self._retry = deque(s for s in self._retry if s.group_id != group.group_id)
        self._fresh = deque(s for s in self._fresh if s.group_id != group.group_id)
        self.groups_abandoned += 1

    # -- consuming -------------------------------------------------------------
    def take_batch(self, n_groups: int, trainer_version: int,
                   budget_of: Callable[[str], int]) -> tuple[list[Group], list[Drop]]:
        """Up to `n_groups` complete groups whose every trajectory is within its pool's budget.

        Over-budget trajectories found on the way are dropped and their slots re-queued
        (ahead of new work); their groups stay until refilled. Returns (groups, drops);
        an empty list of groups means "not enough yet" and nothing was consumed.
        """
        ready: list[Group] = []
        drops: list[Drop] = []
        for group in list(self._groups.values()):
            if not group.complete:
                continue
            for index, (slot, traj) in list(group.done.items()):
                staleness = trainer_version - self._min_version(traj)
                if staleness > budget_of(traj.pool):
                    del group.done[index]
                    self.dropped_stale += 1
                    drops.append(Drop(slot, traj.pool, "stale", staleness, None))
                    self._retry.append(Slot(slot.group_id, slot.prompt_id, slot.index, slot.attempt))
            if group.complete and len(ready) < n_groups:
                ready.append(group)
        if len(ready) < n_groups:
            return [], drops
        for group in ready:
            del self._groups[group.group_id]
            self.groups_trained += 1
            self.rollouts_trained += group.size
        return ready, drops

    # -- accounting ------------------------------------------------------------
    @property
    def groups_buffered(self) -> int:
        return len(self._groups)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def queued(self) -> int:
        return len(self._fresh) + len(self._retry)

    def done_rollouts(self) -> int:
        """Finished trajectories waiting to be trained (in complete and incomplete groups)."""
        return sum(len(g.done) for g in self._groups.values())

    def complete_groups(self) -> int:
        return sum(g.complete for g in self._groups.values())

    def counts(self) -> dict[str, int]:
        return {
            "groups_in": self.groups_in,
            "groups_trained": self.groups_trained,
            "groups_buffered": self.groups_buffered,
            "groups_abandoned": self.groups_abandoned,
            "rollouts_trained": self.rollouts_trained,
            "rollouts_in_flight": self.in_flight,
            "dropped_stale": self.dropped_stale,
            "dropped_failed": self.dropped_failed,
        }

    def state(self) -> dict[str, int]:
        """Counters to checkpoint (buffered groups themselves are regenerated on resume)."""
        return {k: getattr(self, k) for k in (
            "groups_in", "groups_trained", "groups_abandoned", "rollouts_trained",
            "dropped_stale", "dropped_failed")}
