"""Hedged rollouts over in-memory links: a straggling rollout that the next batch waits for
is started again on another sampler, the first to finish is trained and the other cancelled
and discarded, and every counter balances. The straggler's sampler keeps answering pings, so
the liveness watcher never rescues it: without hedging the run stalls. Time is trio's
MockClock: the waits cost nothing."""

from __future__ import annotations

import math

import trio

from orchestrator.controller._hedge import MIN_DURATIONS, RECHECK_S, Attempt, Hedger
from orchestrator.state.buffer import Slot

from .fakes import FakeEnvs, Harness, run_config

MARK = 7.0  # the reward of a trajectory that a cancelled straggler returned anyway


class StragglerEnvs(FakeEnvs):
    """Episodes on the samplers in `slow` ((pool, rank)), once `slow_from` (trio time; a run of these fakes takes 0.2 s a step) has
    passed, take `slow_s` (inf: until cancelled). With `finish_cancelled`, a cancelled one
    returns its trajectory anyway (the reply was on its way), its reward set to MARK."""

    def __init__(self, slow: set[tuple[str, int]], slow_from: float, *, finish_cancelled: bool = False) -> None:
        super().__init__()
        self.slow, self.slow_from, self.finish_cancelled = slow, slow_from, finish_cancelled
        self.slow_s = math.inf
        self.straggled = 0  # episodes that turned slow
        self.cancelled_at: list[float] = []  # trio times at which those were cancelled
        self.returned_anyway = 0

    async def run_episode(self, pool, rank, task, sampling, min_version, env_rank, hold=False):
        if (pool.config.name, rank) not in self.slow or trio.current_time() < self.slow_from:
            return await super().run_episode(pool, rank, task, sampling, min_version, env_rank, hold)
        self.straggled += 1
        try:
            await trio.sleep(self.slow_s)
        except trio.Cancelled:
            self.cancelled_at.append(trio.current_time())
            if not self.finish_cancelled:
                raise
            with trio.CancelScope(shield=True):
                traj = await super().run_episode(pool, rank, task, sampling, min_version, env_rank, hold)
            self.returned_anyway += 1
            return traj.model_copy(update={"reward": MARK})
        return await super().run_episode(pool, rank, task, sampling, min_version, env_rank, hold)


def _cfg(**faults):
    # The straggler's sampler answers pings: liveness must not be what ends its rollouts. The
    # cheap pool has room for every slot of the buffer, so once its rank straggles every
    # buffered group waits on it (spare complete groups cannot let the trainer go round it).
    pools = [
        {"name": "cheap", "gpu": "cpu", "staleness_budget": 1, "max_concurrent_rollouts": 16},
        {"name": "dear", "gpu": "cpu", "price_per_gpu_hour": 2.0, "staleness_budget": 1, "max_concurrent_rollouts": 4},
    ]
    return run_config(steps=12, pools=pools, faults={"unresponsive_after_s": 60.0, **faults})


def _check_accounting(h: Harness) -> None:
    """After the run: every attempt ended and freed its scheduler slot and counters; each
    trained group had one trajectory per slot and was trained once."""
    ctx = h.controller.ctx
    assert ctx.hedger.attempts == {}
    for name, view in ctx.pools.items():
        assert h.scheduler.in_flight(name) == 0, name
        assert view.in_flight == [0] * len(view.in_flight), name
    assert ctx.env_in_flight == [0] * len(ctx.env_in_flight)
    groups = [t.group_id for _, batch in h.trainer.batches for t in batch]
    size = h.cfg.rollout.group_size
    assert all(groups.count(g) == size for g in groups), groups
    trained_groups = {g for _, batch in h.trainer.batches for g in {t.group_id for t in batch}}
    assert len(trained_groups) * size == len(groups)  # no group in two batches
    c = h.controller.counts()
    assert c["rollouts_trained"] == len(groups)
    assert c["groups_in"] == c["groups_trained"] + c["groups_buffered"] + c["groups_skipped"]


async def test_a_straggler_is_hedged_on_another_pool_and_the_run_goes_on(autojump_clock):
    envs = StragglerEnvs({("cheap", 0)}, slow_from=trio.current_time() + 0.8)
    h = Harness(_cfg(), envs=envs)
    with trio.fail_after(600):
        await h.controller.run()
    assert h.state.step == 12
    # Stragglers happened, and lost to their hedges: cancelled before the run's end cancelled the rest.
    assert envs.straggled > 0 and min(envs.cancelled_at) < trio.current_time()
    last = h.metrics.rows[-1]["pools"]
    assert last["cheap"]["hedges"] == 0  # its only rank is the straggler's
    assert last["dear"]["hedges"] > 0 and last["dear"]["hedges_won"] > 0
    assert last["dear"]["hedges_won"] <= last["dear"]["hedges"]
    gaps = [b["wall_s"] - a["wall_s"] for a, b in zip(h.metrics.rows, h.metrics.rows[1:], strict=False)]
    # A hedge starts once the straggler ran 1.5 x p90 (0.3 s) and takes 0.2 s; the liveness
    # watcher would take 60 s.
    assert max(gaps) < 10.0, gaps
    _check_accounting(h)


async def test_a_cancelled_straggler_that_returns_anyway_is_discarded(autojump_clock):
    envs = StragglerEnvs({("cheap", 0)}, slow_from=trio.current_time() + 0.8, finish_cancelled=True)
    h = Harness(_cfg(), envs=envs)
    with trio.fail_after(600):
        await h.controller.run()
    assert h.state.step == 12
    assert envs.returned_anyway > 0
    assert MARK not in {float(t.reward) for t in h.trained()}
    _check_accounting(h)


async def test_without_hedging_the_straggler_stalls_the_run(autojump_clock):
    envs = StragglerEnvs({("cheap", 0)}, slow_from=trio.current_time() + 0.8)
    h = Harness(_cfg(hedge_after_p90=None), envs=envs)
    with trio.move_on_after(600):
        await h.controller.run()
    assert h.state.step < 12
    assert envs.straggled > 0 and min(envs.cancelled_at) == trio.current_time()  # only by the test's end
    assert h.metrics.rows[-1]["pools"]["dear"]["hedges"] == 0


async def test_a_hedge_never_runs_on_the_stragglers_host(autojump_clock):
    envs = StragglerEnvs({("cheap", 0)}, slow_from=trio.current_time() + 0.8)
    h = Harness(_cfg(), envs=envs, ranks=2)
    for health in h.controller.ctx.pools["cheap"].health:  # both of its ranks on one host
        health.host = "10.0.0.9:7000"
    with trio.fail_after(600):
        await h.controller.run()
    assert h.state.step == 12
    last = h.metrics.rows[-1]["pools"]
    assert last["cheap"]["hedges"] == 0  # cheap/1 is cheaper, but on the straggler's host
    assert last["dear"]["hedges"] > 0
    _check_accounting(h)


async def test_a_hedge_waits_for_the_rollout_to_pass_its_pools_p90(autojump_clock):
    """Rollouts of 0.2 s, hedged after 10 x p90 = 2 s (above the `hedge_min_s` floor): a
    straggler that takes 1.5 s is never hedged, and one that takes 3 s is."""
    for slow_s, hedged in ((1.5, False), (3.0, True)):
        envs = StragglerEnvs({("cheap", 0)}, slow_from=trio.current_time() + 0.8)
        envs.slow_s = slow_s
        h = Harness(_cfg(hedge_after_p90=10.0), envs=envs)
        with trio.fail_after(600):
            await h.controller.run()
        assert h.state.step == 12
        assert (h.metrics.rows[-1]["pools"]["dear"]["hedges"] > 0) is hedged, slow_s
        _check_accounting(h)


async def test_a_trainer_restart_with_hedges_in_flight_loses_nothing(autojump_clock):
    """The restart cancels both attempts of a hedged slot: the first to end leaves the slot to
    its twin, the last re-queues it, and the run trains every step once more from the
    checkpoint with its accounting balanced."""
    envs = StragglerEnvs({("cheap", 0)}, slow_from=trio.current_time() + 0.8)
    h = Harness(_cfg(), envs=envs)
    h.trainer.die_at = 7
    ctx, twins_at_restart = h.controller.ctx, []
    cancel = ctx.cancel_rollouts

    def cancel_and_note() -> None:
        twins_at_restart.append(sum(len(a) == 2 for a in ctx.hedger.attempts.values()))
        cancel()

    ctx.cancel_rollouts = cancel_and_note
    with trio.fail_after(600):
        await h.controller.run()
    assert h.state.step == 12 and h.trainer.restarts == 1
    assert twins_at_restart and twins_at_restart[0] > 0  # hedged slots were in flight
    assert h.metrics.rows[-1]["pools"]["dear"]["hedges"] > 0
    _check_accounting(h)


class _Pool:
    """What a Hedger reads of a pool view: its name."""

    def __init__(self, name: str) -> None:
        self.name = name


def _attempt(pool: str, index: int = 0, *, hedge: bool = False) -> Attempt:
    return Attempt(Slot("g0", "p0", index), _Pool(pool), 0, 0, 0, 0.0, hedge=hedge)


async def test_the_limit_is_k_times_the_pools_p90_with_a_floor_and_a_fallback():
    h = Hedger(1.5, 0.25, ["a", "b"])
    assert h.limit("a") is None  # nothing finished yet
    for i in range(1, MIN_DURATIONS + 3):  # 0.1 .. 1.0 s on pool a
        a = _attempt("a", i)
        h.started(a)
        assert h.ended(a, finished=True, seconds=i / 10)
    assert h.limit("a") == 1.5 * 0.9  # the p90 of ten durations is the ninth
    assert h.limit("b") == h.limit("a")  # b has none of its own: every pool's
    fast = Hedger(1.5, 0.25, ["a"])
    for i in range(MIN_DURATIONS):
        a = _attempt("a", i)
        fast.started(a)
        fast.ended(a, finished=True, seconds=0.01)
    assert fast.limit("a") == 0.25  # the floor
    assert Hedger(None, 0.25, ["a"]).limit("a") is None


async def test_the_first_to_finish_is_the_slots_and_the_last_unfinished_requeues():
    h = Hedger(1.5, 0.25, ["a", "b"])
    first, twin = _attempt("a"), _attempt("b", hedge=True)
    h.started(first)
    h.started(twin)
    assert not h.ended(first, finished=False, seconds=None)  # the twin carries on
    assert h.ended(twin, finished=True, seconds=0.2)  # kept
    assert h.stats("b") == {"hedges": 1, "hedges_won": 1} and h.attempts == {}

    first, twin = _attempt("a"), _attempt("b", hedge=True)
    h.started(first)
    h.started(twin)
    assert h.ended(first, finished=True, seconds=0.2)
    assert twin.discarded and twin.scope.cancel_called  # cancelled, and its result goes nowhere
    assert not h.ended(twin, finished=True, seconds=0.2)
    assert h.stats("b") == {"hedges": 2, "hedges_won": 1}

    first, twin = _attempt("a"), _attempt("b", hedge=True)
    h.started(first)
    h.started(twin)
    assert not h.ended(twin, finished=False, seconds=None)
    assert h.ended(first, finished=False, seconds=None)  # the last one out: re-queue the slot
    assert h.attempts == {}


class JitteredEnvs(FakeEnvs):
    """Episodes of 0.05-0.35 s: rollouts finish one by one, not in lockstep."""

    async def run_episode(self, pool, rank, task, sampling, min_version, env_rank, hold=False):
        self.episode_s = self.rng.uniform(0.05, 0.35)
        return await super().run_episode(pool, rank, task, sampling, min_version, env_rank, hold)


async def test_stragglers_are_looked_for_on_changes_and_timed_looks_not_per_finished_rollout(autojump_clock):
    # A finished rollout only shrinks what the next batch waits for: the scan over the
    # buffer's groups runs when a batch is taken, a group comes or goes, or RECHECK_S passed.
    h = Harness(_cfg().model_copy(update={"steps": 40}), envs=JitteredEnvs())
    hedger = h.controller.ctx.hedger
    looks = 0
    stragglers = hedger.stragglers

    def counted(*args):
        nonlocal looks
        looks += 1
        return stragglers(*args)

    hedger.stragglers = counted  # type: ignore[method-assign]
    with trio.fail_after(600):
        await h.controller.run()
    assert h.state.step == 40
    finished = h.controller.counts()["rollouts_trained"]
    groups = h.controller.counts()["groups_in"]
    bound = h.state.step + groups + trio.current_time() / RECHECK_S
    assert looks <= bound < finished, (looks, bound, finished)
    _check_accounting(h)
