"""A lean HTTP/1.1 server for ASGI apps, on trio and h11: the gateway's default server.

Why not only hypercorn: a gateway turn is one small request and one small JSON answer,
and between turns the process sleeps while the sampler computes, so every turn runs
its code with cold caches and pays for each layer it passes through. hypercorn's trio
worker (per-connection and per-request tasks, event queues, its own event classes
around h11) measured 0.45 ms per turn on this project's 2-core machine with a sampler
that answers at once, and about twice that after the sampler's usual wait; this server
does the same HTTP/1.1 work with the same protocol engine (h11) in one task per
connection, in about half of that (``benchmarks/gateway.py`` runs both side by side).
hypercorn stays available (``server="hypercorn"``: a server with a longer record).

What it does:

* HTTP/1.1 and 1.0, keep-alive, ``Expect: 100-continue``, chunked request bodies and
  chunked (streamed) responses -- h11 does the protocol, this module only the I/O;
* ASGI 3.0, ``http`` scope, spec 2.4: the request body is delivered in one
  ``http.request`` message; later ``receive()`` calls wait until the response is done
  and then report ``http.disconnect``; ``send`` raises ``OSError`` once the client is
  gone;
* a response that declares its ``content-length`` (every JSON answer) leaves in one
  socket write, head and body together: one wake-up of the client per turn. Other
  responses (streams) send their head at once;
* limits: request heads over 64 KiB and bodies over ``max_body`` get 431/413; a
  connection idle for ``keep_alive_s`` is closed; malformed HTTP gets a 400 -- all as
  OpenAI error JSON -- and the connection is closed;
* an app that fails gets a 500 (when it had not started its answer) and the
  connection is closed; the server and the other connections go on.

Not here: HTTP/2, TLS, WebSockets, lifespan events (the gateway has no startup work), and
no early ``http.disconnect``: a request whose client left runs to its end (its sampler call
included) and its answer is dropped.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import h11
import trio

from actors.gateway._schemas import error_body

__all__ = ["serve_asgi"]

log = logging.getLogger(__name__)

ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]],
                   Awaitable[None]]

_MAX_HEAD = 64 * 1024
_READ = 64 * 1024


class _Closed(Exception):
    """The client closed the connection (or sent something we cannot answer)."""


class _Connection:
    """One client connection: requests one after another, each through the app."""

    def __init__(self, stream: trio.SocketStream, app: ASGIApp, max_body: int, keep_alive_s: float) -> None:
        self.stream, self.app = stream, app
        self.max_body, self.keep_alive_s = max_body, keep_alive_s
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        sock = stream.socket
        self.server = tuple(sock.getsockname()[:2])
        self.client = tuple(sock.getpeername()[:2])

    async def _event(self) -> Any:
        """The next h11 event, reading from the socket as needed (idle timeout applies)."""
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = b""
            with trio.move_on_after(self.keep_alive_s):
                try:
                    data = await self.stream.receive_some(_READ)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    raise _Closed from None
                if not data and self.h11.their_state is h11.IDLE:
                    raise _Closed   # a clean close between requests
            self.h11.receive_data(data)   # b"" (also on timeout): end of stream, h11 decides

    async def _write(self, *events: Any) -> None:
        data = b"".join(self.h11.send(e) or b"" for e in events)
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise _Closed from None

    async def _error(self, status: int, message: str, *, type: str = "invalid_request_error") -> None:
        """Answer ``status`` with OpenAI error JSON and have the connection close after it."""
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = json.dumps(error_body(message, type=type)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        await self._write(h11.Response(status_code=status, headers=headers), h11.Data(data=body),
                          h11.EndOfMessage())

    async def serve(self) -> None:
        try:
            while True:
                try:
                    event = await self._event()
                    if not isinstance(event, h11.Request):
                        return   # ConnectionClosed, or a timeout before a request
                    if len(event.target) + sum(len(k) + len(v) for k, v in event.headers) > _MAX_HEAD:
                        # h11 bounds only a head still incomplete; one read may bring it all
                        await self._error(431, f"request head over {_MAX_HEAD} bytes")
                        return
                    body = await self._body()
                except h11.RemoteProtocolError as e:
                    status = e.error_status_hint
                    await self._error(431 if status == 431 else 400, f"malformed HTTP request: {e}")
                    return
                except _BodyTooLarge:
                    await self._error(413, f"request body over {self.max_body} bytes")
                    return
                if not await self._run_app(event, body):
                    return
                if self.h11.our_state is h11.MUST_CLOSE or self.h11.their_state is not h11.DONE:
                    return
                self.h11.start_next_cycle()
        except _Closed:
            return

    async def _body(self) -> bytes:
        if self.h11.they_are_waiting_for_100_continue:
            await self._write(h11.InformationalResponse(status_code=100, headers=[]))
        chunks, size = [], 0
        while True:
            event = await self._event()
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > self.max_body:
                    raise _BodyTooLarge
                chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            else:   # the client went away mid-body
                raise _Closed

    async def _run_app(self, req: h11.Request, body: bytes) -> bool:
        """Run the app for one request; False when the connection must close."""
        path, _, query = req.target.partition(b"?")
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": req.http_version.decode(), "method": req.method.decode(), "scheme": "http",
            "path": unquote(path.decode("latin-1")), "raw_path": path, "query_string": query,
            "root_path": "", "headers": list(req.headers), "client": self.client, "server": self.server,
        }
        done = trio.Event()
        delivered = False
        head: h11.Response | None = None
        hold = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal head, hold
            kind = message["type"]
            try:
                if kind == "http.response.start":
                    if head is not None or self.h11.our_state is not h11.SEND_RESPONSE:
                        raise RuntimeError("ASGI app started its response twice")
                    head = h11.Response(status_code=message["status"], headers=message.get("headers", []))
                    hold = any(k.lower() == b"content-length" for k, _ in head.headers)
                    if not hold:
                        await self._write(head)
                elif kind == "http.response.body":
                    if head is None or done.is_set():
                        raise RuntimeError("ASGI app sent a body outside a response")
                    events: list[Any] = [head] if hold else []
                    hold = False
                    if message.get("body"):
                        events.append(h11.Data(data=message["body"]))
                    if not message.get("more_body", False):
                        events.append(h11.EndOfMessage())
                        done.set()
                    if events:
                        await self._write(*events)
                else:
                    raise RuntimeError(f"ASGI message {kind!r} is not part of an HTTP response")
            except _Closed:
                done.set()
                raise OSError("the client closed the connection") from None

        try:
            await self.app(scope, receive, send)
        except OSError:
            return False   # the client left mid-response
        except Exception as e:
            log.exception("gateway: the app failed on %s %s", scope["method"], scope["path"])
            if head is None:
                await self._error(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
            return False
        finally:
            done.set()
        if self.h11.our_state is h11.SEND_RESPONSE:   # the app returned without answering
            await self._error(500, "internal error: the app sent no response", type="server_error")
            return False
        return self.h11.our_state is h11.DONE


class _BodyTooLarge(Exception):
    pass


async def serve_asgi(app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *, max_body: int = 64 * 1024 * 1024,
                     keep_alive_s: float = 75.0,
                     task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` over HTTP/1.1 until cancelled; reports ``http://host:port`` once it
    listens (port 0: a free port). Cancelling it closes the listener and every connection."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound_port = listeners[0].socket.getsockname()[1]

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                await _Connection(stream, app, max_body, keep_alive_s).serve()
            except Exception:   # one connection's failure must not stop the server
                log.exception("gateway: a connection failed")

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(f"http://{host}:{bound_port}")
