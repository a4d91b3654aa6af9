"""The torch engine's element-range load: a chain of sparse deltas, each applied by a
`WeightReceiver` and handed to ``DecoderEngine.load`` as the receiver's
``last_changed``, leaves the compute weights bit-identical to a full reload of the
same snapshot (tied and untied embeddings, q/k/v bias on and off, q/k norm, and FP8
wire tensors, which keep the whole-tensor path), and the logits equal; through the
sampler actor too."""

from __future__ import annotations

import pytest
import torch
import trio

from actors.models import build_model, default_model_config, model_weights
from actors.sampler import DecoderEngine, SamplerActor
from actors.tiny import family_config
from orchestrator.weightsync import WeightPublisher, WeightReceiver

torch.set_num_threads(1)

CONFIGS = {
    "qwen3": default_model_config(),
    "qwen3-tied": {**default_model_config(), "tie_word_embeddings": True},
    "qwen2-bias": family_config("qwen2", 96),
    "llama-bias-tied": family_config("llama", 96, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
}


def _step(master: dict[str, torch.Tensor], gen: torch.Generator, frac: float = 0.02) -> None:
    """Move a random `frac` of every tensor's elements enough to change their bf16 value."""
    for t in master.values():
        flat = t.view(-1)
        mask = torch.rand(flat.shape, generator=gen) < frac
        flat += mask * (flat.abs() + 0.01) * 0.05


def _compute(engine: DecoderEngine) -> dict[str, torch.Tensor]:
    out = {f"top.{k}": v for k, v in engine._top.items()}
    for i, layer in enumerate(engine._layers):
        out |= {f"{i}.{k}": v for k, v in layer.items()}
    return out


def _assert_same(a: DecoderEngine, b: DecoderEngine) -> None:
    ca, cb = _compute(a), _compute(b)
    assert ca.keys() == cb.keys()
    for k in ca:
        assert ca[k].dtype == cb[k].dtype, k
        assert torch.equal(ca[k], cb[k]), f"compute weight {k} differs from a full reload"


def _chain(cfg: dict, precision: str = "bf16", steps: int = 4):
    """Yield (receiver, engine on the range path) after the keyframe and each delta."""
    master = model_weights(build_model(cfg, seed=0))
    for name, t in master.items():  # non-trivial norms and biases
        if name.endswith("bias") or "norm" in name:
            t.add_(0.1 * torch.randn(t.shape, generator=torch.Generator().manual_seed(len(name))))
    pub = WeightPublisher(keyframe_interval=100, precisions=(precision,), chunk_bytes=4096, helper_processes=False)
    rx = WeightReceiver(precision)  # type: ignore[arg-type]
    engine = DecoderEngine(cfg, max_slots=2)
    gen = torch.Generator().manual_seed(7)
    for version in range(steps + 1):
        if version:
            _step(master, gen)
        (msg,) = pub.publish(version, master)
        rx.apply(msg)
        assert rx.snapshot is not None
        if version == 0:
            assert msg.is_keyframe and rx.last_changed is None
            engine.load(rx.snapshot)
        else:
            changed = rx.last_changed
            assert changed is not None and not msg.is_keyframe
            engine.load(rx.snapshot, changed)
        yield rx, engine, changed if version else None


def _full(cfg: dict, snapshot) -> DecoderEngine:
    engine = DecoderEngine(cfg, max_slots=2)
    engine.load(snapshot)
    return engine


@pytest.mark.parametrize("family", list(CONFIGS))
def test_range_loads_equal_a_full_reload(family: str) -> None:
    cfg = CONFIGS[family]
    prompts = [[1, 5, 9, 3, 2], [7, 7, 1]]
    for rx, engine, changed in _chain(cfg):
        full = _full(cfg, rx.snapshot)
        _assert_same(engine, full)
        if changed is not None:
            # Sparse: the range path ran (most tensors listed, none whole).
            listed = sum(rx.snapshot[n].numel() if v is None else len(v) for n, v in changed.items())
            total = sum(t.numel() for t in rx.snapshot.values())
            assert 0 < listed < total / 10
        torch.testing.assert_close(engine.prefill([0, 1], prompts), full.prefill([0, 1], prompts), atol=0, rtol=0)


def test_fp8_wire_tensors_keep_the_whole_tensor_path() -> None:
    cfg = {**default_model_config(), "hidden_size": 128, "head_dim": 32, "intermediate_size": 256}
    for rx, engine, _ in _chain(cfg, precision="fp8", steps=2):
        assert any(t.dtype == torch.float8_e4m3fn for t in rx.snapshot.values())
        _assert_same(engine, _full(cfg, rx.snapshot))


def test_a_skipped_element_shows() -> None:
    """The range path writes exactly the listed elements: leave one out, and that
    element (only) keeps its old value, which the bit-identity check catches."""
    cfg = CONFIGS["qwen3"]
    master = model_weights(build_model(cfg, seed=0))
    pub = WeightPublisher(keyframe_interval=100, chunk_bytes=4096, helper_processes=False)
    rx = WeightReceiver("bf16")
    engine = DecoderEngine(cfg, max_slots=1)
    (kf,) = pub.publish(0, master)
    rx.apply(kf)
    engine.load(rx.snapshot)
    _step(master, torch.Generator().manual_seed(3))
    (delta,) = pub.publish(1, master)
    rx.apply(delta)
    changed = dict(rx.last_changed or {})
    name = "model.layers.1.mlp.up_proj.weight"
    idx = changed[name]
    dropped = int(idx[len(idx) // 2])
    changed[name] = [int(i) for i in idx if i != dropped]
    engine.load(rx.snapshot, changed)
    full = _full(cfg, rx.snapshot)
    with pytest.raises(AssertionError, match="1.gate_up"):
        _assert_same(engine, full)
    gate_numel = rx.snapshot["model.layers.1.mlp.gate_proj.weight"].numel()
    diff = (engine._layers[1]["gate_up"] != full._layers[1]["gate_up"]).view(-1).nonzero().view(-1).tolist()
    assert diff == [gate_numel + dropped]
    # Naming the tensor without indices refreshes it whole.
    engine.load(rx.snapshot, {name: None})
    _assert_same(engine, full)


def test_bad_indices_are_refused_by_name() -> None:
    cfg = CONFIGS["qwen3"]
    rx, engine, _ = next(_chain(cfg, steps=0))
    name = "model.norm.weight"
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.load(rx.snapshot, {name: [0, rx.snapshot[name].numel()]})


async def test_the_sampler_actor_loads_deltas_by_elements() -> None:
    """Through `SamplerActor.apply_weights` (in process, its real backend loop running):
    deltas land in the engine's existing compute tensors (the same objects, updated in
    place), which end bit-identical to a full reload; a keyframe replaces them."""
    cfg = CONFIGS["qwen2-bias"]
    master = model_weights(build_model(cfg, seed=0))
    pub = WeightPublisher(keyframe_interval=3, chunk_bytes=4096, helper_processes=False)
    (kf,) = pub.publish(0, master)
    actor = SamplerActor("p", "bf16", cfg, "cpu", initial_weights=kf.to_bytes(), max_batch=2)
    gen = torch.Generator().manual_seed(5)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await actor.on_start(nursery)
            engine = actor._backend.engine  # type: ignore[attr-defined]
            blocks = _compute(engine)
            for version in (1, 2):
                _step(master, gen)
                msgs = pub.publish(version, master)
                assert await actor.apply_weights(msgs[0].to_frames()) == version
            after = _compute(engine)
            assert all(after[k] is blocks[k] for k in blocks if k.split(".")[-1] != "qk_norm")
            _assert_same(engine, _full(cfg, actor._receiver.snapshot))
            _step(master, gen)
            _, key = pub.publish(3, master)  # a keyframe is due: sent alone, loaded whole
            assert key.is_keyframe and await actor.apply_weights(key.to_frames()) == 3
            assert _compute(engine)["0.qkv"] is not blocks["0.qkv"]
            _assert_same(engine, _full(cfg, actor._receiver.snapshot))
            nursery.cancel_scope.cancel()
