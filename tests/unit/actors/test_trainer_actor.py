"""TrainerActor in real meshes: a step lowers the batch's loss, weights publish, resume is exact."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from actors.trainer import TrainerActor, TrainerConfig
from actors.types import Trajectory
from orchestrator.runtime import ActorError, open_mesh
from orchestrator.weightsync import WeightMessage, WeightReceiver, wire_snapshot
from policies import RecipeConfig
from tests.unit.actors.trainer_batches import on_policy_batch

torch.set_num_threads(1)
ENV = {"OMP_NUM_THREADS": "1"}
PLAIN = RecipeConfig(importance="none", score_centering=False)


@pytest.fixture(scope="module")
def batches() -> tuple[list[Trajectory], list[Trajectory]]:
    """Two on-policy batches from the initial weights (the trainer's seed 0)."""
    return (on_policy_batch(data_seed=1, prompts=3, group=4),
            on_policy_batch(data_seed=2, prompts=2, group=4))


async def test_step_lowers_loss_and_publishes(batches: tuple[list[Trajectory], ...]) -> None:
    batch = batches[0]
    cfg = TrainerConfig(lr=1e-4, precisions=["bf16", "fp8"], keyframe_interval=5)
    async with open_mesh(TrainerActor, cfg, procs=1, name="trainer", env=ENV) as mesh:
        t = mesh[0]
        with trio.fail_after(30):
            keyframe = WeightMessage.from_frames(await t.keyframe.call_one("bf16"))
            receiver = WeightReceiver("bf16")
            receiver.apply(keyframe)
            assert receiver.version == 0 and await t.version.call_one() == 0

            # S(θ) = −Σ A·log p^S(y)/N has the recipe's gradient on this on-policy batch
            before = (await t.evaluate.call_one(batch, PLAIN)).loss
            result = await t.train_step.call_one(batch)
            after = (await t.evaluate.call_one(batch, PLAIN)).loss
            assert result.applied and result.version == 1 and await t.version.call_one() == 1
            assert after < before - 1e-3, (before, after)
            assert result.tokens == sum(int(x.loss_mask.sum()) for x in batch)
            assert set(result.per_pool) == {"a", "b"} and result.overall.masked_fraction == 0.0
            assert set(result.publish_bytes) == {"bf16", "fp8"}

            # the receiver catches up by a hash-verified delta, then acknowledges
            frames = await t.updates_for.call_one("s0", receiver.version, "bf16")
            msgs = [WeightMessage.from_frames(f) for f in frames]
            assert [m.is_keyframe for m in msgs] == [False] and msgs[0].base_version == 0
            assert receiver.apply_all(msgs) == 1
            await t.ack.call_one("s0", 1)
            assert await t.updates_for.call_one("s0", 1, "bf16") == []
            # a receiver with nothing gets the keyframe path (keyframe v0 + delta)
            fresh = [WeightMessage.from_frames(f)
                     for f in await t.updates_for.call_one("s1", None, "fp8")]
            assert fresh[0].is_keyframe and fresh[-1].version == 1
            # the model config travels so samplers build the same model
            assert (await t.model_config.call_one())["vocab_size"] % 8 == 0

            with pytest.raises(ActorError, match="none of the"):
                await t.train_step.call_one([batch[0].model_copy(update={"failed": True})])
            assert await t.version.call_one() == 1
    # what the sampler holds is the bf16 wire snapshot of fp32 master weights
    assert all(v.dtype == torch.bfloat16 for v in receiver.snapshot.values())
    assert set(receiver.snapshot) == set(wire_snapshot(
        {k: v.float() for k, v in receiver.snapshot.items()}, "bf16"))


async def test_checkpoint_resume_in_a_new_process_is_bit_exact(
        batches: tuple[list[Trajectory], ...], tmp_path: Path) -> None:
    first, second = batches
    cfg = TrainerConfig(lr=3e-4, weight_decay=0.01, micro_batch_tokens=64)
    ck = str(tmp_path / "ck")
    with trio.fail_after(40):
        async with open_mesh(TrainerActor, cfg, procs=1, name="trainer", env=ENV) as mesh:
            t = mesh[0]
            await t.train_step.call_one(first)
            assert await t.save_checkpoint.call_one(ck) == ck
            saved = await t.digest.call_one()
            # what a new receiver is sent to reach v1 (keyframe v0 + delta); its last
            # message carries the hash of every v1 tensor
            catch_up = await t.updates_for.call_one("new", None, "bf16")
            v1_hashes = [m.hash for m in WeightMessage.from_frames(catch_up[-1]).meta.tensors]
            expected = await t.train_step.call_one(second)
            expected_digest = await t.digest.call_one()
        async with open_mesh(TrainerActor, cfg, ck, procs=1, name="resumed", env=ENV) as mesh:
            t = mesh[0]
            assert await t.version.call_one() == 1
            assert await t.digest.call_one() == saved            # weights + Adam state + version
            # the resumed publisher starts from a keyframe of the same bytes
            resumed_kf = WeightMessage.from_frames(await t.keyframe.call_one("bf16"))
            assert resumed_kf.version == 1
            assert [m.hash for m in resumed_kf.meta.tensors] == v1_hashes
            got = await t.train_step.call_one(second)
            assert await t.digest.call_one() == expected_digest  # the same next step, bit for bit
    assert (got.version, got.loss, got.grad_norm) == \
        (expected.version, expected.loss, expected.grad_norm)
