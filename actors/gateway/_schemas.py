"""The OpenAI wire format the gateway speaks: request models (validated with pydantic),
response builders and OpenAI-style error JSON.

Only what the gateway honours is modelled; unknown top-level fields are accepted and
ignored (clients send many: ``user``, ``metadata``, ``parallel_tool_calls``...), as the
OpenAI API does, but a field we model with a wrong type or value is a 400 naming it.
"""

from __future__ import annotations

import json
import random
import re
import time
from typing import Any, Literal, NotRequired

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from typing_extensions import TypedDict

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "GatewayError",
    "OpenModel",
    "chat_response",
    "completion_response",
    "content_pieces",
    "error_body",
    "format_validation_error",
    "logprob_entry",
    "stream_chunks",
    "template_message",
    "tool_arguments",
]


class GatewayError(Exception):
    """An error answered as OpenAI error JSON with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API answers errors."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[A-Za-z_-]+\[.*\])$")


def format_validation_error(err: ValidationError) -> tuple[str, str | None]:
    """(one-line message naming the first bad field, that field's dotted path)."""
    errors = err.errors()
    # A union reports one error per branch, its loc tagged with the branch ("str",
    # "list[TextPart]"): the deepest error is the branch that came closest.
    e = max(errors, key=lambda x: len(x["loc"]))
    loc = ".".join(str(p) for p in e["loc"] if not _UNION_TAG.match(str(p))) or None
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{loc or 'body'}: {e['msg']}{more}", loc


class OpenModel(BaseModel):
    """A request model that ignores fields it does not model, as the vendors' APIs do."""

    model_config = ConfigDict(extra="ignore")


# The messages are TypedDicts, not models: a harness resends its whole history every
# turn, and validating dicts costs less than half of building a model per message.
class FunctionCall(TypedDict):
    name: str
    """The tool's name."""
    arguments: NotRequired[str | dict[str, Any]]
    """Arguments as the JSON string OpenAI sends (a dict is accepted too)."""


class ToolCall(TypedDict):
    id: NotRequired[str | None]
    """Call id (echoed in the tool message's ``tool_call_id``)."""
    type: NotRequired[Literal["function"]]
    """Only function tools exist."""
    function: FunctionCall
    """Which function, with which arguments."""


class TextPart(TypedDict):
    type: Literal["text"]
    """Only text parts (images and audio are refused)."""
    text: str


class ChatMessage(TypedDict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    """Who speaks; ``developer`` is treated as ``system``."""
    content: NotRequired[str | list[TextPart] | None]
    """Text, or a list of ``{"type": "text", "text": ...}`` parts."""
    tool_calls: NotRequired[list[ToolCall] | None]
    """Assistant tool calls."""
    tool_call_id: NotRequired[str | None]
    """A tool message's call id."""
    name: NotRequired[str | None]
    """Optional speaker/tool name."""


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A validated message as a chat template reads it (text content, dict arguments)."""
    role = m["role"]
    content = m.get("content")
    if type(content) is not str:
        content = "".join(p["text"] for p in content) if content else ""
    msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    calls = m.get("tool_calls")
    if calls:
        msg["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": tool_arguments(c["function"].get("arguments", "{}")),
                },
            }
            for c in calls
        ]
    if role == "tool":
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("name") is not None:
            msg["name"] = m["name"]
    return msg


def tool_arguments(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments  # the model wrote broken JSON; it stays as text


class _Sampling(OpenModel):
    model: str = ""
    """Model name (any name is accepted; ``GET /v1/models`` lists the served one)."""
    max_tokens: int | None = Field(None, ge=1)
    """Generation limit (capped by the gateway's own limit and the context)."""
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    """Honoured only when the gateway is configured to; training needs the recipe's."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    """As temperature."""
    stop: str | list[str] | None = None
    """Up to 4 stop strings; the reply ends before the first one."""
    n: int = 1
    """Only 1 (one trajectory per turn)."""
    stream: bool = False
    """Answer as server-sent events."""
    seed: int | None = None
    """Accepted, ignored (sampling is seeded by the sampler)."""

    @field_validator("n")
    @classmethod
    def _one(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop strings")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class StreamOptions(OpenModel):
    include_usage: bool = False
    """Send a last chunk with ``choices: []`` and the usage (and ``usage: null`` on the others)."""


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    """The conversation so far."""
    tools: list[dict[str, Any]] | None = None
    """OpenAI function tools, handed to the chat template."""
    tool_choice: str | dict[str, Any] | None = None
    """"auto"/"none"/"required" or a named function; "none" drops the tools from the prompt
    (the others cannot constrain a sampled reply: the model's reply is what it is)."""
    max_completion_tokens: int | None = Field(None, ge=1)
    """The newer name of max_tokens (wins when both are given)."""
    stream_options: StreamOptions | None = None
    """With ``stream``: ``include_usage`` asks for the usage chunk, as OpenAI's API does."""
    logprobs: bool = False
    """Return each generated token's log-probability (the sampler's distribution: after
    temperature, top-k and top-p, which is what the recipe records)."""
    top_logprobs: int | None = Field(None, ge=0, le=20)
    """With ``logprobs``: that many most likely tokens of each position's sampling support."""

    @model_validator(mode="after")
    def _tools(self) -> ChatRequest:
        for i, t in enumerate(self.tools or []):
            fn = t.get("function")
            if t.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return self.tools

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """``POST /v1/completions`` (plain prompts, no chat template)."""

    prompt: str | list[int]
    """Text, or token ids used as they are."""
    logprobs: int | None = None
    """Not supported for plain completions (a 400 says so); chat completions have them."""

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("logprobs are supported for chat completions only")
        return v


def _id(prefix: str) -> str:
    return f"{prefix}-{random.getrandbits(96):024x}"  # unique, not secret: no syscall


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def openai_message(msg: dict[str, Any]) -> dict[str, Any]:
    """A parsed assistant message in OpenAI's shape (string arguments, call ids)."""
    out: dict[str, Any] = {
        "role": "assistant",
        "content": msg.get("content") or None,
        "refusal": None,
        "annotations": [],
    }
    calls = msg.get("tool_calls")
    if calls:
        out["tool_calls"] = [
            {
                "id": f"call_{random.getrandbits(64):016x}",
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": (
                        c["function"]["arguments"]
                        if isinstance(c["function"]["arguments"], str)
                        else json.dumps(c["function"]["arguments"])
                    ),
                },
            }
            for c in calls
        ]
    return out


def chat_response(
    model: str,
    message: dict[str, Any],
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` object with one choice; ``logprobs``: one entry per token."""
    return {
        "id": _id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            }
        ],
        "usage": _usage(prompt_tokens, completion_tokens),
        "system_fingerprint": None,
    }


def logprob_entry(token: str, logprob: float, top: list[tuple[str, float]]) -> dict[str, Any]:
    """One position of ``choices[].logprobs.content``."""

    def one(t: str, lp: float) -> dict[str, Any]:
        return {"token": t, "logprob": lp, "bytes": list(t.encode())}

    return {**one(token, logprob), "top_logprobs": [one(t, lp) for t, lp in top]}


def completion_response(
    model: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """A ``text_completion`` object with one choice."""
    return {
        "id": _id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": _usage(prompt_tokens, completion_tokens),
    }


def stream_chunks(response: dict[str, Any], pieces: list[str], *, include_usage: bool = False) -> list[dict[str, Any]]:
    """A finished chat response as the ``chat.completion.chunk`` objects OpenAI streams.

    The first delta carries the role; content deltas (``pieces``, one per generated token
    where the decoded text allows) concatenate to the message's content exactly; each tool
    call opens with its ``index``, ``id``, ``type`` and name, then streams its arguments in
    pieces; a last delta carries ``finish_reason``. With ``include_usage`` every chunk has
    ``usage: null`` and one more chunk, with ``choices: []``, the usage. Logprobs, when the
    response has them, ride on the content chunks of their tokens.
    """
    base: dict[str, Any] = {
        "id": response["id"],
        "object": "chat.completion.chunk",
        "created": response["created"],
        "model": response["model"],
        "system_fingerprint": None,
    }
    if include_usage:
        base["usage"] = None
    choice = response["choices"][0]
    msg = choice["message"]
    content = msg.get("content") or ""
    calls = msg.get("tool_calls") or []
    logprobs = (choice.get("logprobs") or {}).get("content")

    def chunk(delta: dict[str, Any], finish: str | None = None, lps: list | None = None) -> dict[str, Any]:
        return {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": finish,
                    "logprobs": None if lps is None else {"content": lps, "refusal": None},
                }
            ],
        }

    out = [chunk({"role": "assistant", "content": "" if content or not calls else None, "refusal": None})]
    parts = content_pieces(content, pieces)
    for i, p in enumerate(parts):
        lps = None
        if logprobs is not None:  # token i's entry; what no piece stands for goes with the last
            lps = logprobs[i : i + 1] if i < len(parts) - 1 else logprobs[i:]
        out.append(chunk({"content": p}, lps=lps))
    for i, call in enumerate(calls):
        fn = call["function"]
        out.append(
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": fn["name"], "arguments": ""},
                        }
                    ]
                }
            )
        )
        args = fn["arguments"]
        for k in range(0, len(args), _ARG_PIECE):
            out.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": args[k : k + _ARG_PIECE]}}]}))
    # A reply without content (a tool call only): its tokens' logprobs ride on the last delta.
    out.append(chunk({}, choice["finish_reason"], lps=logprobs if logprobs and not parts else None))
    if include_usage:
        out.append({**base, "choices": [], "usage": response["usage"]})
    return out


_ARG_PIECE = 16
"""Characters of a tool call's arguments per streamed delta."""


def content_pieces(content: str, pieces: list[str]) -> list[str]:
    """``pieces`` (the reply's text token by token) as far as they spell ``content``, then the
    rest of ``content`` in one piece: the deltas always concatenate to ``content`` (a stop
    string, tool-call markup or a split multi-byte character end the token-wise part)."""
    out, pos = [], 0
    for p in pieces:
        if not p:
            continue
        if not content.startswith(p, pos):
            break
        out.append(p)
        pos += len(p)
    if pos < len(content):
        out.append(content[pos:])
    return out
