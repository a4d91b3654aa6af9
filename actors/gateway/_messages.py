"""Anthropic's Messages API (``POST /v1/messages``) over the chat path.

A request is translated into the internal message list a chat completion would give
(``system`` first; an assistant message's ``text`` blocks are its content and its
``tool_use`` blocks its tool calls; a user message's ``tool_result`` blocks are tool
messages, its ``text`` blocks one user message after them) and served by
``Session.turn``, so token capture is the chat path's: turns seen before are never
re-tokenised and a rewritten history starts a segment.  ``thinking`` blocks are accepted
and dropped (the gateway emits none); images, documents, server tools and a final
assistant message (a prefilled reply) are refused with a 400 naming the field.

Errors are Anthropic's JSON: ``{"type": "error", "error": {"type", "message"}}``.
Streaming sends Anthropic's events (``message_start``, ``content_block_start``, ``ping``,
``content_block_delta``, ``content_block_stop``, ``message_delta``, ``message_stop``) once
the reply is complete (see ``actors.gateway._app``).
"""

from __future__ import annotations

import json
import random
from typing import Any

from pydantic import Field, field_validator

from actors.gateway._schemas import ChatRequest, GatewayError, OpenModel, content_pieces
from actors.gateway._session import Session, Turn

__all__ = ["MessagesRequest", "anthropic_error", "message_events", "reply"]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def anthropic_error(e: GatewayError) -> dict[str, Any]:
    """A gateway error as Anthropic answers errors."""
    return {
        "type": "error",
        "error": {
            "type": _ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error"),
            "message": e.message,
        },
    }


class MessagesRequest(OpenModel):
    """``POST /v1/messages`` (unknown fields -- ``metadata``, ``top_k``, ``thinking``... --
    are accepted and ignored)."""

    model: str = ""
    """Model name (any name is accepted)."""
    max_tokens: int = Field(ge=1)
    """Generation limit, required as Anthropic requires it (capped by the gateway's own
    limit and the context)."""
    messages: list[dict[str, Any]] = Field(min_length=1)
    """The conversation: user and assistant turns, string content or content blocks."""
    system: str | list[dict[str, Any]] | None = None
    """The system prompt: text or text blocks."""
    tools: list[dict[str, Any]] | None = None
    """Client tools: ``{"name", "description", "input_schema"}``."""
    tool_choice: dict[str, Any] | None = None
    """``{"type": "none"}`` drops the tools from the prompt; the others are accepted."""
    stop_sequences: list[str] | None = None
    """The reply ends before the first of these (``stop_reason: "stop_sequence"``)."""
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    """Honoured only when the gateway is configured to (as chat completions)."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    """As temperature."""
    stream: bool = False
    """Answer as server-sent events."""

    @field_validator("tools")
    @classmethod
    def _client_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, t in enumerate(v or []):
            if (
                t.get("type", "custom") != "custom"
                or not isinstance(t.get("name"), str)
                or not isinstance(t.get("input_schema"), dict)
            ):
                raise ValueError(
                    f"tools[{i}]: only client tools are supported "
                    "({'name': ..., 'description': ..., 'input_schema': {...}})"
                )
        return v

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if any(not s for s in v or []):
            raise ValueError("stop sequences must be non-empty")
        return v


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}: must be a string or a list of text blocks")
    out = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text":
            raise GatewayError(
                400,
                f"{where}[{j}]: only text blocks are supported here, got "
                f"{b.get('type') if isinstance(b, dict) else b!r}",
            )
        out.append(b.get("text") or "")
    return "".join(out)


def request_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """The request as template-form messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise GatewayError(400, f"{where}.role: must be user or assistant, got {role!r}")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise GatewayError(400, f"{where}.content: must be a string or a list of content blocks")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text":
                texts.append(b.get("text") or "")
            elif kind in ("thinking", "redacted_thinking"):
                continue
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise GatewayError(400, f"{at}: a tool_use block needs a name and an input object")
                calls.append({"type": "function", "function": {"name": b["name"], "arguments": b.get("input", {})}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise GatewayError(400, f"{at}.tool_use_id: a tool_result block needs the tool_use id")
                out.append(
                    {
                        "role": "tool",
                        "content": _text(b.get("content", ""), f"{at}.content"),
                        "tool_call_id": b["tool_use_id"],
                    }
                )
            else:
                raise GatewayError(400, f"{at}.type: unsupported {role} content block {kind!r}")
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts:
            out.append({"role": "user", "content": "".join(texts)})
    if out[-1]["role"] == "assistant":
        raise GatewayError(
            400, "messages: the last message must be a user turn (prefilling the assistant's reply is not supported)"
        )
    return out


def _id(prefix: str) -> str:
    return f"{prefix}_{random.getrandbits(96):024x}"


async def reply(session: Session, req: MessagesRequest) -> tuple[dict[str, Any], Turn]:
    """Serve one Messages request in ``session``; (the message object, the turn).
    Raises GatewayError as ``Session.chat`` does; the session is then unchanged."""
    tools = None
    if req.tools:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t["input_schema"],
                },
            }
            for t in req.tools
        ]
    choice = "none" if (req.tool_choice or {}).get("type") == "none" else "auto"
    chat = ChatRequest.model_construct(
        model=req.model,
        messages=request_messages(req),
        tools=tools,
        tool_choice=choice,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=req.stop_sequences,
        stream=req.stream,
    )
    turn = await session.turn(chat)
    content: list[dict[str, Any]] = []
    if turn.reply.get("content"):
        content.append({"type": "text", "text": turn.reply["content"]})
    for c in turn.reply.get("tool_calls") or []:
        args = c["function"]["arguments"]
        content.append(
            {
                "type": "tool_use",
                "id": _id("toolu"),
                "name": c["function"]["name"],
                "input": args if isinstance(args, dict) else {},
            }
        )
    stop = (
        "tool_use"
        if turn.reply.get("tool_calls")
        else "stop_sequence"
        if turn.stop is not None
        else "max_tokens"
        if turn.finish == "length"
        else "end_turn"
    )
    return {
        "id": _id("msg"),
        "type": "message",
        "role": "assistant",
        "model": session.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": turn.stop,
        "usage": {
            "input_tokens": turn.prompt_tokens,
            "output_tokens": turn.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }, turn


_JSON_PIECE = 16
"""Characters of a tool_use block's input JSON per streamed delta."""


def message_events(message: dict[str, Any], pieces: list[str]) -> list[dict[str, Any]]:
    """A finished message as the events Anthropic streams (each with its ``type``).

    Text deltas (``pieces``: the reply token by token where its text allows) concatenate to
    the text block exactly; a tool_use block's ``input_json_delta`` pieces to its input JSON."""
    usage = message["usage"]
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage, "output_tokens": 0},
    }
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            events.append({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}})
            deltas = [{"type": "text_delta", "text": p} for p in content_pieces(block["text"], pieces)]
        else:
            events.append({"type": "content_block_start", "index": i, "content_block": {**block, "input": {}}})
            js = json.dumps(block["input"], ensure_ascii=False)
            deltas = [
                {"type": "input_json_delta", "partial_json": js[k : k + _JSON_PIECE]}
                for k in range(0, len(js), _JSON_PIECE)
            ]
        if i == 0:
            events.append({"type": "ping"})
        events += [{"type": "content_block_delta", "index": i, "delta": d} for d in deltas]
        events.append({"type": "content_block_stop", "index": i})
    if not message["content"]:
        events.append({"type": "ping"})
    events.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
            "usage": {"output_tokens": usage["output_tokens"]},
        }
    )
    events.append({"type": "message_stop"})
    return events
