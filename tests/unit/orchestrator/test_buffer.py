"""The rollout buffer: staleness drops, retries, skipped groups, rollback and resume."""

from __future__ import annotations

from orchestrator.state.buffer import BufferCounters, RolloutBuffer


class _T:
    def __init__(self, pool: str, version: int, failed: bool = False, newest: int | None = None) -> None:
        self.pool, self.failed, self.error = pool, failed, "boom" if failed else None
        self.oldest_version = version
        self.newest_version = version if newest is None else newest


def test_buffer_drops_stale_trajectories_and_retries_their_slots():
    buf = RolloutBuffer(group_size=2, max_attempts=2)
    buf.add_group("g0", "p0", task="t")
    slots = [buf.next_slot(), buf.next_slot()]
    assert buf.next_slot() is None
    buf.complete(slots[0], _T("fast", version=3))
    buf.complete(slots[1], _T("slow", version=0))
    groups, drops = buf.take_batch(1, trainer_version=3, budget_of=lambda pool: 1)
    assert groups == [] and [(d.pool, d.staleness) for d in drops] == [("slow", 3)]
    retry = buf.next_slot()
    assert (retry.group_id, retry.index) == ("g0", 1)
    buf.complete(retry, _T("slow", version=3))
    groups, drops = buf.take_batch(1, trainer_version=3, budget_of=lambda pool: 1)
    assert [g.group_id for g in groups] == ["g0"] and drops == []
    c = buf.counts()
    assert c["groups_in"] == c["groups_trained"] == 1 and c["dropped_stale"] == 1


def test_a_group_failing_repeatedly_is_skipped_and_its_held_slots_vanish():
    buf = RolloutBuffer(group_size=2, max_attempts=2)
    buf.add_group("g0", "p0", task="t")
    held = buf.next_slot()  # taken by the producer, not started yet
    buf.complete(buf.next_slot(), _T("a", 0, failed=True))
    drop = buf.complete(buf.next_slot(), _T("a", 0, failed=True))
    assert drop is not None and drop.reason == "skipped" and drop.error == "boom"
    c = buf.counts()
    assert c["groups_skipped"] == 1 and c["groups_buffered"] == 0 and c["dropped_failed"] == 2
    assert buf.task_of(held) is None
    buf.requeue(held)  # the producer gives it back: it must not come out again
    assert buf.next_slot() is None
    assert c["groups_in"] == c["groups_trained"] + c["groups_buffered"] + c["groups_skipped"]


def test_rollback_drops_trajectories_from_weights_that_no_longer_exist():
    buf = RolloutBuffer(group_size=2)
    buf.add_group("g0", "p0", task="t")
    buf.complete(buf.next_slot(), _T("a", 3, newest=5))
    buf.complete(buf.next_slot(), _T("a", 2, newest=4))
    drops = buf.drop_newer_than(4)
    assert [(d.reason, d.slot.index) for d in drops] == [("rollback", 0)]
    assert buf.counters.dropped_rollback == 1
    assert buf.next_slot().index == 0


def test_put_back_returns_a_batch_ahead_of_the_rest_and_undoes_its_counts():
    buf = RolloutBuffer(group_size=1)
    for i in range(3):
        buf.add_group(f"g{i}", f"p{i}", task=i)
        buf.complete(buf.next_slot(), _T("a", 0))
    groups, _ = buf.take_batch(2, 0, lambda p: 0)
    assert buf.counters.groups_trained == 2
    buf.put_back(groups)
    assert buf.counters.groups_trained == 0 and buf.counters.rollouts_trained == 0
    assert buf.buffered_prompts() == [0, 1, 2]


def test_counters_are_shared_with_their_owner_and_resume_without_recounting():
    counters = BufferCounters(groups_in=5, groups_trained=4)
    buf = RolloutBuffer(group_size=1, counters=counters)
    buf.add_group("g4", "p4", task="t", counted=True)  # buffered at the stop: already in
    buf.add_group("g5", "p5", task="t")
    assert counters.groups_in == 6 and buf.counters is counters


def _done_by_walk(buf: RolloutBuffer) -> int:
    return sum(len(g.done) for g in buf._groups.values())


def test_a_complete_group_checked_at_one_version_is_dropped_from_at_a_later_one():
    buf = RolloutBuffer(group_size=2)
    buf.add_group("g0", "p0", task="t")
    buf.add_group("g1", "p1", task="t")
    for _ in range(2):
        buf.complete(buf.next_slot(), _T("a", version=1))
    # Two groups wanted, one complete: nothing taken, nothing stale at version 2.
    assert buf.take_batch(2, trainer_version=2, budget_of=lambda pool: 1) == ([], [])
    # The same complete group, now over budget: dropped although it was checked before.
    groups, drops = buf.take_batch(2, trainer_version=3, budget_of=lambda pool: 1)
    assert groups == [] and [d.staleness for d in drops] == [2, 2]
    assert buf.done_rollouts() == _done_by_walk(buf) == 0


def test_finished_trajectories_are_counted_through_every_path():
    buf = RolloutBuffer(group_size=2, max_attempts=1)
    for g in range(3):
        buf.add_group(f"g{g}", f"p{g}", task="t")
    slots = [buf.next_slot() for _ in range(6)]
    buf.complete(slots[0], _T("a", 0))
    buf.complete(slots[1], _T("a", 0))
    buf.complete(slots[2], _T("a", 0, newest=5))
    buf.complete(slots[3], _T("a", 0))
    buf.complete(slots[4], _T("a", 0))
    assert buf.done_rollouts() == _done_by_walk(buf) == 5
    buf.complete(slots[5], _T("a", 0, failed=True))  # skips g2 with its one done trajectory
    assert buf.done_rollouts() == _done_by_walk(buf) == 4
    buf.drop_newer_than(4)
    assert buf.done_rollouts() == _done_by_walk(buf) == 3
    groups, _ = buf.take_batch(1, trainer_version=0, budget_of=lambda pool: 1)
    assert [g.group_id for g in groups] == ["g0"]
    assert buf.done_rollouts() == _done_by_walk(buf) == 1
    buf.put_back(groups)
    assert buf.done_rollouts() == _done_by_walk(buf) == 3


class _R(_T):
    def __init__(self, reward: float) -> None:
        super().__init__("a", 0)
        self.reward = reward


def _fill(buf: RolloutBuffer, group_id: str, rewards: list[float]):
    buf.add_group(group_id, group_id, task=group_id)
    return [buf.complete(buf.next_slot(), _R(r)) for r in rewards]


def test_zero_variance_groups_are_dropped_up_to_the_bound_between_batches():
    buf = RolloutBuffer(group_size=3, filter_zero_variance=True, max_zero_variance_drops=2)
    # the last reply of an all-equal group drops it (any equal value, not only 0)
    assert _fill(buf, "g0", [0.0, 0.0, 0.0])[-1].reason == "zero_variance"
    assert _fill(buf, "g1", [1.0, 1.0, 0.0]) == [None, None, None]
    assert _fill(buf, "g2", [1.0, 1.0, 1.0])[-1].reason == "zero_variance"
    assert buf.groups_buffered == 1 and buf.counters.groups_zero_variance == 2
    assert buf.done_rollouts() == _done_by_walk(buf) == 3
    assert buf.counters.rollouts_zero_variance == 6
    # the bound is reached: the next zero-variance group is kept and trained
    assert _fill(buf, "g3", [0.5, 0.5, 0.5]) == [None, None, None]
    assert buf.counters.zero_variance_kept == 1
    groups, _ = buf.take_batch(2, trainer_version=0, budget_of=lambda pool: 1)
    assert [g.group_id for g in groups] == ["g1", "g3"]
    # a batch taken resets the bound
    assert _fill(buf, "g4", [0.0, 0.0, 0.0])[-1].reason == "zero_variance"
    c = buf.counts()
    assert (
        c["groups_in"] == c["groups_trained"] + c["groups_buffered"] + c["groups_skipped"] + c["groups_zero_variance"]
    )


def test_without_the_switch_zero_variance_groups_are_trained():
    buf = RolloutBuffer(group_size=2)
    assert _fill(buf, "g0", [0.0, 0.0]) == [None, None]
    groups, _ = buf.take_batch(1, trainer_version=0, budget_of=lambda pool: 1)
    assert [g.group_id for g in groups] == ["g0"] and buf.counters.groups_zero_variance == 0


def test_a_slot_holds_one_trajectory_and_a_second_is_refused_uncounted():
    buf = RolloutBuffer(group_size=2)
    buf.add_group("g0", "p0", task="t")
    first, second = buf.next_slot(), buf.next_slot()
    assert buf.complete(first, _T("a", version=0)) is None
    before = buf.counts()
    for twin in (_T("b", version=0), _T("b", version=0, failed=True)):  # a hedge that lost the race
        drop = buf.complete(first, twin)
        assert drop is not None and drop.reason == "duplicate" and drop.pool == "b"
    assert buf.counts() == before and buf.done_rollouts() == 1
    assert buf.in_flight == 1  # the other slot still runs
    buf.complete(second, _T("a", version=0))
    groups, _ = buf.take_batch(1, trainer_version=0, budget_of=lambda pool: 1)
    assert [t.pool for _, t in sorted(groups[0].done.values(), key=lambda st: st[0].index)] == ["a", "a"]


def test_awaited_names_the_unfinished_slots_of_the_groups_a_batch_waits_for():
    buf = RolloutBuffer(group_size=2)
    for g in ("g0", "g1", "g2"):
        buf.add_group(g, g.replace("g", "p"), task="t")
    slots = [buf.next_slot() for _ in range(6)]
    assert buf.awaited(2) == [("g0", 0), ("g0", 1), ("g1", 0), ("g1", 1)]
    buf.complete(slots[0], _T("a", version=0))
    buf.complete(slots[4], _T("a", version=0))
    buf.complete(slots[5], _T("a", version=0))  # g2 complete: a batch of 2 needs one of g0, g1
    assert buf.awaited(2) == [("g0", 1)]
    assert buf.awaited(1) == []  # g2 alone makes a batch of 1
