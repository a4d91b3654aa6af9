"""Every client of the conformance suite trains end to end: `flotilla run` on a tiny local
checkpoint (byte-level BPE, a ChatML template with tools, random init), its harness the
five clients of tests/unit/gateway/clients.py in turn (one per prompt), 0 failed episodes.
The model is untrained, so its replies are random ids: text, stray special tokens, invalid
UTF-8 and cuts at max_tokens all reach the clients."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import assert_trained_without_failures, flotilla_run

ROOT = Path(__file__).resolve().parents[2]


def make_model(out: Path) -> Path:
    from actors.tiny import make_checkpoint, train_tokenizer
    from tests.unit.gateway._actors import CORPUS

    return make_checkpoint(
        out, "qwen2", tokenizer=train_tokenizer(CORPUS, vocab_size=400), seed=0, max_position_embeddings=1024
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_client_trains_with_no_failed_episode(tmp_path: Path) -> None:
    pytest.importorskip("agents")
    pytest.importorskip("langchain_openai")
    model = make_model(tmp_path / "model")
    config = tmp_path / "clients.toml"
    config.write_text(f"""
name = "clients"
run_root = "{tmp_path}"
steps = 2
[model]
path = "{model}"
max_seq_len = 1024
[task]
kind = "harness"
name = "clients"
entrypoint = "{ROOT / 'tests/unit/gateway/clients.py'}:play"
max_new_tokens = 16
episode_timeout_s = 120
[rollout]
prompts_per_step = 5
group_size = 2
max_buffered_groups = 1
[[pools]]
name = "p"
gpu = "cpu"
device = "cpu"
max_concurrent_rollouts = 10
""")
    done = flotilla_run(config)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert_trained_without_failures(tmp_path / "clients", steps=2, min_episodes=10)
