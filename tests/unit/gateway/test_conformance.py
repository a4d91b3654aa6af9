"""Real clients against the gateway: the same episode (a tool call, its result, a streamed turn,
a turn cut at max_tokens) through raw HTTP following OpenAI's API reference, the openai package
sync and async, the OpenAI Agents SDK and LangChain, each inside a real EnvActor process with a
scripted sampler actor behind it. Each client checks what OpenAI's API promises (its checks fail
the episode); the test checks that the trajectory holds exactly the sampler's ids and the
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
from tests.unit.gateway.clients import CLIENTS, QUESTION, TOOLS

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow  # an env actor, a sampler actor and a client per test: seconds each

TOOL_REPLY = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
ANSWER = "The answer is 5.<|im_end|>"
LONG = "The answer is 5, again and again.<|im_end|>"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return tiny_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def fmt(tok_dir) -> HFChatFormat:
    return HFChatFormat.from_dir(tok_dir)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("client", sorted(CLIENTS))
async def test_each_client_plays_the_episode_and_its_ids_are_exact(tok_dir, fmt, client) -> None:
    if client in ("openai_agents", "langchain"):
        pytest.importorskip({"openai_agents": "agents", "langchain": "langchain_openai"}[client])
    # raw HTTP runs as its own process (the pattern); the others as an entrypoint.
    harness = (
        HarnessConfig(command=f"{sys.executable} {HERE / 'clients.py'} {{task}}", timeout_s=60, max_new_tokens=64)
        if client == "raw_httpx"
        else HarnessConfig(entrypoint=f"{HERE / 'clients.py'}:play", timeout_s=60, max_new_tokens=64)
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
    generated = [replies[0], replies[1], replies[2][:2]]  # the last turn is cut at max_tokens=2
    assert len(seen) == 3
    for before, reply, after in zip(seen, generated, seen[1:], strict=False):
        # Each request is the previous one, its reply as generated, then only the template's new ids.
        assert after[: len(before) + len(reply)] == before + reply
    assert traj.tokens.tolist() == seen[2] + generated[2]
    assert traj.tokens[traj.loss_mask].tolist() == [t for r in generated for t in r]
    if client in ("raw_httpx", "openai_sync", "openai_async", "langchain"):  # they send TOOLS as written
        first = [{"role": "user", "content": QUESTION}]
        assert seen[0] == fmt.encode(fmt.render(first, generation_prompt=True, tools=TOOLS))
    tool_turn = fmt.decode(seen[1][len(seen[0]) + len(replies[0]) :], skip_special=False)
    assert "<tool_response>\n5\n</tool_response>" in tool_turn, json.dumps(tool_turn)
