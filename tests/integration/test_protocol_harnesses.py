"""Every client of the Responses and Messages APIs trains end to end: `flotilla run` on a tiny
local checkpoint (byte-level BPE, a ChatML template with tools, random init), its harness the
three clients of tests/unit/gateway/clients_more.py in turn (one per prompt; the anthropic
client through ANTHROPIC_BASE_URL as a harness command gets it), 0 failed episodes.
The model is untrained, so its replies are random ids: text, stray special tokens, invalid
UTF-8 and cuts at max_tokens all reach the clients."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.integration.conftest import assert_trained_without_failures, flotilla_run
from tests.integration.test_client_harnesses import make_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_protocol_client_trains_with_no_failed_episode(tmp_path: Path) -> None:
    pytest.importorskip("agents")
    pytest.importorskip("anthropic")
    model = make_model(tmp_path / "model")
    config = tmp_path / "protocols.toml"
    config.write_text(f"""
name = "protocols"
run_root = "{tmp_path}"
steps = 2
[model]
path = "{model}"
max_seq_len = 1024
[task]
kind = "harness"
name = "protocols"
command = "{sys.executable} -m tests.unit.gateway.clients_more {{task}}"
max_new_tokens = 16
episode_timeout_s = 120
[rollout]
prompts_per_step = 3
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
    assert_trained_without_failures(tmp_path / "protocols", steps=2, min_episodes=6)
