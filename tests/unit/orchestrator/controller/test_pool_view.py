"""The controller's per-pool view: which ranks can take a rollout, kept current as ranks
get weights, die, restart and stop answering."""

from __future__ import annotations

import trio

from hardware import PoolConfig
from orchestrator.controller._pools import Loads, PoolView

from .fakes import FakePool


def _view(size: int = 4) -> tuple[FakePool, PoolView]:
    pool = FakePool(PoolConfig(name="p", gpu="cpu", count=size), size)
    return pool, PoolView.of(pool)


async def test_usable_ranks_follow_versions_deaths_and_liveness():
    pool, view = _view()
    assert view.usable() == [] and view.pick_rank(0) is None and view.held_version() == -1
    for r, v in enumerate([3, 1, 2, 3]):
        view.versions[r] = v
    assert view.usable() == [0, 1, 2, 3]
    assert (view.held_version(), view.newest_version()) == (1, 3)
    assert view.pick_rank(2) == 0  # fewest in flight, lowest rank first
    view.in_flight[0] = 2
    assert view.pick_rank(2) == 2 and view.pick_rank(3) == 3 and view.pick_rank(4) is None
    pool.kill(2)
    assert view.usable() == [0, 1, 3] and view.pick_rank(2) == 3
    pool.dead.discard(2)  # its fresh process is up
    view.versions[2] = -1  # a respawned rank holds nothing until its keyframe
    assert view.usable() == [0, 1, 3]
    view.health[3].mark_unresponsive()
    assert view.usable() == [0, 1] and view.pick_rank(2) == 0
    view.health[3].mark_responsive()
    view.versions[2] = 4
    assert view.usable() == [0, 1, 2, 3] and view.newest_version() == 4 and view.pick_rank(4) == 2


async def test_a_copy_of_the_usable_ranks_does_not_change_the_view():
    _, view = _view(2)
    view.versions[0] = view.versions[1] = 0
    ranks = view.usable()
    ranks.clear()
    assert view.usable() == [0, 1]


async def test_retired_and_avoided_ranks_leave_the_view_and_avoided_ones_come_back_on_time():
    _, view = _view(3)
    for r in range(3):
        view.versions[r] = 1
    view.health[1].retire()
    assert view.usable() == [0, 2]
    view.health[1].join("tcp://10.0.0.2:5555", now=trio.current_time())
    assert view.usable() == [0, 1, 2]
    view.health[0].avoid(trio.current_time() + 0.05)
    assert view.usable() == [1, 2] and view.pick_rank(1) == 1
    await trio.sleep(0.06)  # the avoidance ran out: the cached view is recomputed
    assert view.usable() == [0, 1, 2]


async def test_oldest_and_newest_follow_each_update_and_a_forgotten_rank_leaves():
    _, view = _view(3)
    for r in range(3):
        view.versions[r] = 1
    assert view.usable() == [0, 1, 2] and (view.held_version(), view.newest_version()) == (1, 1)
    view.versions[1] = 2  # one rank applied the next update: the same ranks, a newer newest
    assert (view.held_version(), view.newest_version()) == (1, 2) and view.pick_rank(2) == 1
    view.versions[0] = view.versions[2] = 2  # the others too: the oldest moves up
    assert (view.held_version(), view.newest_version()) == (2, 2)
    view.versions[2] = 5
    view.versions[2] = 3  # written twice between two looks: the last write counts
    assert (view.held_version(), view.newest_version()) == (2, 3)
    view.versions[2] = -2  # must forget its weights first: out until it holds some again
    assert view.usable() == [0, 1] and view.newest_version() == 2 and view.pick_rank(3) is None
    view.versions[2] = 4
    assert view.usable() == [0, 1, 2] and (view.held_version(), view.newest_version()) == (2, 4)


def test_least_loaded_follows_every_write_and_every_set_of_ranks():
    """`Loads.least` against a pass over the ranks, through random launches, finishes and
    changes of the usable set (ranks that die with rollouts in flight, or come back idle)."""
    import random

    rng = random.Random(7)
    n = 40
    loads = Loads(n)
    ranks = list(range(n))
    checked = 0
    for step in range(20_000):
        if step % 500 == 0:  # another usable set, as a view's cache hands out a new list
            ranks = sorted(rng.sample(range(n), rng.randint(0, n)))
        r = rng.randrange(n)
        if loads[r] > 0 and rng.random() < 0.5:
            loads[r] -= 1
        else:
            loads[r] += 1
        expected = min(ranks, key=lambda k: (loads[k], k)) if ranks else None
        assert loads.least(ranks) == expected, (step, ranks)
        checked += expected is not None
    assert checked > 10_000
    assert len(loads._heap) <= 4 * n + 64  # stale entries do not pile up
