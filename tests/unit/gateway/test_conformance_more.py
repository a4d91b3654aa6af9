"""The vendors' own clients of the Responses and Messages APIs against the gateway: the
episode of test_conformance.py (a tool call, its result, a streamed turn, a turn cut at 2
tokens) through the ``openai`` Responses client, the OpenAI Agents SDK on its Responses
model and the ``anthropic`` client, each inside a real EnvActor process with a scripted
sampler actor behind it. Each client checks what its API promises (its checks fail the
episode); the test checks that the trajectory holds exactly the sampler's ids and the
template's, in one segment."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from actors.chat import HFChatFormat
from actors.env import EnvActor, EnvConfig
from actors.gateway import HarnessConfig
from actors.types import SamplingParams, TaskSpec
from orchestrator.runtime import open_mesh
from tests.unit.gateway._actors import ReplaySampler, tiny_tokenizer_dir
from tests.unit.gateway.clients import QUESTION, TOOLS
from tests.unit.gateway.clients_more import CLIENTS_MORE
from tests.unit.gateway.test_conformance import ANSWER, LONG, TOOL_REPLY

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
pytestmark = pytest.mark.slow  # an env actor, a sampler actor and a client per test: seconds each


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return tiny_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def fmt(tok_dir) -> HFChatFormat:
    return HFChatFormat.from_dir(tok_dir)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("client", sorted(CLIENTS_MORE))
async def test_each_client_plays_the_episode_and_its_ids_are_exact(tok_dir, fmt, client) -> None:
    pytest.importorskip({"openai_agents_responses": "agents", "anthropic_messages": "anthropic"}.get(client, "openai"))
    # The anthropic client runs as its own process (ANTHROPIC_BASE_URL and the key from its
    # environment, as a harness command gets them); the others as an entrypoint.
    harness = (
        HarnessConfig(
            command=f"{sys.executable} -m tests.unit.gateway.clients_more {{task}}",
            cwd=str(ROOT),
            timeout_s=60,
            max_new_tokens=64,
        )
        if client == "anthropic_messages"
        else HarnessConfig(entrypoint=f"{HERE / 'clients_more.py'}:play", timeout_s=60, max_new_tokens=64)
    )
    replies = [fmt.encode(r) for r in (TOOL_REPLY, ANSWER, LONG)]
    config = EnvConfig(harness=harness, model_path=str(tok_dir), max_seq_len=1024)
    async with (
        open_mesh(EnvActor, config, procs=1, name="env") as env,
        open_mesh(ReplaySampler, replies, fmt.vocab_size, procs=1, name="replay") as sampler,
    ):
        task = TaskSpec(task="calc", prompt_id="p0", group_id="g0", params={"client": client, "strict": True})
        traj = await env[0].run_episode.call_one(sampler[0], task, SamplingParams())
        seen = await sampler[0].requests.call_one()
    assert not traj.failed, traj.error
    assert traj.reward == 1.0 and traj.segments == 1 and traj.turns == 3
    generated = [replies[0], replies[1], replies[2][:2]]  # the last turn is cut at 2 tokens
    assert len(seen) == 3
    for before, reply, after in zip(seen, generated, seen[1:], strict=False):
        # Each request is the previous one, its reply as generated, then only the template's new ids.
        assert after[: len(before) + len(reply)] == before + reply
    assert traj.tokens.tolist() == seen[2] + generated[2]
    assert traj.tokens[traj.loss_mask].tolist() == [t for r in generated for t in r]
    if client != "openai_agents_responses":  # they send the tools as written: the same prompt as chat's
        first = [{"role": "user", "content": QUESTION}]
        assert seen[0] == fmt.encode(fmt.render(first, generation_prompt=True, tools=TOOLS))
    tool_turn = fmt.decode(seen[1][len(seen[0]) + len(replies[0]) :], skip_special=False)
    assert "<tool_response>\n5\n</tool_response>" in tool_turn, json.dumps(tool_turn)
