"""TrainerActor in real meshes: a step lowers the batch's loss, weights publish, resume is exact.

One test, two processes (each trainer start costs seconds): the first trainer steps,
publishes, checkpoints and steps again; a second process resumes from the checkpoint
and must reproduce that second step bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from actors.trainer import StepResult, TrainerActor, TrainerConfig
from actors.types import Trajectory
from orchestrator.runtime import ActorError, ActorRef, open_mesh
from orchestrator.weightsync import WeightMessage, WeightReceiver
from policies import RecipeConfig
from tests.unit.actors.trainer_batches import on_policy_batch

torch.set_num_threads(1)
ENV = {"OMP_NUM_THREADS": "1"}
PLAIN = RecipeConfig(importance="none", score_centering=False)
CONFIG = TrainerConfig(
    lr=1e-4, weight_decay=0.01, micro_batch_tokens=64, precisions=["bf16", "fp8"], keyframe_interval=5
)


async def _step_lowers_loss_and_publishes(t: ActorRef, batch: list[Trajectory]) -> None:
    receiver = WeightReceiver("bf16")
    receiver.apply(WeightMessage.from_frames(await t.keyframe.call_one("bf16")))
    assert receiver.version == 0 and await t.version.call_one() == 0

    # On this on-policy batch the recipe's gradient is that of the REINFORCE surrogate
    # S(θ) = −Σ A·log p^S_θ(y) / N (w = 1, the centering term has zero gradient), a fixed
    # function of θ here; the recipe loss itself has θ-dependent detached weights, so S
    # is the honest "loss on that batch" to compare before and after one small step.
    before = (await t.evaluate.call_one(batch, PLAIN)).loss
    own = (await t.evaluate.call_one(batch)).loss
    result = await t.train_step.call_one(batch)
    after = (await t.evaluate.call_one(batch, PLAIN)).loss
    assert result.applied and result.version == 1 and await t.version.call_one() == 1
    assert result.loss == pytest.approx(own, abs=1e-7)  # reported at the pre-step weights
    assert after < before - 1e-3, (before, after)
    assert result.tokens == sum(int(x.loss_mask.sum()) for x in batch)
    assert set(result.per_pool) == {"a", "b"} and result.overall.masked_fraction == 0.0
    assert set(result.publish_bytes) == {"bf16", "fp8"} and result.micro_batches > 1

    # a receiver catches up by one hash-verified delta, then acknowledges
    msgs = [WeightMessage.from_frames(f) for f in await t.updates_for.call_one("s0", receiver.version, "bf16")]
    assert [(m.is_keyframe, m.base_version) for m in msgs] == [(False, 0)]
    assert receiver.apply_all(msgs) == 1
    await t.acks.call_one("bf16", {"s0": 1})
    assert await t.updates_for.call_one("s0", 1, "bf16") == []
    # a receiver holding nothing gets the keyframe path, in its precision
    fresh = [WeightMessage.from_frames(f) for f in await t.updates_for.call_one("s1", None, "fp8")]
    assert fresh[0].is_keyframe and fresh[-1].version == 1 and fresh[0].precision == "fp8"
    assert (await t.model_config.call_one())["vocab_size"] % 8 == 0

    with pytest.raises(ActorError, match="none of the"):
        await t.train_step.call_one([batch[0].model_copy(update={"failed": True})])
    assert await t.version.call_one() == 1


async def test_step_publish_checkpoint_and_bit_exact_resume(tmp_path: Path) -> None:
    first = on_policy_batch(data_seed=1, prompts=3, group=4)  # from the trainer's init (seed 0)
    second = on_policy_batch(data_seed=2, prompts=2, group=4)
    ck = str(tmp_path / "ck")
    with trio.fail_after(60):
        async with open_mesh(TrainerActor, CONFIG, procs=1, name="trainer", env=ENV) as mesh:
            t = mesh[0]
            await _step_lowers_loss_and_publishes(t, first)
            assert await t.save_checkpoint.call_one(ck) == ck
            saved = await t.digest.call_one()
            # what reaches a new receiver for v1 (keyframe v0 + delta) carries every v1 hash
            catch_up = await t.updates_for.call_one("new", None, "bf16")
            v1_hashes = [m.hash for m in WeightMessage.from_frames(catch_up[-1]).meta.tensors]
            expected: StepResult = await t.train_step.call_one(second)
            expected_digest = await t.digest.call_one()

        async with open_mesh(TrainerActor, CONFIG, ck, procs=1, name="resumed", env=ENV) as mesh:
            t = mesh[0]
            assert await t.version.call_one() == 1
            assert await t.digest.call_one() == saved  # weights + Adam state + version
            resumed_kf = WeightMessage.from_frames(await t.keyframe.call_one("bf16"))
            assert resumed_kf.version == 1 and [m.hash for m in resumed_kf.meta.tensors] == v1_hashes
            got = await t.train_step.call_one(second)
            assert await t.digest.call_one() == expected_digest  # the same next step, bit for bit
    assert (got.version, got.loss, got.grad_norm) == (expected.version, expected.loss, expected.grad_norm)
