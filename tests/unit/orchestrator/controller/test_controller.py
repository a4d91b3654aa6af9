"""The controller over in-memory links: staleness, due versions, hold-backs, faults, stop
and resume. No processes and no sleeps: trio's MockClock jumps over every wait."""

from __future__ import annotations

import os
import signal

import pytest
import trio

from orchestrator.controller import ControllerState, TrainerLost
from orchestrator.runtime import ActorDied

from .fakes import TOKENS, FakeEnvs, FakeTrainer, Harness, cheap_and_dear, run_config


def _balanced(h: Harness) -> None:
    c = h.controller.counts()
    assert c["groups_in"] == c["groups_trained"] + c["groups_buffered"] + c["groups_skipped"]


@pytest.mark.parametrize("budget", [0, 4])
async def test_trained_trajectories_stay_within_each_pools_budget(autojump_clock, budget):
    cfg = run_config(
        steps=8,
        pools=cheap_and_dear(budget, budget),
    )
    h = Harness(cfg)
    await h.controller.run()
    assert h.state.step == 8 and len(h.trainer.batches) == 8
    stale = h.staleness()
    assert max(s for _, s in stale) <= budget
    if budget == 4:  # sampling runs ahead: some trajectories are off-policy
        assert max(s for _, s in stale) >= 1
    assert [r["step"] for r in h.metrics.rows] == list(range(1, 9))
    _balanced(h)


async def test_the_trainer_does_not_wait_for_a_steps_accounting(autojump_clock):
    # Every rank takes 0.15 s to answer for its counters (a step's accounting waits up to
    # STATS_WAIT_S for them): the next train step starts meanwhile, and the lines are still
    # written once each, in step order, with their step's figures, before the run returns.
    cfg = run_config(steps=6, checkpoint={"every_steps": 100})
    h = Harness(cfg)
    for pool in h.pools.values():
        pool.stats_s = 0.15
    await h.controller.run()
    rows, starts = h.metrics.rows, h.trainer.step_starts
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["version"] for r in rows] == list(range(1, 7))
    assert all(r["pools"]["cheap"]["tokens"] > 0 for r in rows[1:])
    overlapped = [k for k in range(5) if starts[k + 1] < h.metrics.written_at[k]]
    assert len(overlapped) >= 3, (starts, h.metrics.written_at)


async def test_ranks_holding_the_same_weights_share_one_path_and_their_acks_travel_together(autojump_clock):
    # 16 ranks per pool: each version is asked of the trainer once per (precision, held
    # version), not once per rank, and every rank's acknowledgement arrives, in batches.
    h = Harness(run_config(steps=6), ranks=16)
    await h.controller.run()
    assert h.state.step == 6
    updates = sum(1 for p in h.pools.values() for _ in p.held) * 6  # at least one per rank and version
    assert len(h.trainer.path_calls) <= 2 * 7, h.trainer.path_calls  # 2 precisions x 7 versions (0..6)
    assert len({have for _, have in h.trainer.path_calls}) >= 2
    assert h.trainer.ack_calls < updates / 4, h.trainer.ack_calls
    receivers = {f"{name}/{r}" for name, p in h.pools.items() for r in range(len(p.held))}
    assert set(h.trainer.acked) == receivers
    assert all(v >= 5 for v in h.trainer.acked.values()), h.trainer.acked


async def test_stale_trajectories_are_dropped_and_their_slots_retried(autojump_clock):
    # Budget 0 on a pool that keeps generating while the trainer moves on: what lands
    # after a step is stale; it is dropped and its slot re-run, never trained.
    cfg = run_config(
        steps=6,
        rollout={"max_buffered_groups": 4},
        pools=[{"name": "only", "gpu": "cpu", "staleness_budget": 0, "max_concurrent_rollouts": 8}],
    )
    h = Harness(cfg, envs=FakeEnvs(episode_s=0.3))
    await h.controller.run()
    assert all(s == 0 for _, s in h.staleness())
    counts = h.controller.counts()
    assert counts["rollouts_trained"] == 6 * 4
    assert h.metrics.rows[-1]["dropped_stale"] == counts["dropped_stale"]
    _balanced(h)


async def test_rollouts_ask_for_their_groups_due_version(autojump_clock):
    cfg = run_config(
        steps=6,
        rollout={"max_buffered_groups": 6},
        pools=[{"name": "only", "gpu": "cpu", "staleness_budget": 1, "max_concurrent_rollouts": 16}],
    )
    h = Harness(cfg)
    await h.controller.run()
    # Groups queued a few batches ahead asked for weights newer than the trainer held at
    # the time, so nothing generated early went stale in the buffer.
    assert max(mv for _, _, mv in h.envs.started) >= 3
    assert h.controller.counts()["dropped_stale"] == 0


async def test_held_back_rollouts_do_not_move_the_rollout_length_estimate(autojump_clock):
    cfg = run_config(
        steps=6,
        rollout={"max_buffered_groups": 6},
        pools=[{"name": "only", "gpu": "cpu", "staleness_budget": 0, "max_concurrent_rollouts": 16}],
    )
    h = Harness(cfg)
    held = 0
    buffer = h.controller.ctx.buffer
    requeue = buffer.requeue

    def counting_requeue(slot) -> None:
        nonlocal held
        held += 1
        requeue(slot)

    buffer.requeue = counting_requeue  # type: ignore[method-assign]
    await h.controller.run()
    assert held > 10  # work ahead waited for its weights many times
    # Every finished rollout generated TOKENS tokens; hold-backs counted as empty rollouts
    # would pull the estimate far below that.
    assert h.scheduler.mean_rollout_tokens == pytest.approx(TOKENS, rel=0.05)


async def test_a_sampler_dying_mid_rollout_is_respawned_resynced_and_its_rollouts_retried(autojump_clock):
    cfg = run_config(steps=8)
    h = Harness(cfg, envs=FakeEnvs(episode_s=0.5))
    pool = h.pools["cheap"]
    async with trio.open_nursery() as n:
        n.start_soon(h.controller.run)
        while h.state.step < 3:
            await trio.sleep(0.05)
        pool.kill(0)
        while h.state.step < 8:
            await trio.sleep(0.05)
    assert h.state.step == 8
    assert pool.respawns == 1 and pool.held[0] >= 3  # a keyframe brought it back
    assert all(r["pools"]["cheap"]["busy_s"] >= 0 for r in h.metrics.rows)
    assert h.ledger.report().totals.cost_usd >= 0
    _balanced(h)


async def test_a_failing_environment_never_crashes_the_run(autojump_clock):
    h = Harness(run_config(steps=6), envs=FakeEnvs(fail_rate=0.3, seed=1))
    await h.controller.run()
    assert h.state.step == 6
    assert all(not t.failed for t in h.trained())
    assert h.metrics.rows[-1]["dropped_failed"] > 0
    _balanced(h)


async def test_an_environment_that_always_fails_stops_the_run_naming_its_error(autojump_clock):
    """Every episode fails: the run stops itself after `max_failed_in_a_row` failures (default
    4 x group_size + what can be in flight) instead of retrying forever, and says why."""
    h = Harness(run_config(steps=6), envs=FakeEnvs(fail_rate=1.0))
    with trio.fail_after(60):  # trio's mock clock: a bound on simulated time, not wall time
        await h.controller.run()
    assert h.state.step == 0 and not h.trainer.batches
    limit = 4 * h.cfg.rollout.group_size + sum(p.capacity for p in h.cfg.pools)
    assert h.controller.ctx.failure_limit == limit
    assert h.controller.failure is not None and f"{limit} episodes failed in a row" in h.controller.failure
    assert "ValueError: env exploded" in h.controller.failure and "\n" not in h.controller.failure
    assert h.metrics.rows == [] and h.controller.ctx.failed_in_a_row >= limit


async def test_episodes_failed_by_a_dying_sampler_do_not_stop_the_run(autojump_clock):
    """A burst of episodes failed with their sampler (`sampler_lost`) is not a broken
    environment: far more of them than `max_failed_in_a_row` leave the run going."""

    class SamplerDeaths(FakeEnvs):
        lost = 0

        async def run_episode(self, *args, **kwargs):
            traj = await super().run_episode(*args, **kwargs)
            if self.lost < 40:
                self.lost += 1
                traj.failed, traj.sampler_lost, traj.error = True, True, "ActorDied: actor cheap[0] died"
            return traj

    envs = SamplerDeaths()
    h = Harness(run_config(steps=4, task={"max_failed_in_a_row": 8}), envs=envs)
    await h.controller.run()
    assert envs.lost == 40 and h.state.step == 4 and h.controller.failure is None
    assert h.metrics.rows[-1]["prompts_skipped"] == 0  # retried as unfinished: no prompt lost


async def test_failures_broken_by_successes_never_stop_the_run(autojump_clock):
    h = Harness(run_config(steps=6, task={"max_failed_in_a_row": 8}), envs=FakeEnvs(fail_rate=0.3, seed=1))
    await h.controller.run()
    assert h.state.step == 6 and h.controller.failure is None
    assert h.metrics.rows[-1]["dropped_failed"] > 0


async def test_ctrl_c_mid_step_finishes_the_step_and_keeps_the_buffered_prompts(autojump_clock):
    h = Harness(run_config(steps=20), handle_sigint=True)
    h.trainer.gate = trio.Event()
    async with trio.open_nursery() as n:
        n.start_soon(h.controller.run)
        await h.trainer.entered.wait()
        os.kill(os.getpid(), signal.SIGINT)
        await trio.sleep(1.0)
        assert h.controller.interrupted and h.state.step == 0  # the step is still running
        h.trainer.gate.set()
    assert h.state.step == 1 and h.controller.interrupted
    await h.controller.checkpoint()
    saved = h.checkpoints.saves[-1]
    assert saved.step == 1 and len(saved.buffered) >= 1
    assert saved.buffer.groups_in == saved.buffer.groups_trained + len(saved.buffered)


async def test_resume_round_trip_replays_the_saved_prompts_first(autojump_clock, tmp_path):
    h = Harness(run_config(steps=3))
    await h.controller.run()
    await h.controller.checkpoint()
    path = h.state.save(tmp_path)
    loaded = ControllerState.load(tmp_path)
    assert loaded == h.state and path.name == "controller_state.json"
    replay = [t.prompt_id for t in loaded.buffered]
    assert replay  # the run stopped with groups buffered

    resumed = Harness(run_config(steps=6), state=loaded)
    await resumed.controller.run()
    first_trained = [t.prompt_id for t in resumed.trained()][: 2 * len(replay)]
    assert sorted(set(first_trained)) == sorted(replay)
    c = resumed.controller.counts()
    assert c["groups_in"] == c["groups_trained"] + c["groups_buffered"] + c["groups_skipped"]
    assert c["groups_trained"] == 6 * 2  # six steps of two prompts, counted across the resume


async def test_controller_state_refuses_a_malformed_file(tmp_path):
    (tmp_path / "controller_state.json").write_text('{"step": -1}')
    with pytest.raises(ValueError, match="step"):
        ControllerState.load(tmp_path)


async def test_a_dead_trainer_is_restored_from_the_last_checkpoint(autojump_clock):
    h = Harness(run_config(steps=8, checkpoint={"every_steps": 2}))
    h.trainer.die_at = 6  # dies during step 6; the last checkpoint is at step 4
    await h.controller.run()
    assert h.state.step == 8 and h.trainer.restarts == 1 and h.state.trainer_restarts == 1
    # Step 5 was trained twice (once before the death), nothing more.
    assert [r["step"] for r in h.metrics.rows] == list(range(1, 9))
    assert len(h.trainer.batches) == 8 + 1
    assert all(p.resets == 1 for p in h.pools.values())  # samplers accept the older keyframe
    newest = max(v for v, _ in h.trainer.batches)
    assert newest == 7


class _HeldWhileTrainerDead(FakeEnvs):
    """Episodes that end while the trainer is dead are held until it is back: so no batch
    can form after the death, and only the weight sync sees it."""

    trainer: FakeTrainer

    async def run_episode(self, *args, **kwargs):
        traj = await super().run_episode(*args, **kwargs)
        while self.trainer.dead:
            await trio.sleep(0.05)
        return traj


async def test_a_trainer_dying_between_steps_is_restored_without_waiting_for_a_batch(autojump_clock):
    h = Harness(run_config(steps=6, checkpoint={"every_steps": 2}), envs=_HeldWhileTrainerDead())
    h.envs.trainer = h.trainer
    h.trainer.die_after = 3  # its step-3 result arrives, then it is gone
    with trio.fail_after(3600):  # virtual time: a hang fails fast
        await h.controller.run()
    assert h.state.step == 6 and h.trainer.restarts == 1 and h.state.trainer_restarts == 1
    assert [r["step"] for r in h.metrics.rows] == list(range(1, 7))


async def test_a_sampler_death_seen_after_its_respawn_does_not_restart_the_trainer(autojump_clock):
    # The sampler's ActorDied reaches the weight sync after the rank was respawned (it is
    # no longer in dead_ranks): only a trainer that is really gone may be restored.
    h = Harness(run_config(steps=6, checkpoint={"every_steps": 2}))
    pool = h.pools["cheap"]
    failures = []

    def dies_once(call):
        async def wrapped(rank, *args):
            if not failures and h.state.step >= 2:
                failures.append(rank)
                raise ActorDied("cheap", rank, "SIGKILL (already respawned)")
            return await call(rank, *args)

        return wrapped

    pool.apply_weights = dies_once(pool.apply_weights)  # type: ignore[method-assign]
    pool.apply_weights_part = dies_once(pool.apply_weights_part)  # type: ignore[method-assign]
    with trio.fail_after(3600):
        await h.controller.run()
    assert failures and h.state.step == 6 and h.state.trainer_restarts == 0 and h.trainer.restarts == 0


@pytest.mark.parametrize("attempt", range(5))  # trio orders tasks at random: several tries
async def test_an_on_policy_run_survives_a_trainer_restart(autojump_clock, attempt):
    # With no staleness allowed, the restore leaves stale rollouts to redo and groups due
    # at different versions: the producer must look past work due later, and the trainer
    # loop must wake it for the slots it re-queues (each of these once hung the run).
    on_policy = [
        {"name": n, "gpu": "cpu", "staleness_budget": 0, "max_concurrent_rollouts": 4} for n in ("cheap", "dear")
    ]
    h = Harness(run_config(steps=6, checkpoint={"every_steps": 2}, pools=on_policy))
    h.trainer.die_at = 4
    with trio.fail_after(3600):  # virtual time: a hang fails fast
        await h.controller.run()
    assert h.state.step == 6 and h.state.trainer_restarts == 1
    assert h.staleness() and all(s == 0 for _, s in h.staleness())  # trained on-policy throughout


async def test_a_trainer_dying_past_max_restarts_ends_the_run_naming_it(autojump_clock):
    h = Harness(run_config(steps=8, checkpoint={"max_restarts": 0}))
    h.trainer.die_at = 2
    with pytest.raises(TrainerLost, match="trainer actor died"):
        await h.controller.run()
