"""Each supported family: a tiny random checkpoint saved by transformers, loaded by
``build_model`` (the trainer's) and by the torch engine (the sampler's); the engine's
logits equal transformers' within 1e-4 at prefill, at every KV-cache decode step and when
a chunk of tokens extends the cache (the prefix-cache path)."""

from __future__ import annotations

import json

import pytest
import torch

from actors.models import SUPPORTED_MODEL_TYPES, build_model, load_model_config, model_weights
from actors.sampler import DecoderEngine
from actors.tiny import family_config

torch.set_num_threads(1)


def _save(tmp_path, family: str, **overrides) -> tuple[str, torch.nn.Module]:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = family_config(family, 96, **overrides)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Non-trivial norms and biases (their init is 1 and 0, which would hide a
            # family difference such as Qwen2's q/k/v bias).
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    d = tmp_path / family
    # Sharded like real checkpoints (several safetensors + an index).
    model.save_pretrained(d, max_shard_size="40KB")
    return str(d), model.eval()


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("qwen3", {}),
        ("qwen2", {}),
        ("llama", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
        ("mistral", {"sliding_window": 4096}),
    ],
)
def test_engine_logits_equal_transformers(tmp_path, family: str, overrides: dict) -> None:
    path, ref_model = _save(tmp_path, family, **overrides)
    assert len(list((tmp_path / family).glob("*.safetensors"))) > 1
    trainer_model = build_model(path)
    assert (
        type(trainer_model).__name__ == json.loads((tmp_path / family / "config.json").read_text())["architectures"][0]
    )
    weights = model_weights(trainer_model)
    for name, t in ref_model.state_dict().items():
        torch.testing.assert_close(weights[name], t, atol=0, rtol=0)

    engine = DecoderEngine(path, max_slots=3, max_len=96)
    engine.load(weights)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 3, 70)]
    cont = [torch.randint(0, 96, (5,), generator=g).tolist() for _ in prompts]
    slots = [2, 0, 1]
    logits = engine.prefill(slots, prompts, all_logits=True)
    with torch.no_grad():
        for row, (p, _) in enumerate(zip(prompts, cont, strict=True)):
            ref = ref_model(torch.tensor([p])).logits[0]
            torch.testing.assert_close(logits[row, : len(p)], ref, atol=1e-4, rtol=0)
    # Decode through the engine's KV cache against transformers' own KV-cache decoding.
    with torch.no_grad():
        caches = []
        for p in prompts:
            out = ref_model(torch.tensor([p]), use_cache=True)
            caches.append(out.cache)
        for step in range(5):
            got = engine.decode(slots, [c[step] for c in cont])
            for row, c in enumerate(cont):
                out = ref_model(torch.tensor([[c[step]]]), cache=caches[row], use_cache=True)
                caches[row] = out.cache
                torch.testing.assert_close(got[row], out.logits[0, -1], atol=1e-4, rtol=0)
        # The prefix-cache path: chunks of several tokens appended to the cached ones.
        chunks = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 1, 6)]
        got = engine.extend(slots, chunks)
        for row, c in enumerate(chunks):
            out = ref_model(torch.tensor([c]), cache=caches[row], use_cache=True)
            torch.testing.assert_close(got[row], out.logits[0, -1], atol=1e-4, rtol=0)


def test_other_architectures_are_refused_by_name(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    for source in (tmp_path, {"model_type": "gemma2"}):
        with pytest.raises(
            ValueError, match="model_type '(gpt2|gemma2)' is not supported; supported: qwen3 .*qwen2 .*llama .*mistral"
        ):
            load_model_config(source)
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported by the torch engine"):
        DecoderEngine(
            family_config(
                "llama",
                96,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 1e4,
                    "factor": 2.0,
                    "original_max_position_embeddings": 64,
                },
            ),
            max_slots=1,
        )
    with pytest.raises(ValueError, match="sliding_window=32 is shorter than the context"):
        DecoderEngine(family_config("mistral", 96, sliding_window=32), max_slots=1, max_len=64)
    assert set(SUPPORTED_MODEL_TYPES) == {"qwen3", "qwen2", "llama", "mistral"}
