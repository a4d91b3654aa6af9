"""Rollout bookkeeping: GRPO groups, slots, staleness drops and retries.

Pure Python, no I/O. The controller asks it which rollout to start next, hands it
finished trajectories, and takes training batches from it. Every rollout slot
that enters is accounted for until the end of the run: it is trained, still
buffered (queued, in flight or done but not yet trained), or its group was
abandoned after repeated environment failures or dropped for zero reward variance.
Nothing is lost silently.

Staleness (docs/architecture.md, Staleness and versions): a trajectory trained at
trainer version k has staleness k − (oldest policy version among its tokens). When a
batch is assembled, a trajectory over its pool's budget is dropped and its slot
re-queued ahead of new work; its group waits until the slot is filled again by a
fresh rollout.

Zero-variance groups (`filter_zero_variance`, DAPO's dynamic sampling): a group whose
rewards are all equal once it completes has every GRPO advantage 0 and carries no signal;
it is dropped (counted) and the producer samples a new group in its place. At most
`max_zero_variance_drops` groups are dropped between two batches taken; past that bound
they are kept and trained as they are, so a task that every reply solves (or every reply
fails) slows the run down by a bounded factor and never stalls it.

Held trajectories (`actors.types.TrajectoryRef`, with a `key`): the tensors stay with an
environment actor, which must be told when the buffer lets one go untrained (stale,
rollback, zero variance, skipped group); `take_discarded` hands those over. `drop_lost`
re-queues the slots of refs whose holder lost them.

The counters live in one `BufferCounters` model, which the controller's
checkpointed state owns and hands to the buffer, so a resumed run continues them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["BufferCounters", "Drop", "Group", "RolloutBuffer", "Slot"]


class BufferCounters(BaseModel):
    """What entered the buffer and where it went; `groups_in` = trained + buffered + skipped
    + zero_variance."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    groups_in: int = Field(default=0, ge=0)
    """GRPO groups (prompts) that entered the buffer."""
    groups_trained: int = Field(default=0, ge=0)
    """Groups trained on."""
    groups_skipped: int = Field(default=0, ge=0)
    """Groups given up after a slot failed `max_attempts` times (an environment that keeps
    failing on that prompt); counted, never silent."""
    rollouts_trained: int = Field(default=0, ge=0)
    """Trajectories trained on."""
    dropped_stale: int = Field(default=0, ge=0)
    """Trajectories over their pool's staleness budget when a batch was assembled (retried)."""
    dropped_failed: int = Field(default=0, ge=0)
    """Failed episodes (retried up to `max_attempts` per slot)."""
    dropped_rollback: int = Field(default=0, ge=0)
    """Trajectories from weights newer than a restored trainer checkpoint (retried)."""
    groups_zero_variance: int = Field(default=0, ge=0)
    """Complete groups whose rewards were all equal, dropped untrained (`filter_zero_variance`;
    a new group replaces each)."""
    rollouts_zero_variance: int = Field(default=0, ge=0)
    """Trajectories of those groups."""
    zero_variance_kept: int = Field(default=0, ge=0)
    """Zero-variance groups kept and trained because the drop bound between two batches was
    reached."""
    dropped_lost: int = Field(default=0, ge=0)
    """Held trajectories lost before they were trained (their environment actor died or
    restarted, or did not answer the trainer's fetch); retried."""


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
    checked_at: int | None = None  # trainer version its staleness was last checked at, complete

    @property
    def complete(self) -> bool:
        return len(self.done) == self.size


@dataclass(frozen=True)
class Drop:
    """A trajectory that was not trained on, and why."""

    slot: Slot
    pool: str
    reason: str  # "stale" | "failed" | "skipped" | "rollback" | "zero_variance" | "lost" | "duplicate"
    staleness: int | None
    error: str | None


class RolloutBuffer:
    """Groups in flight and done, in arrival order; see the module docstring.

    Trajectories are anything with `pool`, `failed`, `error`, `oldest_version` and
    `newest_version` (actors.types.Trajectory). `max_attempts` bounds retries of one slot
    after environment failures; a group whose slot fails that often is skipped (counted).
    `filter_zero_variance` and `max_zero_variance_drops`: see the module docstring.
    """

    def __init__(
        self,
        group_size: int,
        max_attempts: int = 3,
        counters: BufferCounters | None = None,
        *,
        filter_zero_variance: bool = False,
        max_zero_variance_drops: int = 0,
    ) -> None:
        self.group_size = group_size
        self.max_attempts = max_attempts
        self.counters = counters if counters is not None else BufferCounters()
        self.filter_zero_variance = filter_zero_variance
        self.max_zero_variance_drops = max_zero_variance_drops
        self._zero_variance_since_batch = 0
        self._groups: dict[str, Group] = {}
        self._fresh: deque[Slot] = deque()
        self._retry: deque[Slot] = deque()
        self._in_flight: set[tuple[str, int]] = set()
        self._done = 0  # finished trajectories held, over every group
        self._discarded: list[Any] = []  # held trajectories let go untrained (take_discarded)

    # -- producing -------------------------------------------------------------
    def add_group(self, group_id: str, prompt_id: str, task: Any, *, counted: bool = False) -> None:
        """A new group at the back of the queue. `counted`: it already entered `groups_in`
        (a prompt that was buffered when the run stopped, re-added on resume)."""
        if group_id in self._groups:
            raise ValueError(f"group {group_id!r} already in the buffer")
        self._groups[group_id] = Group(group_id, prompt_id, task, self.group_size)
        self._fresh.extend(Slot(group_id, prompt_id, i) for i in range(self.group_size))
        if not counted:
            self.counters.groups_in += 1

    def next_slot(self) -> Slot | None:
        """The next rollout to start: retries first, then new work; None when there is none."""
        queue = self._retry if self._retry else self._fresh
        if not queue:
            return None
        slot = queue.popleft()
        self._in_flight.add((slot.group_id, slot.index))
        return slot

    def head(self) -> Slot | None:
        """The slot `next_slot` would return, left in the queue."""
        queue = self._retry if self._retry else self._fresh
        return queue[0] if queue else None

    def requeue(self, slot: Slot) -> None:
        """Put back a slot that was taken but did not finish (no pool had room, its weights
        were not there yet, its sampler died); dropped if its group was skipped meanwhile."""
        self._in_flight.discard((slot.group_id, slot.index))
        if slot.group_id in self._groups:
            self._retry.appendleft(slot)

    def task_of(self, slot: Slot) -> Any | None:
        """The slot's task; None if its group was skipped meanwhile."""
        group = self._groups.get(slot.group_id)
        return group.task if group is not None else None

    def complete(self, slot: Slot, traj: Any) -> Drop | None:
        """Record a finished rollout. A failed one is retried (or abandons its group); the
        last one of a zero-variance group drops the group (reason "zero_variance") when
        filtering is on and the bound allows. A slot holds exactly one trajectory: a second
        one for a slot already done is not recorded (reason "duplicate", nothing counted)."""
        group = self._groups.get(slot.group_id)
        if group is not None and slot.index in group.done:
            self._discard(traj)
            return Drop(slot, traj.pool, "duplicate", None, None)
        self._in_flight.discard((slot.group_id, slot.index))
        if group is None:  # skipped meanwhile
            self._discard(traj)
            return None
        if traj.failed:
            self.counters.dropped_failed += 1
            drop = Drop(slot, traj.pool, "failed", None, traj.error)
            if slot.attempt + 1 >= self.max_attempts:
                self._skip(group)
                drop = Drop(slot, traj.pool, "skipped", None, traj.error)
            else:
                self._retry.append(Slot(slot.group_id, slot.prompt_id, slot.index, slot.attempt + 1))
            return drop
        group.done[slot.index] = (slot, traj)
        group.checked_at = None
        self._done += 1
        if self.filter_zero_variance and group.complete and len({float(t.reward) for _, t in group.done.values()}) == 1:
            if self._zero_variance_since_batch < self.max_zero_variance_drops:
                self._zero_variance_since_batch += 1
                del self._groups[group.group_id]
                self._done -= len(group.done)
                for _, t in group.done.values():
                    self._discard(t)
                self.counters.groups_zero_variance += 1
                self.counters.rollouts_zero_variance += group.size
                return Drop(slot, traj.pool, "zero_variance", None, None)
            self.counters.zero_variance_kept += 1
        return None

    def _discard(self, traj: Any) -> None:
        if getattr(traj, "key", None):
            self._discarded.append(traj)

    def take_discarded(self) -> list[Any]:
        """Held trajectories (those with a `key`) let go untrained since the last call."""
        out, self._discarded = self._discarded, []
        return out

    def drop_lost(self, lost: Callable[[Any], bool]) -> list[Drop]:
        """Drop finished trajectories for which `lost(traj)` holds (their holder no longer
        has them) and re-queue their slots, as they were (no attempt counted)."""
        drops = []
        for group in self._groups.values():
            for index, (slot, traj) in list(group.done.items()):
                if lost(traj):
                    del group.done[index]
                    group.checked_at = None
                    self._done -= 1
                    self.counters.dropped_lost += 1
                    drops.append(Drop(slot, traj.pool, "lost", None, None))
                    self._retry.append(Slot(slot.group_id, slot.prompt_id, slot.index, slot.attempt))
        return drops

    def _skip(self, group: Group) -> None:
        for _, traj in group.done.values():
            self._discard(traj)
        del self._groups[group.group_id]
        self._done -= len(group.done)
        self._retry = deque(s for s in self._retry if s.group_id != group.group_id)
        self._fresh = deque(s for s in self._fresh if s.group_id != group.group_id)
        self.counters.groups_skipped += 1

    def drop_newer_than(self, version: int) -> list[Drop]:
        """Drop finished trajectories with tokens from weights newer than `version` (the
        trainer went back to a checkpoint: those weights no longer exist) and re-queue
        their slots."""
        drops = []
        for group in self._groups.values():
            for index, (slot, traj) in list(group.done.items()):
                if traj.newest_version > version:
                    del group.done[index]
                    self._discard(traj)
                    self._done -= 1
                    self.counters.dropped_rollback += 1
                    drops.append(Drop(slot, traj.pool, "rollback", None, None))
                    self._retry.append(Slot(slot.group_id, slot.prompt_id, slot.index, slot.attempt))
        return drops

    def put_back(self, groups: Iterable[Group]) -> None:
        """Return groups taken by `take_batch` whose step never happened, ahead of the rest."""
        back = {g.group_id: g for g in groups}
        for g in back.values():
            self._done += len(g.done)
            self.counters.groups_trained -= 1
            self.counters.rollouts_trained -= g.size
        self._groups = {**back, **self._groups}

    def buffered_prompts(self) -> list[Any]:
        """Tasks of the groups still buffered, oldest first (saved on stop, replayed on resume)."""
        return [g.task for g in self._groups.values()]

    # -- consuming -------------------------------------------------------------
    def take_batch(
        self, n_groups: int, trainer_version: int, budget_of: Callable[[str], int]
    ) -> tuple[list[Group], list[Drop]]:
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
            # Staleness only grows with the trainer's version: a complete group checked at
            # this version (and not changed since) has nothing to drop.
            if group.checked_at != trainer_version:
                for index, (slot, traj) in list(group.done.items()):
                    staleness = trainer_version - traj.oldest_version
                    if staleness > budget_of(traj.pool):
                        del group.done[index]
                        self._discard(traj)
                        self._done -= 1
                        self.counters.dropped_stale += 1
                        drops.append(Drop(slot, traj.pool, "stale", staleness, None))
                        self._retry.append(Slot(slot.group_id, slot.prompt_id, slot.index, slot.attempt))
                if group.complete:
                    group.checked_at = trainer_version
            if group.complete and len(ready) < n_groups:
                ready.append(group)
        if len(ready) < n_groups:
            return [], drops
        self._zero_variance_since_batch = 0
        for group in ready:
            del self._groups[group.group_id]
            self._done -= len(group.done)
            self.counters.groups_trained += 1
            self.counters.rollouts_trained += group.size
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
        return self._done

    def awaited(self, n_groups: int) -> list[tuple[str, int]]:
        """(group id, index) of every rollout not done yet in the groups a batch of `n_groups`
        waits for: the oldest incomplete groups, as many as complete ones are missing (none
        when `n_groups` complete groups are here)."""
        complete, incomplete = 0, []
        for g in self._groups.values():
            if g.complete:
                complete += 1
            else:
                incomplete.append(g)
        return [
            (g.group_id, i) for g in incomplete[: max(0, n_groups - complete)] for i in range(g.size) if i not in g.done
        ]

    def complete_groups(self) -> int:
        return sum(g.complete for g in self._groups.values())

    def counts(self) -> dict[str, int]:
        return {
            **self.counters.model_dump(),
            "groups_buffered": self.groups_buffered,
            "rollouts_in_flight": self.in_flight,
        }
