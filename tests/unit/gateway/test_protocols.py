"""The Responses and Messages APIs over raw HTTP, in-process: their event sequences as the
vendors document them, their error shapes, previous_response_id, stop sequences, the
x-api-key header, and that the history they resend extends the session's ids."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import trio

from actors.chat import HFChatFormat
from actors.gateway import Gateway, SessionLimits
from actors.sampler import GenerateRequest, GenerateResult
from actors.types import SamplingParams, TaskSpec
from tests.unit.gateway._actors import tiny_tokenizer_dir

TASK = TaskSpec(task="t", prompt_id="p", group_id="g")
TOOL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
PARAMS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}


class Script:
    """A generate function answering the n-th request with the n-th scripted text's ids."""

    def __init__(self, fmt: HFChatFormat, texts: list[str]) -> None:
        self.fmt, self.texts, self.requests = fmt, texts, []

    async def __call__(self, req: GenerateRequest) -> GenerateResult:
        ids = self.fmt.encode(self.texts[len(self.requests) % len(self.texts)])[: req.max_new_tokens]
        self.requests.append(req)
        n = len(ids)
        return GenerateResult(
            request_id=req.request_id,
            token_ids=ids,
            support_ids=torch.tensor(ids, dtype=torch.int32),
            support_offsets=torch.arange(n + 1, dtype=torch.int32),
            support_logq=torch.zeros(n),
            versions=[1] * n,
            finish_reason="stop" if ids and ids[-1] in req.stop_token_ids else "length",
            pool="fake",
            prompt_tokens=len(req.prompt_ids),
            seconds=0.0,
        )


@pytest.fixture(scope="module")
def fmt(tmp_path_factory) -> HFChatFormat:
    return HFChatFormat.from_dir(tiny_tokenizer_dir(tmp_path_factory.mktemp("tok")))


@pytest.fixture
async def gateway(nursery, fmt):
    gw = Gateway(fmt, model_name="tiny")
    await nursery.start(gw.serve)
    async with httpx.AsyncClient(base_url=gw.address, timeout=10) as client:
        yield gw, client


def _open(gw: Gateway, fmt: HFChatFormat, texts: list[str]):
    script = Script(fmt, texts)
    return gw.open_session(TASK, script, SessionLimits(SamplingParams(), 1024, 32), 0), script


def _events(text: str) -> list[dict]:
    """SSE ``event:`` + ``data:`` pairs; each event's line names its data's type."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"], block
        out.append(data)
    return out


def _extends(requests: list[GenerateRequest], replies: list[list[int]]) -> None:
    for before, reply, after in zip(requests, replies, requests[1:], strict=False):
        assert after.prompt_ids[: len(before.prompt_ids) + len(reply)] == before.prompt_ids + reply


async def test_responses_stream_events_previous_response_id_and_tool_round_trip(gateway, fmt) -> None:
    gw, c = gateway
    s, script = _open(gw, fmt, [TOOL, "The answer is 5.<|im_end|>", "The answer is 5, again.<|im_end|>"])
    url = f"/s/{s.id}/v1/responses"
    tools = [{"type": "function", "name": "add", "description": "Add.", "parameters": PARAMS, "strict": True}]
    r = await c.post(
        url,
        json={
            "model": "m",
            "instructions": "You are a helpful assistant.",
            "input": "What is 2+3?",
            "tools": tools,
            "store": False,
            "reasoning": {"effort": "low"},
        },
    )
    assert r.status_code == 200, r.text
    assert float(r.headers["x-flotilla-sampler-ms"]) >= 0
    first = r.json()
    assert first["object"] == "response" and first["status"] == "completed"
    [call] = first["output"]
    assert (
        call["type"] == "function_call" and call["name"] == "add" and json.loads(call["arguments"]) == {"a": 2, "b": 3}
    )
    assert first["usage"]["output_tokens"] == len(fmt.encode(TOOL))
    # The whole input resent (with a reasoning item a client kept), streamed.
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "What is 2+3?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "5"},
    ]
    r = await c.post(
        url, json={"instructions": "You are a helpful assistant.", "input": items, "tools": tools, "stream": True}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2 and kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "The answer is 5."
    done = events[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == "The answer is 5."
    # previous_response_id continues from it; max_output_tokens cuts the reply.
    r = await c.post(
        url,
        json={
            "previous_response_id": done["id"],
            "input": "Again.",
            "tools": tools,
            "instructions": "You are a helpful assistant.",
            "max_output_tokens": 2,
        },
    )
    last = r.json()
    assert last["status"] == "incomplete" and last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["usage"]["output_tokens"] == 2 and last["output"][0]["status"] == "incomplete"
    _extends(script.requests, [fmt.encode(t) for t in script.texts])
    assert len(s.segments) == 1
    assert fmt.decode(script.requests[0].prompt_ids, skip_special=False).startswith(
        "<|im_start|>system\nYou are a helpful assistant."
    )
    # A function call's arguments stream in pieces that join to them.
    s2, _ = _open(gw, fmt, [TOOL])
    events = _events(
        (await c.post(f"/s/{s2.id}/v1/responses", json={"input": "x", "tools": tools, "stream": True})).text
    )
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(args) == {"a": 2, "b": 3}
    assert next(e for e in events if e["type"] == "response.function_call_arguments.done")["arguments"] == args


async def test_responses_errors_are_openai_errors(gateway, fmt) -> None:
    gw, c = gateway
    s, script = _open(gw, fmt, ["5<|im_end|>"])
    url = f"/s/{s.id}/v1/responses"

    async def err(body: dict, param: str | None) -> None:
        r = await c.post(url, json=body)
        assert r.status_code == 400, r.text
        e = r.json()["error"]
        assert e["message"] and e["type"] == "invalid_request_error" and e["param"] == param, e

    await err({"model": "m"}, "input")
    await err({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id")
    await err(
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"
    )
    await err({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type")
    await err({"input": "x", "tools": [{"type": "web_search"}]}, "tools")
    await err({"input": "x", "max_output_tokens": 0}, "max_output_tokens")
    assert script.requests == []
    r = await c.post("/v1/responses", json={"input": "x"}, headers={"Authorization": f"Bearer {s.id}"})
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "5"


async def test_messages_stream_stop_sequences_tools_and_the_api_key_header(gateway, fmt) -> None:
    gw, c = gateway
    s, script = _open(gw, fmt, [TOOL, "The answer is 5.<|im_end|>", "The answer is 5, again.<|im_end|>"])
    headers = {"x-api-key": s.id, "anthropic-version": "2023-06-01"}
    tools = [{"name": "add", "description": "Add.", "input_schema": PARAMS}]
    system = [{"type": "text", "text": "You are a helpful assistant."}]
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    r = await c.post(
        "/v1/messages",
        headers=headers,
        json={"model": "m", "max_tokens": 32, "system": system, "tools": tools, "messages": msgs},
    )
    assert r.status_code == 200, r.text
    assert float(r.headers["x-flotilla-sampler-ms"]) >= 0
    first = r.json()
    assert first["type"] == "message" and first["stop_reason"] == "tool_use" and first["stop_sequence"] is None
    [use] = first["content"]
    assert use["type"] == "tool_use" and use["input"] == {"a": 2, "b": 3} and use["id"].startswith("toolu_")
    msgs += [
        {"role": "assistant", "content": first["content"]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": [{"type": "text", "text": "5"}]}],
        },
    ]
    r = await c.post(
        f"/s/{s.id}/v1/messages",
        json={"max_tokens": 32, "system": system, "tools": tools, "messages": msgs, "stream": True},
    )
    events = _events(r.text)
    kinds = [e["type"] for e in events]
    deltas = kinds.count("content_block_delta")
    assert deltas >= 2 and kinds == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "The answer is 5."
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == len(fmt.encode("The answer is 5.<|im_end|>"))
    msgs += [
        {"role": "assistant", "content": [{"type": "text", "text": "The answer is 5."}]},
        {"role": "user", "content": "Again."},
    ]
    r = await c.post(
        "/v1/messages",
        headers=headers,
        json={"max_tokens": 32, "system": system, "tools": tools, "messages": msgs, "stop_sequences": [", again"]},
    )
    last = r.json()
    assert last["stop_reason"] == "stop_sequence" and last["stop_sequence"] == ", again"
    assert last["content"] == [{"type": "text", "text": "The answer is 5"}]
    _extends(script.requests, [fmt.encode(t) for t in script.texts])
    assert len(s.segments) == 1
    # A streamed tool_use block: its input JSON in input_json_delta pieces.
    s2, _ = _open(gw, fmt, [TOOL])
    events = _events(
        (
            await c.post(
                f"/s/{s2.id}/v1/messages", json={"max_tokens": 32, "tools": tools, "stream": True, "messages": msgs[:1]}
            )
        ).text
    )
    start = next(e for e in events if e["type"] == "content_block_start")["content_block"]
    assert start["type"] == "tool_use" and start["name"] == "add" and start["input"] == {}
    pieces = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert pieces and all(p["type"] == "input_json_delta" for p in pieces)
    assert json.loads("".join(p["partial_json"] for p in pieces)) == {"a": 2, "b": 3}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


async def test_messages_errors_are_anthropic_errors(gateway, fmt) -> None:
    gw, c = gateway
    s, script = _open(gw, fmt, ["5<|im_end|>"])
    url = f"/s/{s.id}/v1/messages"
    ok = {"max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}

    async def err(r: httpx.Response, status: int, kind: str, says: str) -> None:
        assert r.status_code == status, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == kind and says in body["error"]["message"], body

    await err(await c.post(url, json={"messages": ok["messages"]}), 400, "invalid_request_error", "max_tokens")
    await err(await c.post(url, content=b"{nope"), 400, "invalid_request_error", "JSON")
    await err(
        await c.post(url, json={**ok, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
        400,
        "invalid_request_error",
        "messages[0].content[0]",
    )
    await err(
        await c.post(url, json={**ok, "messages": [*ok["messages"], {"role": "assistant", "content": "I"}]}),
        400,
        "invalid_request_error",
        "prefill",
    )
    await err(
        await c.post(url, json={**ok, "tools": [{"type": "web_search_20250305", "name": "web"}]}),
        400,
        "invalid_request_error",
        "tools",
    )
    await err(
        await c.post("/v1/messages", json=ok, headers={"x-api-key": "nope"}), 401, "authentication_error", "unknown"
    )
    await err(await c.post("/s/nope/v1/messages", json=ok), 404, "not_found_error", "nope")
    assert script.requests == []
    r = await c.post(url, json=ok)
    assert r.status_code == 200 and r.json()["content"] == [{"type": "text", "text": "5"}]


async def test_the_vendors_stream_helpers_accumulate_tool_calls(gateway, fmt) -> None:
    """``client.responses.stream`` and ``client.messages.stream`` rebuild the reply from the
    events: a function call's arguments and a tool_use block's input come out whole."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    gw, _ = gateway
    s, _ = _open(gw, fmt, [TOOL])
    s2, _ = _open(gw, fmt, [TOOL])

    def play() -> tuple:
        with (
            openai.OpenAI(base_url=f"{gw.address}/s/{s.id}/v1", api_key="k", max_retries=0) as client,
            client.responses.stream(
                model="m", input="What is 2+3?", tools=[{"type": "function", "name": "add", "parameters": PARAMS}]
            ) as stream,
        ):
            response = stream.get_final_response()
        with (
            anthropic.Anthropic(base_url=gw.address, api_key=s2.id, max_retries=0) as client,
            client.messages.stream(
                model="m",
                max_tokens=32,
                messages=[{"role": "user", "content": "2+3?"}],
                tools=[{"name": "add", "input_schema": PARAMS}],
            ) as stream,
        ):
            message = stream.get_final_message()
        return response, message

    response, message = await trio.to_thread.run_sync(play)
    [call] = response.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"a": 2, "b": 3}
    [use] = message.content
    assert use.type == "tool_use" and use.input == {"a": 2, "b": 3} and message.stop_reason == "tool_use"
