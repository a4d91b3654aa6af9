"""One multi-turn episode written five ways, as people write harnesses: raw HTTP following
OpenAI's API reference (no openai package, ``chunk["choices"][0]`` unguarded), the ``openai``
package sync and async, the OpenAI Agents SDK and LangChain's ``ChatOpenAI``.

The episode: (1) a question with a tool; the model's tool call is run and its result sent
back; (2) a streamed turn; (3) a turn cut at ``max_tokens=2``. The reward is 1.0 when the
streamed answer contains "5". With ``task["strict"]`` (a scripted sampler whose replies are
known) each client also checks what OpenAI's API promises: ``finish_reason`` ``tool_calls``,
then ``stop``, then ``length``, and the streamed text; a failed check fails the episode.

Use as ``entrypoint = "tests/unit/gateway/clients.py:play"`` (``task["client"]`` picks the
client; it runs in a worker thread, as a blocking or asyncio program would) or as
``command = "python tests/unit/gateway/clients.py {task}"``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

QUESTION = "What is 2+3?"
AGAIN = "Say it again, briefly."
TOOLS = [
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


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _run_tool(arguments: str | dict) -> str:
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        return str(add(int(args["a"]), int(args["b"])))
    except (ValueError, KeyError, TypeError):
        return "error: add needs integer a and b"


class Check:
    """The episode's protocol expectations, checked only when the replies are scripted."""

    def __init__(self, task: dict[str, Any]) -> None:
        self.strict = bool(task.get("strict"))

    def __call__(self, what: str, got: Any, want: Any) -> None:
        if self.strict and got != want:
            raise AssertionError(f"{what}: got {got!r}, expected {want!r}")

    def reward(self, answer: str) -> float:
        return 1.0 if "5" in answer else 0.0


# ----------------------------------------------------------------- raw HTTP, the API reference


def raw_httpx(base_url: str, task: dict[str, Any]) -> float:
    import httpx

    check = Check(task)
    key = os.environ.get("OPENAI_API_KEY", "unused")
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:

        def create(**body: Any) -> dict[str, Any]:
            r = http.post("/chat/completions", json={"model": "flotilla", **body})
            r.raise_for_status()
            return r.json()

        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        first = create(messages=messages, tools=TOOLS, max_tokens=64)
        choice = first["choices"][0]
        check("turn 1 finish_reason", choice["finish_reason"], "tool_calls")
        messages.append(choice["message"])
        for call in choice["message"].get("tool_calls") or []:
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": _run_tool(call["function"]["arguments"])}
            )
        if not choice["message"].get("tool_calls"):
            messages.append({"role": "user", "content": "Use the tool."})
        answer, finish = "", None
        body = {"model": "flotilla", "messages": messages, "tools": TOOLS, "max_tokens": 64, "stream": True}
        with http.stream("POST", "/chat/completions", json=body) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[len("data: ") :])
                delta = chunk["choices"][0]["delta"]  # unguarded, as in OpenAI's streaming examples
                answer += delta.get("content") or ""
                finish = chunk["choices"][0]["finish_reason"] or finish
        check("turn 2 finish_reason", finish, "stop")
        check("turn 2 streamed text", answer, "The answer is 5.")
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": AGAIN}]
        last = create(messages=messages, tools=TOOLS, max_tokens=2)
        check("turn 3 finish_reason", last["choices"][0]["finish_reason"], "length")
        check("turn 3 usage", last["usage"]["completion_tokens"], 2)
    return check.reward(answer)


# ----------------------------------------------------------------- the openai package


def openai_sync(base_url: str, task: dict[str, Any]) -> float:
    from openai import OpenAI

    check = Check(task)
    client = OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_retries=0)
    with client:
        messages: list[Any] = [{"role": "user", "content": QUESTION}]
        first = client.chat.completions.create(model="flotilla", messages=messages, tools=TOOLS, max_tokens=64)
        msg = first.choices[0].message
        check("turn 1 finish_reason", first.choices[0].finish_reason, "tool_calls")
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _run_tool(call.function.arguments)})
        if not msg.tool_calls:
            messages.append({"role": "user", "content": "Use the tool."})
        answer, finish, usage = "", None, None
        stream = client.chat.completions.create(
            model="flotilla",
            messages=messages,
            tools=TOOLS,
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices:
                answer += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        check("turn 2 finish_reason", finish, "stop")
        check("turn 2 streamed text", answer, "The answer is 5.")
        check("turn 2 usage chunk", usage is not None, True)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": AGAIN}]
        last = client.chat.completions.create(model="flotilla", messages=messages, tools=TOOLS, max_tokens=2)
        check("turn 3 finish_reason", last.choices[0].finish_reason, "length")
    return check.reward(answer)


def openai_async(base_url: str, task: dict[str, Any]) -> float:
    from openai import AsyncOpenAI

    check = Check(task)

    async def episode() -> float:
        async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            messages: list[Any] = [{"role": "user", "content": QUESTION}]
            first = await client.chat.completions.create(
                model="flotilla", messages=messages, tools=TOOLS, max_completion_tokens=64
            )
            msg = first.choices[0].message
            check("turn 1 finish_reason", first.choices[0].finish_reason, "tool_calls")
            messages.append(msg)  # the pydantic message itself, as many harnesses do
            for call in msg.tool_calls or []:
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": _run_tool(call.function.arguments)}
                )
            if not msg.tool_calls:
                messages.append({"role": "user", "content": "Use the tool."})
            answer, finish = "", None
            stream = await client.chat.completions.create(
                model="flotilla", messages=messages, tools=TOOLS, max_completion_tokens=64, stream=True
            )
            async for chunk in stream:
                check("no usage chunk unless asked", chunk.usage, None)
                answer += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            check("turn 2 finish_reason", finish, "stop")
            check("turn 2 streamed text", answer, "The answer is 5.")
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": AGAIN}]
            last = await client.chat.completions.create(
                model="flotilla", messages=messages, tools=TOOLS, max_completion_tokens=2
            )
            check("turn 3 finish_reason", last.choices[0].finish_reason, "length")
            return check.reward(answer)

    return asyncio.run(episode())


# ----------------------------------------------------------------- agent frameworks


def openai_agents(base_url: str, task: dict[str, Any]) -> float:
    """The OpenAI Agents SDK on its chat-completions model: the SDK runs the tool loop."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # offline: no trace export to OpenAI
    check = Check(task)

    async def episode() -> float:
        client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        model = OpenAIChatCompletionsModel(model="flotilla", openai_client=client)
        agent = Agent(
            name="calculator", tools=[function_tool(add)], model=model, model_settings=ModelSettings(max_tokens=64)
        )
        run = Runner.run_streamed(agent, QUESTION, max_turns=4)
        async for _ in run.stream_events():
            pass
        answer = str(run.final_output or "")
        check("turns 1-2 answer", answer, "The answer is 5.")
        calls = [i for i in run.new_items if i.type == "tool_call_item"]
        check("turn 1 tool calls", len(calls), 1)
        short = agent.clone(model_settings=ModelSettings(max_tokens=2))
        again = await Runner.run(short, [*run.to_input_list(), {"role": "user", "content": AGAIN}], max_turns=1)
        response = again.raw_responses[-1]
        check("turn 3 output tokens", response.usage.output_tokens, 2)
        await client.close()
        return check.reward(answer)

    return asyncio.run(episode())


def langchain(base_url: str, task: dict[str, Any]) -> float:
    """LangChain's ChatOpenAI with a bound tool: invoke, tool message, stream, a short turn."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    check = Check(task)

    async def episode() -> float:
        def llm(max_tokens: int) -> Any:
            return ChatOpenAI(
                model="flotilla", base_url=base_url, api_key="unused", max_retries=0, max_tokens=max_tokens
            ).bind_tools(TOOLS)

        messages: list[Any] = [HumanMessage(QUESTION)]
        first = await llm(64).ainvoke(messages)
        check("turn 1 finish_reason", first.response_metadata.get("finish_reason"), "tool_calls")
        messages.append(first)
        for call in first.tool_calls:
            messages.append(ToolMessage(_run_tool(call["args"]), tool_call_id=call["id"]))
        if not first.tool_calls:
            messages.append(HumanMessage("Use the tool."))
        full = None
        async for chunk in llm(64).astream(messages):
            full = chunk if full is None else full + chunk
        answer = full.content if full is not None and isinstance(full.content, str) else ""
        check("turn 2 streamed text", answer, "The answer is 5.")
        check("turn 2 finish_reason", full.response_metadata.get("finish_reason") if full else None, "stop")
        messages += [full, HumanMessage(AGAIN)]
        last = await llm(2).ainvoke(messages)
        check("turn 3 finish_reason", last.response_metadata.get("finish_reason"), "length")
        return check.reward(answer)

    return asyncio.run(episode())


CLIENTS = {
    "raw_httpx": raw_httpx,
    "openai_sync": openai_sync,
    "openai_async": openai_async,
    "openai_agents": openai_agents,
    "langchain": langchain,
}


async def play(base_url: str, task: dict[str, Any]) -> dict[str, float]:
    """The entrypoint: the client ``task["client"]`` (default: one per prompt, by its seed) in
    a worker thread, as a blocking or asyncio harness runs beside the gateway's trio loop."""
    import trio

    name = task.get("client") or sorted(CLIENTS)[int(task.get("seed", 0)) % len(CLIENTS)]
    reward = await trio.to_thread.run_sync(CLIENTS[name], base_url, task, abandon_on_cancel=True)
    return {"reward": reward}


def main() -> None:
    task = json.loads(sys.argv[1])
    name = task.get("client") or sorted(CLIENTS)[int(task.get("seed", 0)) % len(CLIENTS)]
    reward = CLIENTS[name](os.environ["OPENAI_BASE_URL"], task)
    print(json.dumps({"reward": reward}))


if __name__ == "__main__":
    main()
