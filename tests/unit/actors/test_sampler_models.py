"""actors.models: the shared tiny Qwen3 builder (seeded init, local checkpoints)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from actors.models import build_model, default_model_config, model_weights, round_vocab

torch.set_num_threads(1)


def test_default_config_rounds_vocab_and_seed_fixes_weights() -> None:
    cfg = default_model_config(vocab_size=101)
    assert cfg["vocab_size"] == 104 == round_vocab(101)
    assert default_model_config()["vocab_size"] == 128
    json.dumps(cfg)  # plain JSON: it travels in actor constructor arguments
    a, b, c = (model_weights(build_model(cfg, seed=s)) for s in (4, 4, 5))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert a["model.embed_tokens.weight"].shape == (104, 64)
    # Building a model borrows the global RNG without moving it.
    torch.manual_seed(0)
    x = torch.rand(1)
    torch.manual_seed(0)
    build_model(cfg, seed=7)
    assert torch.equal(torch.rand(1), x)


def test_checkpoint_directory_round_trip(tmp_path) -> None:
    cfg = default_model_config()
    weights = model_weights(build_model(cfg, seed=3))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"]}))
    save_file(weights, str(tmp_path / "model.safetensors"))
    loaded = model_weights(build_model(tmp_path))
    assert all(torch.equal(weights[k], loaded[k]) for k in weights)

    del weights["model.norm.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight"):
        build_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_model(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="model_type"):
        build_model({**cfg, "model_type": "gpt_neox"})
