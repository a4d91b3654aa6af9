"""Harness episodes end to end: an openai-client agent (a real subprocess) against the
gateway inside a real EnvActor process, with a scripted sampler actor behind it."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import torch

from actors.chat import HFChatFormat
from actors.env import EnvActor, EnvConfig
from actors.gateway import HarnessConfig
from actors.types import SamplingParams, TaskSpec
from orchestrator.runtime import open_mesh
from orchestrator.state.buffer import RolloutBuffer
from tests.unit.gateway._actors import ReplaySampler, tiny_tokenizer_dir

HERE = Path(__file__).parent

# Each test starts an environment actor, a sampler actor and (three of them) a harness
# process importing the openai client: several seconds each.
pytestmark = pytest.mark.slow
TOOL_REPLY = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
ANSWER = "The answer is 5.<|im_end|>"
AGAIN = "5<|im_end|>"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return tiny_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def fmt(tok_dir) -> HFChatFormat:
    return HFChatFormat.from_dir(tok_dir)


def _env_config(tok_dir: Path, script: str, **kw) -> EnvConfig:
    cmd = f"{sys.executable} {HERE / script} {{task}}"
    return EnvConfig(
        harness=HarnessConfig(command=cmd, timeout_s=60, max_new_tokens=64, **kw),
        model_path=str(tok_dir),
        max_seq_len=512,
    )


async def _episode(tok_dir, fmt, script, replies, params, *, malformed_first: bool = False):
    ids = [fmt.encode(r) for r in replies]
    async with (
        open_mesh(EnvActor, _env_config(tok_dir, script), procs=1, name="env") as env,
        open_mesh(ReplaySampler, ids, fmt.vocab_size, procs=1, name="replay") as sampler,
    ):
        if malformed_first:  # garbage at the actor's gateway: 4xx JSON, and it keeps serving
            address = await env[0].gateway_address.call_one()
            async with httpx.AsyncClient(base_url=address) as client:
                r = await client.post("/v1/chat/completions", content=b"{", headers={"Authorization": "Bearer x"})
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                r = await client.post("/s/x/v1/chat/completions", content=b"\xff\x00")
                assert r.status_code in (400, 404) and "error" in r.json()
        task = TaskSpec(task="calc", prompt_id="p0", group_id="g0", params=params)
        traj = await env[0].run_episode.call_one(sampler[0], task, SamplingParams())
        seen = await sampler[0].requests.call_one()
        stats = await env[0].stats.call_one()
    return traj, ids, seen, stats


async def test_tool_call_episode_records_exactly_the_sampled_and_template_ids(tok_dir, fmt) -> None:
    traj, replies, seen, stats = await _episode(
        tok_dir, fmt, "agent_tool.py", [TOOL_REPLY, ANSWER], {"question": "What is 2+3?"}
    )
    assert not traj.failed, traj.error
    assert traj.reward == 1.0 and traj.turns == 2 and traj.pool == "replay"
    tokens, mask = traj.tokens.tolist(), traj.loss_mask
    # The loss mask covers exactly the generated tokens, in order.
    assert traj.tokens[mask].tolist() == replies[0] + replies[1]
    # Each request is the previous one + its reply + only the template's new ids.
    assert len(seen) == 2
    assert seen[1][: len(seen[0]) + len(replies[0])] == seen[0] + replies[0]
    assert tokens == seen[1] + replies[1]
    # The context ids are the template's own: the first prompt is the tokenised rendering,
    # and the whole sequence decodes to the template's rendering of the conversation.
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            },
        }
    ]
    convo = [{"role": "user", "content": "What is 2+3?"}]
    assert seen[0] == fmt.encode(fmt.render(convo, generation_prompt=True, tools=tools))
    convo += [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "The answer is 5."},
    ]
    assert fmt.decode(tokens, skip_special=False) == fmt.render(convo, generation_prompt=False, tools=tools)[:-1]
    # Support rows and versions travel as the sampler recorded them.
    assert traj.versions.tolist() == [7] * int(mask.sum())
    assert traj.support_ids[::3].tolist() == traj.tokens[mask].tolist()
    torch.testing.assert_close(traj.support_logq[:3].exp(), torch.tensor([0.5, 0.3, 0.2]))
    assert stats["segments"] == 1 and stats["dropped_generated"] == 0 and traj.segments == 1


async def test_rewritten_history_starts_a_new_segment(tok_dir, fmt) -> None:
    traj, replies, seen, stats = await _episode(
        tok_dir, fmt, "agent_tool.py", [TOOL_REPLY, ANSWER, AGAIN], {"question": "What is 2+3?", "rewrite": True}
    )
    assert not traj.failed, traj.error
    assert stats["segments"] == 2 and traj.segments == 2
    assert stats["dropped_generated"] == len(replies[0]) + len(replies[1])
    # The trajectory is the new segment alone: the rewritten history rendered afresh, then the reply.
    assert len(seen) == 3
    assert traj.tokens.tolist() == seen[2] + replies[2]
    assert traj.tokens[traj.loss_mask].tolist() == replies[2]


async def test_crashed_harness_fails_with_its_stderr_and_the_prompt_is_retried(tok_dir, fmt) -> None:
    traj, _, seen, _ = await _episode(tok_dir, fmt, "agent_crash.py", ["hi<|im_end|>"], {}, malformed_first=True)
    assert traj.failed and traj.reward == 0.0
    assert "exited with code 1" in traj.error and "about to fail" in traj.error
    assert "the agent fell over" in traj.error
    assert len(seen) == 1
    # The controller's buffer puts a failed rollout's prompt back in the queue.
    task = TaskSpec(task="calc", prompt_id="p0", group_id="g0")
    buf = RolloutBuffer(group_size=2)
    buf.add_group("g0", "p0", task)
    slot = buf.next_slot()
    drop = buf.complete(slot, traj)
    assert drop is not None and drop.reason == "failed" and buf.counters.dropped_failed == 1
    retry = buf.next_slot()
    assert retry is not None and retry.index == slot.index and retry.attempt == slot.attempt + 1


async def test_entrypoint_harness_on_the_torch_sampler_reuses_the_session_prefix(tok_dir, fmt) -> None:
    """The real sampler behind the gateway: every turn after the first starts from the
    session's cached prefix, the trajectory's generated tokens are what the client was told
    it got, and the session's cache is freed when the episode ends."""
    from actors.sampler import SamplerActor
    from actors.tiny import family_config

    cfg = EnvConfig(
        harness=HarnessConfig(entrypoint=f"{HERE / 'entrypoints.py'}:three_turns", timeout_s=60, max_new_tokens=16),
        model_path=str(tok_dir),
        max_seq_len=256,
    )
    model = family_config("qwen3", fmt.vocab_size)
    async with (
        open_mesh(EnvActor, cfg, procs=1, name="env") as env,
        open_mesh(
            SamplerActor, "cpu-pool", "fp32", model, "cpu", init_seed=0, max_batch=4, seed=3, procs=1, name="sampler"
        ) as sampler,
    ):
        task = TaskSpec(task="chat", prompt_id="p0", group_id="g0", params={"question": "What is 2+3?"})
        traj = await env[0].run_episode.call_one(sampler[0], task, SamplingParams(top_k=16))
        stats = await sampler[0].stats.call_one()
    assert not traj.failed, traj.error
    assert traj.pool == "cpu-pool" and traj.versions.tolist() == [0] * traj.num_generated
    assert stats["prefix_hits"] == 2 and stats["prefix_tokens_reused"] > 0
    assert stats["parked_sessions"] == 0
    if traj.segments == 1:  # one conversation: every token the client was told of is here
        assert traj.reward == traj.num_generated and traj.turns == 3
    # Only generated tokens are trained on, and they are the support rows' tokens.
    rows = traj.support_offsets.tolist()
    sampled = traj.tokens[traj.loss_mask].tolist()
    for i, tok in enumerate(sampled):
        assert tok in traj.support_ids[rows[i] : rows[i + 1]].tolist()
