"""The gateway's HTTP side: a Starlette app served by hypercorn's trio worker.

Routes (each also under ``/s/{session}/...``, the per-episode base URL)::

    POST /v1/chat/completions     chat, tools, stream (SSE)
    POST /v1/completions          plain prompts
    POST /v1/responses            OpenAI's Responses API (``actors.gateway._responses``)
    POST /v1/messages             Anthropic's Messages API (``actors.gateway._messages``)
    GET  /v1/models               the served model
    POST /reward                  {"reward": x}: the episode's reward

Without the ``/s/{session}`` prefix, the API key (``Authorization: Bearer <key>``, or
``x-api-key: <key>`` as Anthropic's clients send it) names the session.  Errors are
OpenAI error JSON (Anthropic's on ``/v1/messages``): 400 malformed or invalid
requests (naming the field), 401 no/unknown session key, 404 unknown route or
session, 409 a closed session, 502 a sampler failure.  A handler's failure never
stops the server: each request is its own task in hypercorn's nursery.

Every chat, responses and messages answer carries ``x-flotilla-sampler-ms``: how long the request waited on
the sampler (the rest of its latency is the gateway's own).

``stream: true`` is answered in OpenAI's chunk format, but only once the reply is
complete: the sampler's ``generate`` is one actor call that returns the whole
generation (the runtime's calls return one value each; ``stream`` there means one value
per actor, not a value per token), and the reply's final form is known only at the
end -- stop strings cut it, and a tool call is parsed out of the generated text. A
harness that streams gets the same chunks it would get from OpenAI, all at once.

Runs in the environment actor's own trio loop (``serve_gateway`` is a structured
lifetime started with ``nursery.start``), so a request handler awaits the sampler
like any other actor task and never blocks the loop.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from actors.gateway._messages import (
    MessagesRequest,
    anthropic_error,
    message_events,
    reply,
)
from actors.gateway._responses import ResponsesRequest, respond, response_events
from actors.gateway._schemas import (
    ChatRequest,
    CompletionRequest,
    GatewayError,
    error_body,
    format_validation_error,
    stream_chunks,
)
from actors.gateway._session import Session

__all__ = ["build_app", "serve_gateway"]


_encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
"""One encoder for the process (``json.dumps`` with options builds one per call)."""

Send = Callable[[dict[str, Any]], Awaitable[None]]


class _JSON(JSONResponse):
    """Starlette's JSONResponse with the process's encoder (for the error handlers)."""

    def render(self, content: Any) -> bytes:
        return _encoder.encode(content).encode()


async def _send_json(
    send: Send, payload: Any, status: int = 200, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    body = _encoder.encode(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _openai_error(e: GatewayError) -> dict[str, Any]:
    return error_body(e.message, type=e.type, param=e.param, code=e.code)


async def _send_stream(send: Send, body: bytes, timing: tuple[bytes, bytes]) -> None:
    """A finished reply's server-sent events: the stream's head, then ``body`` (every event,
    already framed) in one write."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                timing,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _named_events(events: list[dict[str, Any]]) -> bytes:
    """``event: <type>`` + ``data: <json>`` per event, as the Responses and Messages APIs
    stream (no ``[DONE]`` line)."""
    return b"".join(
        b"event: " + e["type"].encode() + b"\ndata: " + _encoder.encode(e).encode() + b"\n\n" for e in events
    )


def _timing(session: Session) -> tuple[bytes, bytes]:
    """The ``x-flotilla-sampler-ms`` header: the request's wait on the sampler. A session
    serves one request at a time by contract, so its last wait is this request's."""
    return (b"x-flotilla-sampler-ms", f"{session.last_sampler_s * 1e3:.3f}".encode())


class _Endpoint:
    """A route's ASGI app: ``handler(scope, body, send)`` answers a request whose body is
    read whole; a ``GatewayError`` it raises (before answering) becomes error JSON
    (``errors`` shapes it: OpenAI's by default). Starlette routes, answers 404/405 and
    catches what a handler fails with.
    """

    def __init__(
        self,
        handler: Callable[[dict[str, Any], bytes, Send], Awaitable[None]],
        errors: Callable[[GatewayError], dict[str, Any]] = _openai_error,
    ) -> None:
        self.handler, self.errors = handler, errors

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict]], send: Send) -> None:
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its request was read
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        try:
            await self.handler(scope, b"".join(chunks), send)
        except GatewayError as e:
            await _send_json(send, self.errors(e), e.status)


def _validated(raw: bytes, model: type[BaseModel]) -> Any:
    """The request body validated as ``model``: parsed and validated in one pass from the
    raw bytes (pydantic-core's JSON parser; no intermediate Python dicts)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        if not first["loc"]:  # the body itself: not JSON, or not an object
            if first["type"] == "json_invalid":
                raise GatewayError(400, f"body is not valid JSON: {first['msg']}") from None
            raise GatewayError(400, f"body must be a JSON object, got {_json_kind(first.get('input'))}") from None
        msg, param = format_validation_error(e)
        raise GatewayError(400, msg, param=param) from None


def _json_kind(value: Any) -> str:
    return {
        list: "an array",
        str: "a string",
        int: "a number",
        float: "a number",
        bool: "a boolean",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def build_app(lookup: Callable[[str], Session | None], model_name: str) -> Starlette:
    """The ASGI app; ``lookup(session_id)`` finds an open (or recently closed) session."""

    def session_of(scope: dict[str, Any]) -> Session:
        sid = scope.get("path_params", {}).get("session")
        if sid is None:
            headers = {k.lower(): v for k, v in scope["headers"]}
            scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer":
                key = headers.get(b"x-api-key", b"").decode("latin-1")
            if not key.strip():
                raise GatewayError(
                    401,
                    "no API key: send 'Authorization: Bearer <session key>' (or "
                    "'x-api-key: <session key>') or use the session's base URL",
                    type="authentication_error",
                    code="invalid_api_key",
                )
            sid = key.strip()
            session = lookup(sid)
            if session is None:
                raise GatewayError(
                    401, "unknown API key (no such session)", type="authentication_error", code="invalid_api_key"
                )
            return session
        session = lookup(sid)
        if session is None:
            raise GatewayError(404, f"no session {sid!r}", code="session_not_found")
        return session

    async def chat(scope: dict[str, Any], body: bytes, send: Send) -> None:
        session = session_of(scope)
        req = _validated(body, ChatRequest)
        response, pieces = await session.chat(req)
        timing = _timing(session)
        if not req.stream:
            return await _send_json(send, response, headers=(timing,))
        chunks = stream_chunks(response, pieces, include_usage=req.include_usage)
        body = b"".join(b"data: " + _encoder.encode(c).encode() + b"\n\n" for c in chunks)
        await _send_stream(send, body + b"data: [DONE]\n\n", timing)

    async def responses(scope: dict[str, Any], body: bytes, send: Send) -> None:
        session = session_of(scope)
        req = _validated(body, ResponsesRequest)
        response, turn = await respond(session, req)
        timing = _timing(session)
        if not req.stream:
            return await _send_json(send, response, headers=(timing,))
        await _send_stream(send, _named_events(response_events(response, turn.pieces)), timing)

    async def messages(scope: dict[str, Any], body: bytes, send: Send) -> None:
        session = session_of(scope)
        req = _validated(body, MessagesRequest)
        message, turn = await reply(session, req)
        timing = _timing(session)
        if not req.stream:
            return await _send_json(send, message, headers=(timing,))
        await _send_stream(send, _named_events(message_events(message, turn.pieces)), timing)

    async def completions(scope: dict[str, Any], body: bytes, send: Send) -> None:
        session = session_of(scope)
        req = _validated(body, CompletionRequest)
        if req.stream:
            raise GatewayError(400, "stream: streaming is supported for chat completions only", param="stream")
        await _send_json(send, await session.complete(req))

    async def models(scope: dict[str, Any], body: bytes, send: Send) -> None:
        await _send_json(
            send,
            {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "flotilla"}]},
        )

    async def reward(scope: dict[str, Any], body: bytes, send: Send) -> None:
        session = session_of(scope)
        try:
            value = float(json.loads(body)["reward"])
        except (ValueError, KeyError, TypeError):
            raise GatewayError(400, 'body must be {"reward": <number>}', param="reward") from None
        if not math.isfinite(value):
            raise GatewayError(400, "reward must be finite", param="reward")
        session.check_open()
        session.reward = value
        await _send_json(send, {"ok": True})

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        msg = f"{request.method} {request.url.path}: " + (
            "no such route" if status == 404 else "method not allowed" if status == 405 else "error"
        )
        return _JSON(error_body(msg, code="not_found" if status == 404 else None), status_code=status)

    async def crashed(request: Request, exc: Exception) -> Response:
        return _JSON(error_body(f"internal error: {type(exc).__name__}: {exc}", type="server_error"), status_code=500)

    routes = []
    for prefix in ("/s/{session}", ""):  # episodes use their session's base URL: matched first
        routes += [
            Route(prefix + "/v1/chat/completions", _Endpoint(chat), methods=["POST"]),
            Route(prefix + "/v1/completions", _Endpoint(completions), methods=["POST"]),
            Route(prefix + "/v1/responses", _Endpoint(responses), methods=["POST"]),
            Route(prefix + "/v1/messages", _Endpoint(messages, anthropic_error), methods=["POST"]),
            Route(prefix + "/v1/models", _Endpoint(models), methods=["GET"]),
            Route(prefix + "/reward", _Endpoint(reward), methods=["POST"]),
        ]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found, Exception: crashed})


async def serve_gateway(
    app: Starlette,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` with hypercorn's trio worker until cancelled; reports the base address
    (``http://host:port``) once it listens.

    Cancellation closes the listener and the open connections.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.include_server_header = False
    config.accesslog = None
    config.errorlog = None
    config.keep_alive_timeout = 75
    config.graceful_timeout = 0.5

    async def run(*, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        await serve(app, config, task_status=task_status)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(run)
        task_status.started(binds[0])
