"""The episode of ``clients.py`` through the gateway's other protocols, written with the
vendors' own clients: the ``openai`` package's Responses client, the OpenAI Agents SDK on
its default (Responses) model, and the ``anthropic`` package's Messages client.

The episode: (1) a question with a tool; the model's tool call is run and its result sent
back; (2) a streamed turn; (3) a turn cut at 2 output tokens. The reward is 1.0 when the
streamed answer contains "5". With ``task["strict"]`` (a scripted sampler whose replies are
known) each client also checks what its API promises (stop reasons, statuses, streamed
events and text, usage); a failed check fails the episode.

Use as ``entrypoint = "tests/unit/gateway/clients_more.py:play"`` (``task["client"]`` picks
the client) or as ``command = "python -m tests.unit.gateway.clients_more {task}"`` from the repository root (it reads
``OPENAI_BASE_URL`` / ``ANTHROPIC_BASE_URL`` and the keys, as a harness would).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from tests.unit.gateway.clients import AGAIN, QUESTION, Check, _run_tool, add

PARAMETERS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
RESPONSES_TOOLS = [{"type": "function", "name": "add", "description": "Add two integers.", "parameters": PARAMETERS}]
ANTHROPIC_TOOLS = [{"name": "add", "description": "Add two integers.", "input_schema": PARAMETERS}]


def openai_responses(base_url: str, task: dict[str, Any]) -> float:
    """``client.responses.create``: a function call and its ``function_call_output`` sent back
    with the whole input, a streamed turn, then a short turn by ``previous_response_id``."""
    from openai import OpenAI

    check = Check(task)
    client = OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_retries=0)
    with client:
        items: list[Any] = [{"role": "user", "content": QUESTION}]
        first = client.responses.create(model="flotilla", input=items, tools=RESPONSES_TOOLS, max_output_tokens=64)
        check("turn 1 status", first.status, "completed")
        calls = [o for o in first.output if o.type == "function_call"]
        check("turn 1 function calls", [c.name for c in calls], ["add"])
        items += [o.model_dump(exclude_none=True) for o in first.output]
        items += [
            {"type": "function_call_output", "call_id": c.call_id, "output": _run_tool(c.arguments)} for c in calls
        ]
        if not calls:
            items.append({"role": "user", "content": "Use the tool."})
        answer, kinds, final = "", [], None
        stream = client.responses.create(
            model="flotilla", input=items, tools=RESPONSES_TOOLS, max_output_tokens=64, stream=True
        )
        for n, event in enumerate(stream):
            kinds.append(event.type)
            check("sequence_number", event.sequence_number, n)
            if event.type == "response.output_text.delta":
                answer += event.delta
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        check(
            "turn 2 events",
            [kinds[0], kinds[1], kinds[-1]],
            ["response.created", "response.in_progress", "response.completed"],
        )
        check("turn 2 streamed text", answer, "The answer is 5.")
        check("turn 2 final text", final.output_text if final else None, answer)
        last = client.responses.create(
            model="flotilla",
            previous_response_id=final.id if final else None,
            input=[{"role": "user", "content": AGAIN}],
            tools=RESPONSES_TOOLS,
            max_output_tokens=2,
        )
        check("turn 3 status", last.status, "incomplete")
        check("turn 3 reason", last.incomplete_details.reason if last.incomplete_details else None, "max_output_tokens")
        check("turn 3 usage", last.usage.output_tokens if last.usage else None, 2)
    return check.reward(answer)


def openai_agents_responses(base_url: str, task: dict[str, Any]) -> float:
    """The OpenAI Agents SDK on its default model (``OpenAIResponsesModel``): the SDK runs the
    tool loop, streamed; then a turn cut at 2 tokens, which the SDK reports as an incomplete
    response (``ModelBehaviorError``), as it does against OpenAI. (A random model's reply cut
    at the gateway's cap in the first run ends the episode there, with reward 0.)"""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.exceptions import ModelBehaviorError
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # offline: no trace export to OpenAI
    check = Check(task)

    async def episode() -> float:
        client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        model = OpenAIResponsesModel(model="flotilla", openai_client=client)
        agent = Agent(
            name="calculator", tools=[function_tool(add)], model=model, model_settings=ModelSettings(max_tokens=64)
        )
        run = Runner.run_streamed(agent, QUESTION, max_turns=4)
        try:
            async for _ in run.stream_events():
                pass
        except ModelBehaviorError as e:  # a reply cut at the gateway's cap: the SDK gives up
            check("turns 1-2 complete", str(e), None)
            await client.close()
            return 0.0
        answer = str(run.final_output or "")
        check("turns 1-2 answer", answer, "The answer is 5.")
        calls = [i for i in run.new_items if i.type == "tool_call_item"]
        check("turn 1 tool calls", len(calls), 1)
        short = agent.clone(model_settings=ModelSettings(max_tokens=2))
        incomplete = False
        try:
            await Runner.run(short, [*run.to_input_list(), {"role": "user", "content": AGAIN}], max_turns=1)
        except ModelBehaviorError as e:
            incomplete = "incomplete" in str(e)
        check("turn 3 incomplete", incomplete, True)
        await client.close()
        return check.reward(answer)

    return asyncio.run(episode())


def anthropic_messages(base_url: str, task: dict[str, Any]) -> float:
    """The ``anthropic`` package: ``messages.create`` with a tool, its ``tool_result`` sent
    back through ``messages.stream``, then a turn cut at ``max_tokens=2``."""
    import anthropic

    check = Check(task)
    client = anthropic.Anthropic(
        base_url=os.environ.get("ANTHROPIC_BASE_URL", base_url.removesuffix("/v1")),
        api_key=os.environ.get("ANTHROPIC_API_KEY", "unused"),
        max_retries=0,
    )
    with client:
        messages: list[Any] = [{"role": "user", "content": QUESTION}]
        first = client.messages.create(model="flotilla", max_tokens=64, tools=ANTHROPIC_TOOLS, messages=messages)
        check("turn 1 stop_reason", first.stop_reason, "tool_use")
        uses = [b for b in first.content if b.type == "tool_use"]
        messages.append({"role": "assistant", "content": first.content})
        if uses:
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": u.id, "content": _run_tool(u.input)} for u in uses
                    ],
                }
            )
        else:
            messages.append({"role": "user", "content": "Use the tool."})
        answer = ""
        with client.messages.stream(
            model="flotilla", max_tokens=64, tools=ANTHROPIC_TOOLS, messages=messages
        ) as stream:
            for text in stream.text_stream:
                answer += text
            final = stream.get_final_message()
        check("turn 2 stop_reason", final.stop_reason, "end_turn")
        check("turn 2 streamed text", answer, "The answer is 5.")
        messages += [{"role": "assistant", "content": final.content}, {"role": "user", "content": AGAIN}]
        last = client.messages.create(model="flotilla", max_tokens=2, tools=ANTHROPIC_TOOLS, messages=messages)
        check("turn 3 stop_reason", last.stop_reason, "max_tokens")
        check("turn 3 usage", last.usage.output_tokens, 2)
    return check.reward(answer)


CLIENTS_MORE = {
    "openai_responses": openai_responses,
    "openai_agents_responses": openai_agents_responses,
    "anthropic_messages": anthropic_messages,
}
"""The clients of protocols other than chat completions (``clients.CLIENTS`` holds those)."""


def _pick(task: dict[str, Any]) -> str:
    return task.get("client") or sorted(CLIENTS_MORE)[int(task.get("seed", 0)) % len(CLIENTS_MORE)]


async def play(base_url: str, task: dict[str, Any]) -> dict[str, float]:
    """The entrypoint: the client ``task["client"]`` (default: one per prompt, by its seed) in
    a worker thread, as a blocking or asyncio harness runs beside the gateway's trio loop."""
    import trio

    reward = await trio.to_thread.run_sync(CLIENTS_MORE[_pick(task)], base_url, task, abandon_on_cancel=True)
    return {"reward": reward}


def main() -> None:
    task = json.loads(sys.argv[1])
    print(json.dumps({"reward": CLIENTS_MORE[_pick(task)](os.environ["OPENAI_BASE_URL"], task)}))


if __name__ == "__main__":
    main()
