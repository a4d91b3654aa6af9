"""SamplerActor in real actor processes: weights over the wire, in-flight updates,
min_version admission, cancellation, and FP8 vs BF16 pools from the same master weights."""

from __future__ import annotations

import pytest
import torch
import trio

from actors.models import build_model, default_model_config, model_weights
from actors.sampler import GenerateRequest, GenerateResult, Qwen3Engine, SamplerActor
from orchestrator.runtime import ActorError, open_mesh
from orchestrator.weightsync import WeightPublisher, wire_snapshot
from policies import replay_logprobs
from policies.metrics import compute_metrics

torch.set_num_threads(1)

CFG = default_model_config()
ENV = {"OMP_NUM_THREADS": "1"}


def _master(seed: int = 0) -> dict[str, torch.Tensor]:
    return model_weights(build_model(CFG, seed=seed))


def _sparse_step(master: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A trainer-like update: a few percent of the MLP weights move."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in master.items()}
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        t = out[name]
        mask = torch.rand(t.shape, generator=g) < 0.05
        t[mask] += 0.05 * torch.randn(int(mask.sum()), generator=g)
    return out


def _check_valid(res: GenerateResult) -> None:
    support = res.support()
    support.check()
    support.token_index(torch.tensor(res.token_ids))  # every token lies in its own row


async def _wait_until(check) -> None:
    """Poll an actor condition (each poll is a real round trip, no sleeping); the
    test's fail_after bounds it."""
    while not await check():
        await trio.lowlevel.checkpoint()


async def test_weights_in_flight_admission_cancel_and_errors() -> None:
    master0 = _master()
    master1 = _sparse_step(master0, seed=1)
    master2 = _sparse_step(master1, seed=2)
    pub = WeightPublisher(precisions=["bf16"])
    (key0,) = pub.publish(0, master0)
    (delta1,) = pub.publish(1, master1)
    (delta2,) = pub.publish(2, master2)
    assert not delta1.is_keyframe and not delta2.is_keyframe
    with trio.fail_after(60):
        async with open_mesh(
            SamplerActor,
            "cpu-bf16",
            "bf16",
            CFG,
            "cpu",
            initial_weights=key0.to_bytes(),
            max_batch=4,
            staleness_budget=2,
            procs=1,
            name="sampler",
            env=ENV,
        ) as mesh:
            s = mesh[0]
            assert await s.version.call_one() == 0

            async def stats() -> dict:
                return await s.stats.call_one()

            # min_version: parked until weights of version 1 arrive, then admitted.
            results: dict[str, GenerateResult] = {}

            async def gen(req: GenerateRequest) -> None:
                results[req.request_id] = await s.generate.call_one(req)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    gen,
                    GenerateRequest(request_id="late", prompt_ids=[1, 2, 3], max_new_tokens=4, seed=1, min_version=1),
                )
                await _wait_until(lambda: _eq(stats, "waiting", 1))
                assert "late" not in results and (await stats())["running"] == 0
                # frames form of the message (the bytes form was used for the keyframe)
                assert await s.apply_weights.call_one(delta1.to_frames()) == 1
            assert results["late"].versions == [1, 1, 1, 1]
            _check_valid(results["late"])

            # In-flight update: a long generation starts on version 1; a delta lands mid-way.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    gen,
                    GenerateRequest(
                        request_id="long", prompt_ids=[4, 5], max_new_tokens=250, seed=2, top_k=0, top_p=1.0
                    ),
                )
                await _wait_until(lambda: _ge(stats, "tokens_generated", 4 + 8))
                assert await s.apply_weights.call_one(delta2.to_bytes()) == 2
            long = results["long"]
            _check_valid(long)
            assert long.finish_reason == "length" and len(long.token_ids) == 250
            split = long.versions.index(2)
            assert 8 <= split < 250, "the update must land mid-generation"
            assert long.versions == [1] * split + [2] * (250 - split)

            # A corrupted delta is refused; the sampler keeps version 2 and asks for a keyframe.
            (delta3,) = pub.publish(3, _sparse_step(master2, seed=3))
            frames = [bytes(f) for f in delta3.to_frames()]
            frames[-1] = frames[-1][:-1] + bytes([frames[-1][-1] ^ 0xFF])
            with pytest.raises(ActorError):
                await s.apply_weights.call_one(frames)
            assert await s.version.call_one() == 2 and await s.have_version.call_one() is None
            with pytest.raises(ActorError, match="outside the vocabulary"):
                await s.generate.call_one(GenerateRequest(request_id="bad", prompt_ids=[1, 10_000], max_new_tokens=2))

            # Cancelling a generate call frees its slot; abort ends one with a partial result.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(gen, GenerateRequest(request_id="gone", prompt_ids=[1], max_new_tokens=250))
                await _wait_until(lambda: _eq(stats, "running", 1))
                nursery.cancel_scope.cancel()
            assert "gone" not in results
            await _wait_until(lambda: _eq(stats, "running", 0))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(gen, GenerateRequest(request_id="cut", prompt_ids=[1], max_new_tokens=250))
                await _wait_until(lambda: _eq(stats, "running", 1))
                assert await s.abort.call_one("cut") is True
            assert results["cut"].finish_reason == "abort" and len(results["cut"].token_ids) < 250
            _check_valid(results["cut"])

            st = await stats()
            assert st["pool"] == "cpu-bf16" and st["version"] == 2 and st["staleness_budget"] == 2
            assert st["tokens_generated"] >= 4 + 250 and st["busy_seconds"] > 0 and st["tokens_per_second"] > 0
            assert st["weight_updates"] == 2 and st["running"] == 0 and st["waiting"] == 0


async def _eq(stats, key: str, value: int) -> bool:
    return (await stats())[key] == value


async def _ge(stats, key: str, value: int) -> bool:
    return (await stats())[key] >= value


async def test_fp8_and_bf16_pools_measure_mismatch() -> None:
    """Same master weights (seeded init), same request seed: both pools give valid
    output, and the FP8 pool's distribution on the BF16 pool's supports differs by a
    measured, nonzero mismatch KL (k3 on the sampled tokens)."""
    kw = dict(max_batch=8, init_seed=0, procs=1, env=ENV)
    prompts = [[1, 2, 3], [7, 8], [9, 10, 11, 12]]
    sampling = dict(max_new_tokens=24, temperature=1.0, top_k=64, top_p=0.97)
    with trio.fail_after(60):
        async with (
            open_mesh(SamplerActor, "cpu-bf16", "bf16", CFG, "cpu", name="bf16", **kw) as bf16,
            open_mesh(SamplerActor, "cpu-fp8", "fp8", CFG, "cpu", name="fp8", **kw) as fp8,
        ):
            out: dict[str, list[GenerateResult]] = {"bf16": [], "fp8": []}
            for pool, mesh in (("bf16", bf16), ("fp8", fp8)):
                for i, p in enumerate(prompts):
                    req = GenerateRequest(request_id=f"{pool}-{i}", prompt_ids=p, seed=100 + i, **sampling)
                    out[pool].append(await mesh[0].generate.call_one(req))
    for pool in out:
        for res in out[pool]:
            _check_valid(res)
            assert res.pool == f"cpu-{pool}" and res.versions == [0] * 24

    # Replay the BF16 pool's tokens through the FP8 weights (what the trainer's
    # importance ratio sees when the sampler and the scorer differ in precision).
    master = _master()
    fp8_engine = Qwen3Engine(CFG, max_slots=1)
    fp8_engine.load(wire_snapshot(master, "fp8"))
    log_ratio = []
    for p, res in zip(prompts, out["bf16"], strict=True):
        logits = fp8_engine.prefill([0], [p + res.token_ids], all_logits=True)[0, len(p) - 1 : -1]
        tokens = torch.tensor(res.token_ids)
        rep = replay_logprobs(logits, res.support(), tokens, temperature=1.0)
        logq_token = res.support_logq[rep.token_index]
        log_ratio.append(rep.logp_token - logq_token)
    lr = torch.cat(log_ratio)
    m = compute_metrics(
        loss=0.0,
        loss_mask=torch.ones_like(lr, dtype=torch.bool),
        log_ratio_token=lr,
        weight=torch.ones_like(lr),
        mis_masked=torch.zeros_like(lr),
        entropy_token=None,
    )
    assert m.tokens == 72
    assert 1e-9 < m.mismatch_kl < 1e-2, m.mismatch_kl
    # The two pools really hold different weights, and not wildly so.
    assert 0.0 < float(lr.abs().max()) < 0.5


async def test_a_keyed_sampler_takes_only_weights_sealed_with_its_key() -> None:
    key = "ab" * 32
    master0 = _master()
    mine = WeightPublisher(precisions=["bf16"], auth_key=bytes.fromhex(key))
    forger = WeightPublisher(precisions=["bf16"], auth_key=b"\x01" * 32)  # same weights, other key
    unkeyed = WeightPublisher(precisions=["bf16"])
    (k_mine,), (k_forged,), (k_plain,) = (p.publish(0, master0) for p in (mine, forger, unkeyed))
    (d_mine,) = mine.publish(1, _sparse_step(master0, seed=1))
    with trio.fail_after(60):
        async with open_mesh(
            SamplerActor,
            "cpu-bf16",
            "bf16",
            CFG,
            "cpu",
            init_seed=None,
            weights_key=key,
            max_batch=2,
            procs=1,
            name="keyed",
            env=ENV,
        ) as mesh:
            s = mesh[0]
            for bad in (k_forged, k_plain):
                with pytest.raises(ActorError, match="AuthenticationError"):
                    await s.apply_weights.call_one(bad.to_frames())
                assert await s.version.call_one() == -1
            assert await s.apply_weights.call_one([k_mine.to_frames(), d_mine.to_frames()]) == 1
