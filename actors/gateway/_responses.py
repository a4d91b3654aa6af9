"""OpenAI's Responses API (``POST /v1/responses``) over the chat path.

A request is translated into the internal message list a chat completion would give
(``instructions`` as the system message, input items as messages: an assistant message
and the ``function_call`` items after it are one assistant turn, a
``function_call_output`` is a tool message) and served by ``Session.turn``, so token
capture is the chat path's: turns seen before are never re-tokenised and a rewritten
history starts a segment.  ``reasoning`` items are accepted and dropped (the gateway
emits none); images, files and hosted tools are refused with a 400 naming the item.

``previous_response_id`` names a response of the same session: the session keeps each
response's conversation (its input and output; not its instructions, which as in
OpenAI's API apply to one request only) and a request naming one continues from it.

Streaming sends OpenAI's event sequence (``response.created`` ... ``response.completed``,
or ``response.incomplete`` when ``max_output_tokens`` cut the reply), each event with its
``sequence_number``, once the reply is complete (see ``actors.gateway._app``).
"""

from __future__ import annotations

import random
import time
from typing import Any

from pydantic import Field, field_validator

from actors.gateway._schemas import (
    ChatRequest,
    GatewayError,
    OpenModel,
    content_pieces,
    tool_arguments,
)
from actors.gateway._session import Session, Turn

__all__ = ["ResponsesRequest", "respond", "response_events"]


class ResponsesRequest(OpenModel):
    """``POST /v1/responses`` (unknown fields -- ``store``, ``include``, ``reasoning``,
    ``text``, ``metadata``... -- are accepted and ignored)."""

    model: str = ""
    """Model name (any name is accepted)."""
    input: str | list[dict[str, Any]]
    """A user message as text, or a list of input items."""
    instructions: str | None = None
    """A system message placed before the conversation (this request only)."""
    tools: list[dict[str, Any]] | None = None
    """Function tools: ``{"type": "function", "name", "description", "parameters"}``."""
    tool_choice: str | dict[str, Any] | None = None
    """As chat completions: "none" drops the tools from the prompt, the others are accepted."""
    max_output_tokens: int | None = Field(None, ge=1)
    """Generation limit (capped by the gateway's own limit and the context)."""
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    """Honoured only when the gateway is configured to (as chat completions)."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    """As temperature."""
    stream: bool = False
    """Answer as server-sent events."""
    previous_response_id: str | None = None
    """Continue the conversation of this session's response with that id."""
    parallel_tool_calls: bool | None = None
    """Echoed (the model's reply holds as many calls as it holds)."""

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, t in enumerate(v or []):
            if t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise ValueError(
                    f"tools[{i}]: only function tools are supported "
                    "({'type': 'function', 'name': ..., 'parameters': ...})"
                )
        return v


def _id(prefix: str) -> str:
    return f"{prefix}_{random.getrandbits(96):024x}"


def _text(content: Any, where: str) -> str:
    """A message's or output's text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}: must be a string or a list of text parts", param=where)
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text", "text"):
            out.append(p.get("text") or "")
        elif kind == "refusal":
            out.append(p.get("refusal") or "")
        else:
            raise GatewayError(400, f"{where}[{j}]: only text parts are supported, got {kind!r}", param=f"{where}[{j}]")
    return "".join(out)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as template-form messages (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, it in enumerate(items):
        where = f"input[{i}]"
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise GatewayError(
                    400,
                    f"{where}.role: must be user, assistant, system or developer, got {role!r}",
                    param=f"{where}.role",
                )
            out.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _text(it.get("content", ""), f"{where}.content"),
                }
            )
        elif kind == "function_call":
            name = it.get("name")
            if not isinstance(name, str):
                raise GatewayError(400, f"{where}.name: a function call needs its name", param=f"{where}.name")
            arguments = it.get("arguments", "")
            call = {
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": tool_arguments(arguments if isinstance(arguments, (str, dict)) else ""),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # one assistant turn
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = it.get("call_id")
            if not isinstance(call_id, str):
                raise GatewayError(
                    400, f"{where}.call_id: a function call output needs its call_id", param=f"{where}.call_id"
                )
            out.append(
                {"role": "tool", "content": _text(it.get("output", ""), f"{where}.output"), "tool_call_id": call_id}
            )
        elif kind == "reasoning":
            continue
        else:
            raise GatewayError(
                400,
                f"{where}.type: unsupported input item {kind!r} (messages, function_call, "
                "function_call_output and reasoning are)",
                param=f"{where}.type",
            )
    return out


def _template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [
        {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
        for t in tools
    ]


async def respond(session: Session, req: ResponsesRequest) -> tuple[dict[str, Any], Turn]:
    """Serve one Responses request in ``session``; (the response object, the turn).

    Raises GatewayError as ``Session.chat`` does, and (400) for an unknown
    ``previous_response_id``; the session is then unchanged."""
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        held = session.responses.get(req.previous_response_id)
        if held is None:
            raise GatewayError(
                400,
                f"previous_response_id: no response {req.previous_response_id!r} in this session",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = held
    conversation = history + input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    chat = ChatRequest.model_construct(
        model=req.model,
        messages=system + conversation,
        tools=_template_tools(req.tools),
        tool_choice=req.tool_choice,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stream=req.stream,
    )
    turn = await session.turn(chat)
    rid = _id("resp")
    session.responses[rid] = [*conversation, turn.reply]
    return _response(req, rid, turn, session.model), turn


def _response(req: ResponsesRequest, rid: str, turn: Turn, model: str) -> dict[str, Any]:
    incomplete = turn.finish == "length"
    msg = turn.message
    calls = msg.get("tool_calls") or []
    text = msg.get("content") or ""
    output: list[dict[str, Any]] = []
    if text or not calls:
        output.append(
            {
                "id": _id("msg"),
                "type": "message",
                "status": "incomplete" if incomplete else "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
            }
        )
    for c in calls:
        output.append(
            {
                "id": _id("fc"),
                "type": "function_call",
                "status": "completed",
                "call_id": c["id"],
                "name": c["function"]["name"],
                "arguments": c["function"]["arguments"],
            }
        )
    p, k = turn.prompt_tokens, turn.completion_tokens
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": True,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "usage": {
            "input_tokens": p,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": k,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": p + k,
        },
        "user": None,
        "metadata": {},
    }


_ARG_PIECE = 16
"""Characters of a function call's arguments per streamed delta."""


def response_events(response: dict[str, Any], pieces: list[str]) -> list[dict[str, Any]]:
    """A finished response as the events OpenAI streams, numbered by ``sequence_number``.

    Text deltas (``pieces``: the reply token by token where its text allows) concatenate to
    the message's text exactly; a function call's argument deltas to its arguments."""
    events: list[dict[str, Any]] = []

    def ev(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    shell = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    ev("response.created", response=shell)
    ev("response.in_progress", response=shell)
    for i, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": i}
        if item["type"] == "message":
            ev("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "content": []})
            part = item["content"][0]
            ev("response.content_part.added", **at, content_index=0, part={**part, "text": ""})
            for p in content_pieces(part["text"], pieces):
                ev("response.output_text.delta", **at, content_index=0, delta=p, logprobs=[])
            ev("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
            ev("response.content_part.done", **at, content_index=0, part=part)
        else:
            ev("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "arguments": ""})
            args = item["arguments"]
            for k in range(0, len(args), _ARG_PIECE):
                ev("response.function_call_arguments.delta", **at, delta=args[k : k + _ARG_PIECE])
            ev("response.function_call_arguments.done", **at, name=item["name"], arguments=args)
        ev("response.output_item.done", output_index=i, item=item)
    ev("response.completed" if response["status"] == "completed" else "response.incomplete", response=response)
    return events
