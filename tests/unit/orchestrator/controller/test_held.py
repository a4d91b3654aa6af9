"""Held trajectories over in-memory links: the controller handles refs alone, the trainer
resolves them at the holder, what was trained or dropped is released, and what a holder
lost is replayed, never trained twice."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from actors.held import TrajectoryStore
from actors.types import MissingTrajectories, Trajectory, TrajectoryRef
from orchestrator.state.buffer import RolloutBuffer, Slot

from .fakes import FakeEnvs, FakeTrainer, Harness, cheap_and_dear, run_config
from .test_hedge import MARK, StragglerEnvs
from .test_hedge import _cfg as hedge_config


class HoldingEnvs(FakeEnvs):
    """`FakeEnvs` whose one actor holds what it played (an `actors.held.TrajectoryStore`)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.store = TrajectoryStore()
        self.refs = 0
        self.released = 0

    async def run_episode(self, *args: Any, hold: bool = False, **kw: Any) -> Trajectory | TrajectoryRef:
        traj = await super().run_episode(*args, **kw)
        if not hold:
            return traj
        self.refs += 1
        ref = self.store.put(traj)
        ref.holder = 0
        return ref

    async def release(self, refs: list[TrajectoryRef]) -> None:
        self.released += self.store.release([r.key for r in refs])


class ResolvingTrainer(FakeTrainer):
    """Fetches a batch's refs from the holder's store, as `actors.held.fetch_held` does."""

    def __init__(self, envs: HoldingEnvs) -> None:
        super().__init__()
        self.envs = envs
        self.lose_at: int | None = None  # at this step (1-based) the holder loses everything
        self.missing: list[MissingTrajectories] = []

    async def train_step(self, batch: list[Any]) -> Any:
        if self.lose_at is not None and len(self.batches) + 1 == self.lose_at:
            self.lose_at = None
            self.envs.store = TrajectoryStore()  # a restarted holder: nothing it held survives
        assert all(isinstance(t, TrajectoryRef) for t in batch), "the controller sent tensors"
        got = self.envs.store.get([r.key for r in batch])
        if any(t is None for t in got):
            lost = MissingTrajectories(
                keys=[r.key for r, t in zip(batch, got, strict=True) if t is None], reason="gone"
            )
            self.missing.append(lost)
            return lost
        return await super().train_step(got)


def _harness(cfg: Any) -> Harness:
    envs = HoldingEnvs()
    return Harness(cfg, envs=envs, trainer=ResolvingTrainer(envs))


def _slots_trained(h: Harness) -> list[tuple[str, int]]:
    return [(t.group_id, int(t.tokens[0])) for t in h.trained()]


async def test_the_controller_handles_refs_and_releases_what_it_trained(autojump_clock):
    cfg = run_config(steps=6)
    h = _harness(cfg)
    await h.controller.run()
    assert h.state.step == 6 and len(h.trainer.batches) == 6
    counts = h.controller.counts()
    assert counts["rollouts_trained"] == 6 * 4 == len(h.trained())
    assert all(isinstance(t, Trajectory) for t in h.trained())
    # Everything trained was released; what the holder still has is what stays buffered.
    assert h.envs.released >= counts["rollouts_trained"]
    assert len(h.envs.store) == h.controller.ctx.buffer.done_rollouts()


async def test_trajectories_a_holder_lost_are_replayed_and_trained_once(autojump_clock):
    cfg = run_config(steps=6)
    h = _harness(cfg)
    h.trainer.lose_at = 3
    await h.controller.run()
    assert h.state.step == 6 and len(h.trainer.batches) == 6
    assert len(h.trainer.missing) == 1 and len(h.trainer.missing[0].keys) == 4
    counts = h.controller.counts()
    assert counts["dropped_lost"] >= 4
    trained = [(t.group_id, t.prompt_id) for t in h.trained()]
    assert len(trained) == 6 * 4
    groups = [g for g, _ in trained]
    assert all(groups.count(g) == cfg.rollout.group_size for g in set(groups)), "a group trained twice or partly"
    assert counts["groups_in"] == counts["groups_trained"] + counts["groups_buffered"] + counts["groups_skipped"]


@pytest.mark.parametrize("lose_at", [2, 3, 4, 5])
async def test_a_lost_batch_replayed_behind_later_groups_does_not_stall_the_run(autojump_clock, lose_at):
    # The lost batch's groups go back behind groups due a version later; the cheap pool (budget
    # 0) cannot run those on the weights it has, and only the lost batch would bring newer
    # ones: the dear pool (budget 1) must take them, or the run waits for ever.
    cfg = run_config(
        steps=8,
        pools=cheap_and_dear(0, 1),
    )
    h = _harness(cfg)
    h.trainer.lose_at = lose_at
    with trio.fail_after(600):  # trio's clock: a stalled run ends the test, not CI
        await h.controller.run()
    assert h.state.step == 8 and len(h.trainer.missing) == 1
    groups = [t.group_id for t in h.trained()]
    assert all(groups.count(g) == cfg.rollout.group_size for g in set(groups)), "a group trained twice or partly"


def test_the_buffer_hands_over_held_trajectories_it_lets_go_untrained():
    buf = RolloutBuffer(group_size=2)
    buf.add_group("g0", "p0", task=None)

    def ref(key: str, version: int) -> TrajectoryRef:
        return TrajectoryRef(
            key=key,
            holder=0,
            task="t",
            prompt_id="p0",
            group_id="g0",
            pool="a",
            reward=float(key == "k1"),
            turns=1,
            seconds=0.1,
            num_generated=1,
            num_tokens=2,
            oldest_version=version,
            newest_version=version,
            nbytes=10,
        )

    for i, key in enumerate(["k0", "k1"]):
        slot = buf.next_slot()
        assert slot == Slot("g0", "p0", i)
        assert buf.complete(slot, ref(key, version=i)) is None
    groups, drops = buf.take_batch(1, trainer_version=2, budget_of=lambda _: 1)  # k0 is 2 stale
    assert groups == [] and [d.reason for d in drops] == ["stale"]
    assert [t.key for t in buf.take_discarded()] == ["k0"] and buf.take_discarded() == []
    drops = buf.drop_lost(lambda t: t.key == "k1")
    assert [d.reason for d in drops] == ["lost"] and buf.counters.dropped_lost == 1
    assert buf.done_rollouts() == 0 and buf.queued == 2


class HoldingStragglers(HoldingEnvs, StragglerEnvs):
    """Stragglers whose cancelled episodes return anyway, each result held as a ref."""


async def test_a_hedged_twins_held_trajectory_is_released_not_trained(autojump_clock):
    envs = HoldingStragglers(slow={("cheap", 0)}, slow_from=trio.current_time() + 0.8, finish_cancelled=True)
    h = Harness(hedge_config(), envs=envs, trainer=ResolvingTrainer(envs))
    with trio.fail_after(600):
        await h.controller.run()
    assert h.state.step == 12 and envs.returned_anyway > 0
    assert MARK not in {float(t.reward) for t in h.trained()}
    # Every ref the controller got is trained, released or still buffered: the losers' too.
    assert len(envs.store) == h.controller.ctx.buffer.done_rollouts()
    assert envs.released + len(envs.store) == envs.refs
