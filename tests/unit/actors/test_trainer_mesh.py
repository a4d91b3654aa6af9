"""The trainer as a mesh of ranks: FSDP2 over gloo equals one process, resume across rank
counts, LoRA's merged weights reach a receiver bit for bit, a dead rank is named.

Each group start spawns processes that import torch (seconds on a shared 2-core box), so
the multi-process tests are marked slow; models are the tiny built-in Qwen3.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import trio

from actors.trainer import (
    LoraConfig,
    Trainer,
    TrainerConfig,
    TrainerRankDied,
    open_trainer,
)
from actors.trainer._dist import rendezvous_address, token_shares
from orchestrator.weightsync import WeightMessage, WeightReceiver, wire_snapshot
from tests.unit.actors.trainer_batches import on_policy_batch

torch.set_num_threads(1)
ENV = {"OMP_NUM_THREADS": "1"}


def test_token_shares_balance_and_cover() -> None:
    sizes = [9, 1, 4, 4, 3, 7, 2]
    shares = token_shares(sizes, 2)
    assert sorted(i for s in shares for i in s) == list(range(len(sizes)))
    loads = [sum(sizes[i] for i in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= 1 and sum(loads) == sum(sizes)
    assert token_shares([5], 3) == [[0], [], []]  # more ranks than trajectories
    assert token_shares(sizes, 2) == shares  # every rank computes the same split


def test_rendezvous_address_sources() -> None:
    assert rendezvous_address("10.0.0.2:29500") == "10.0.0.2:29500"
    assert rendezvous_address(None, {"MASTER_ADDR": "h", "MASTER_PORT": "1234"}) == "h:1234"
    host, port = rendezvous_address(None, {}).rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    with pytest.raises(ValueError, match="trainer.rendezvous"):
        rendezvous_address("no-port")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.slow
@pytest.mark.timeout(300)  # process starts take most of it; slow on a loaded box
async def test_two_ranks_equal_one_and_resume_across_rank_counts(tmp_path: Path) -> None:
    first = on_policy_batch(data_seed=1, prompts=3, group=4)
    second = on_policy_batch(data_seed=2, prompts=2, group=4)
    cfg = TrainerConfig(lr=1e-3, micro_batch_tokens=40)
    single = Trainer(cfg)
    r1 = single.train_step(first)
    ck = str(tmp_path / "ck2")
    with trio.fail_after(280):
        async with open_trainer(cfg.model_copy(update={"procs": 2}), env=ENV) as group:
            r2 = await group.train_step(first)
            # the same loss (token mean over the whole batch) and updated weights
            assert r2.loss == pytest.approx(r1.loss, abs=1e-5)
            assert r2.grad_norm == pytest.approx(r1.grad_norm, rel=1e-5)
            assert r2.tokens == r1.tokens and r2.version == 1
            assert _max_diff(await group.full_weights(), single.master_weights()) <= 1e-5
            mem = r2.memory
            assert mem is not None and mem["ranks"] == 2 and mem["params"] > 0
            # each rank holds half the fp32 parameters (rows shard evenly here)
            assert mem["param_bytes"] == pytest.approx(mem["params"] * 4 / 2, rel=0.02)
            assert await group.save_checkpoint(ck) == ck
            saved = await group.digest()
            after_two = await group.train_step(second)
            weights_two = await group.full_weights()

        # a 2-rank checkpoint resumes on 1 rank (no process group) ...
        one = Trainer(cfg, resume_from=ck)
        assert one.version == 1 and one.digest() == saved
        after_one = one.train_step(second)
        assert after_one.loss == pytest.approx(after_two.loss, abs=1e-5)
        assert _max_diff(one.master_weights(), weights_two) <= 1e-5
        # ... and on 2 ranks, where the continuation is the same step
        async with open_trainer(cfg.model_copy(update={"procs": 2}), ck, env=ENV) as group:
            assert await group.version() == 1 and await group.digest() == saved
            again = await group.train_step(second)
            assert (again.loss, again.grad_norm) == (after_two.loss, after_two.grad_norm)
            assert _max_diff(await group.full_weights(), weights_two) == 0.0
            # one trajectory for two ranks: rank 1 takes zero-loss passes alongside
            solo = await group.train_step([first[0]])
            assert solo.applied and solo.trajectories == 1 and solo.tokens == first[0].num_generated


@pytest.mark.slow
@pytest.mark.timeout(300)  # process starts take most of it; slow on a loaded box
async def test_lora_receiver_ends_bit_identical_to_merged_weights() -> None:
    targets = ["q_proj", "v_proj"]
    cfg = TrainerConfig(procs=2, lr=1e-2, lora=LoraConfig(r=4, alpha=8, target_modules=targets))
    batch = on_policy_batch(data_seed=3, prompts=2, group=4)
    receiver = WeightReceiver("bf16")
    with trio.fail_after(280):
        async with open_trainer(cfg, env=ENV) as group:
            receiver.apply(WeightMessage.from_frames(await group.keyframe("bf16")))
            initial = await group.full_weights()
            for _ in range(2):
                await group.train_step(batch)
                msgs = [WeightMessage.from_frames(f) for f in await group.updates_for("s0", receiver.version, "bf16")]
                receiver.apply_all(msgs)
                await group.acks("bf16", {"s0": receiver.version})
            merged = await group.full_weights()
            adapters = await group.adapter_weights()
            report = await group.size_report()
    assert receiver.version == 2
    # only adapters train: r·(in + out) per adapted projection
    assert 0 < report["trainable_params"] < report["params"] / 4
    # the receiver holds exactly the bf16 wire snapshot of the merged fp32 weights
    held = receiver.snapshot
    assert held is not None
    expected = wire_snapshot(merged, "bf16")
    assert set(held) == set(expected) == set(initial)
    for name, t in expected.items():
        assert torch.equal(held[name].view(torch.int16), t.view(torch.int16)), name
    # the adapter alone (for export) is what the merged weights add to the frozen base
    a = adapters["model.layers.0.self_attn.q_proj.lora_A.default.weight"]
    b = adapters["model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    q = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(merged[q], initial[q] + (8 / 4) * (b @ a), rtol=0, atol=1e-6)
    assert sum(t.numel() for t in adapters.values()) == report["trainable_params"]
    # merged weights changed only where adapters sit
    changed = {n for n in merged if not torch.equal(merged[n], initial[n])}
    assert changed and all(n.split(".")[-2] in targets for n in changed), changed


@pytest.mark.slow
@pytest.mark.timeout(300)  # process starts take most of it; slow on a loaded box
async def test_a_killed_rank_fails_the_step_naming_it() -> None:
    batch = on_policy_batch(data_seed=1, prompts=3, group=4)
    with trio.fail_after(280):
        async with open_trainer(TrainerConfig(procs=2), env=ENV, grace=2.0) as group:
            await group.train_step(batch)
            victim = (await group.mesh[1].size_report.call_one())["pid"]

            async def kill_soon() -> None:
                await trio.sleep(0.2)  # mid-step: the step below takes longer than this
                os.kill(victim, signal.SIGKILL)

            t0 = trio.current_time()
            async with trio.open_nursery() as n:
                n.start_soon(kill_soon)
                with pytest.raises(TrainerRankDied, match="trainer rank 1 died during train_step"):
                    for _ in range(50):
                        await group.train_step(batch)
            assert trio.current_time() - t0 < 30.0  # seconds, even on a loaded box


def test_activation_checkpointing_changes_memory_not_the_step() -> None:
    batch = on_policy_batch(data_seed=4, prompts=2, group=4)
    plain, ckpt = Trainer(TrainerConfig()), Trainer(TrainerConfig(activation_checkpointing=True))
    a, b = plain.train_step(batch), ckpt.train_step(batch)
    assert b.loss == pytest.approx(a.loss, abs=1e-7) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-6)
    assert _max_diff(plain.master_weights(), ckpt.master_weights()) <= 1e-6


@pytest.mark.slow
@pytest.mark.timeout(300)  # process starts take most of it; slow on a loaded box
async def test_bf16_with_checkpointing_keeps_the_union_of_supports_loss() -> None:
    """bf16 compute (FSDP2 mixed precision, a group of one) with activation checkpointing:
    the replayed loss agrees with fp32 to bf16 precision, the update lowers the batch's
    REINFORCE surrogate, and the master weights stay fp32."""
    from policies import RecipeConfig

    plain = RecipeConfig(importance="none", score_centering=False)
    batch = on_policy_batch(data_seed=5, prompts=3, group=4)
    ref = Trainer(TrainerConfig(lr=1e-4)).evaluate(batch)
    cfg = TrainerConfig(lr=1e-4, dtype="bf16", activation_checkpointing=True)
    with trio.fail_after(280):
        async with open_trainer(cfg, env=ENV) as t:
            before = (await t.evaluate(batch, plain)).loss
            r = await t.train_step(batch)
            after = (await t.evaluate(batch, plain)).loss
            weights = await t.full_weights()
    assert r.applied and r.loss == pytest.approx(ref.loss, abs=2e-3)
    assert r.overall.mismatch_kl == pytest.approx(ref.overall.mismatch_kl, abs=1e-2)
    assert after < before - 1e-4, (before, after)
    assert all(w.dtype == torch.float32 for w in weights.values())
