"""A lean HTTP/1.1 server for ASGI apps, on trio: the gateway's default server.

Why not only hypercorn: a gateway turn is one small request and one small JSON answer,
and between turns the process sleeps while the sampler computes, so every turn runs
its code with cold caches and pays for each layer it passes through. hypercorn's trio
worker (per-connection and per-request tasks, event queues, its own event classes
around h11) measured 0.45 ms per turn on this project's 2-core machine with a sampler
that answers at once, and about twice that after the sampler's usual wait. This server
does a turn's HTTP/1.1 work in one task per connection with a few regular expressions
and byte joins: no protocol objects per event. ``benchmarks/gateway.py`` runs both side
by side: 0.58-1.01 ms per turn p50 here (median 0.87) against hypercorn's 1.11-1.71 ms
in the same six runs, and 0.81/0.89 ms against 1.29/1.13 ms for this server's earlier h11-based
version (alternating full runs). hypercorn stays available (``server="hypercorn"``: a
server with a longer record).

What it does (RFC 9112):

* HTTP/1.1 and 1.0; keep-alive for 1.1 (until ``Connection: close``), one request
  per connection for 1.0; pipelined requests are answered in order; empty lines
  before a request line are skipped;
* request bodies framed by ``Content-Length`` or ``Transfer-Encoding: chunked``
  (trailers read and dropped); ``Expect: 100-continue`` is answered before the body
  is read;
* strict parsing, the request smuggling cases included: a malformed request line or
  header line (obs-fold, control bytes, space before the colon), a missing ``Host``
  in 1.1, ``Content-Length`` that is not one number, or both ``Transfer-Encoding`` and
  ``Content-Length`` get a 400; a transfer coding other than chunked a 501; heads over
  64 KiB a 431, bodies over ``max_body`` a 413 -- all as OpenAI error JSON, and the
  connection is closed (after reading what the client still sends, for a while, so
  that it gets the answer rather than a reset);
* ASGI 3.0, ``http`` scope, spec 2.4: the request body is delivered in one
  ``http.request`` message; later ``receive()`` calls wait until the response is done
  and then report ``http.disconnect``; ``send`` raises ``OSError`` once the client is
  gone;
* responses: a response that declares its ``content-length`` (every JSON answer) leaves
  in one socket write, head and body together -- one wake-up of the client per turn;
  it may not send more or fewer bytes than it declared. Others (streams) send their head
  at once and are chunked (1.1) or end with the connection (1.0). HEAD, 1xx, 204 and
  304 answers carry no body. Response headers are checked (no CR, LF or NUL in a
  value: no response splitting); the server writes the framing headers itself;
* idle connections are closed after ``keep_alive_s``; an app that fails gets a 500
  (when nothing of its answer was written) and the connection is closed; the server
  and the other connections go on.

Not here: HTTP/2, TLS, WebSockets, lifespan events (the gateway has no startup work), and
no early ``http.disconnect``: a request whose client left runs to its end (its sampler call
included) and its answer is dropped.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import trio

from actors.gateway._schemas import error_body

__all__ = ["serve_asgi"]

log = logging.getLogger(__name__)

ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]],
                   Awaitable[None]]

_MAX_HEAD = 64 * 1024
_READ = 64 * 1024
_LINGER_S = 1.0            # after an error answer: how long to read what the client still sends
_LINGER_BYTES = 1 << 20    # ... and how much of it

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_REQUEST_LINE = re.compile(rb"(%s) ([!-~]+) HTTP/(1\.[01])" % _TOKEN)
_FIELD = re.compile(rb"(%s):([ \t!-~\x80-\xff]*)" % _TOKEN)
_NAME = re.compile(_TOKEN)
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(?:;[ \t!-~\x80-\xff]*)?")
_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s" % (s.value, s.phrase.encode()) for s in HTTPStatus}


def _status_line(status: int) -> bytes:
    return _STATUS_LINES.get(status) or b"HTTP/1.1 %d " % status


class _Closed(Exception):
    """The client closed the connection, went idle, or left mid-request."""


class _Refused(Exception):
    """A request this server answers with an error status and a closed connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class _Request:
    """A request head, parsed and checked (``_Refused`` for what RFC 9112 forbids)."""

    __slots__ = ("chunked", "expect_100", "headers", "keep_alive", "length", "method", "target", "version")

    def __init__(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        m = _REQUEST_LINE.fullmatch(lines[0])
        if m is None:
            raise _Refused(400, f"malformed request line {lines[0][:120]!r}")
        self.method, self.target, self.version = m[1], m[2], m[3]
        self.headers: list[tuple[bytes, bytes]] = []
        te: list[bytes] = []
        cl: list[bytes] = []
        conn, host, expect = b"", False, b""
        for line in lines[1:]:
            f = _FIELD.fullmatch(line)
            if f is None:
                raise _Refused(400, f"malformed header line {line[:120]!r}")
            name, value = f[1].lower(), f[2].strip(b" \t")
            self.headers.append((name, value))
            if name == b"content-length":
                cl += value.split(b",")
            elif name == b"transfer-encoding":
                te.append(value)
            elif name == b"connection":
                conn += b"," + value.lower()
            elif name == b"host":
                host = True
            elif name == b"expect":
                expect = value.lower()
        http11 = self.version == b"1.1"
        if http11 and not host:
            raise _Refused(400, "missing Host header")
        self.keep_alive = http11 and b"close" not in (t.strip() for t in conn.split(b","))
        self.length, self.chunked = 0, False
        if te:
            if cl:
                raise _Refused(400, "both Transfer-Encoding and Content-Length")
            if not http11:
                raise _Refused(400, "Transfer-Encoding in an HTTP/1.0 request")
            if b",".join(te).lower() != b"chunked":
                raise _Refused(501, f"Transfer-Encoding {b', '.join(te).decode('latin-1')!r} is not "
                                    "supported (only chunked)")
            self.chunked = True
        elif cl:
            values = {v.strip() for v in cl}
            if len(values) != 1 or not (v := values.pop()).isdigit() or len(v) > 18:
                raise _Refused(400, f"bad Content-Length {b', '.join(cl).decode('latin-1')!r}")
            self.length = int(v)
        self.expect_100 = http11 and expect == b"100-continue"


class _Connection:
    """One client connection: requests one after another, each through the app."""

    def __init__(self, stream: trio.SocketStream, app: ASGIApp, max_body: int, keep_alive_s: float) -> None:
        self.stream, self.app = stream, app
        self.max_body, self.keep_alive_s = max_body, keep_alive_s
        self.buf = bytearray()
        sock = stream.socket
        self.server = tuple(sock.getsockname()[:2])
        self.client = tuple(sock.getpeername()[:2])

    # ------------------------------------------------------------------ reading
    async def _fill(self) -> None:
        """Read more bytes into the buffer; _Closed at the end of the stream or after
        ``keep_alive_s`` without a byte."""
        with trio.move_on_after(self.keep_alive_s):
            try:
                data = await self.stream.receive_some(_READ)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise _Closed from None
            if data:
                self.buf += data
                return
        raise _Closed

    async def _until(self, sep: bytes, limit: int, what: str) -> bytes:
        """The buffer up to ``sep`` (consumed with it); 431 past ``limit`` bytes."""
        start = 0
        while (end := self.buf.find(sep, start)) < 0:
            if len(self.buf) > limit:
                raise _Refused(431, f"{what} over {limit} bytes")
            start = max(0, len(self.buf) - len(sep) + 1)
            await self._fill()
        if end > limit:
            raise _Refused(431, f"{what} over {limit} bytes")
        out = bytes(self.buf[:end])
        del self.buf[:end + len(sep)]
        return out

    async def _request(self) -> _Request:
        while True:
            while self.buf[:2] == b"\r\n":   # empty lines before a request line
                del self.buf[:2]
            if self.buf:
                break
            await self._fill()
        return _Request(await self._until(b"\r\n\r\n", _MAX_HEAD, "request head"))

    async def _body(self, req: _Request) -> bytes:
        if req.length > self.max_body:
            raise _Refused(413, f"request body over {self.max_body} bytes")
        if req.expect_100 and not self.buf and (req.length or req.chunked):
            await self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if not req.chunked:
            while len(self.buf) < req.length:
                await self._fill()
            body = bytes(self.buf[:req.length])
            del self.buf[:req.length]
            return body
        body = bytearray()
        while True:
            line = await self._until(b"\r\n", 4096, "chunk size line")
            m = _CHUNK_SIZE.fullmatch(line)
            if m is None:
                raise _Refused(400, f"malformed chunk size line {line[:120]!r}")
            size = int(m[1], 16)
            if size == 0:
                break
            if len(body) + size > self.max_body:
                raise _Refused(413, f"request body over {self.max_body} bytes")
            while len(self.buf) < size + 2:
                await self._fill()
            if self.buf[size:size + 2] != b"\r\n":
                raise _Refused(400, "a chunk is not followed by CRLF")
            body += self.buf[:size]
            del self.buf[:size + 2]
        trailers = 0
        while line := await self._until(b"\r\n", _MAX_HEAD, "trailer line"):   # dropped
            trailers += len(line)
            if trailers > _MAX_HEAD:
                raise _Refused(431, f"trailers over {_MAX_HEAD} bytes")
        return bytes(body)

    # ------------------------------------------------------------------ writing
    async def _write(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise _Closed from None

    async def _refuse(self, status: int, message: str, *, type: str = "invalid_request_error") -> None:
        """Answer ``status`` with OpenAI error JSON, ``connection: close``."""
        body = json.dumps(error_body(message, type=type)).encode()
        await self._write(b"%s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                          b"connection: close\r\n\r\n%s" % (_status_line(status), len(body), body))

    async def _linger(self) -> None:
        """Half-close, then read and drop what the client still sends (a body we refused,
        pipelined requests) for a while: closing with unread bytes would reset the
        connection, and the client could lose the answer it has not read yet."""
        try:
            await self.stream.send_eof()
            with trio.move_on_after(_LINGER_S):
                seen = 0
                while seen < _LINGER_BYTES and (data := await self.stream.receive_some(_READ)):
                    seen += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    # ------------------------------------------------------------------ serving
    async def serve(self) -> None:
        try:
            while True:
                try:
                    req = await self._request()
                    body = await self._body(req)
                except _Refused as e:
                    await self._refuse(e.status, f"malformed HTTP request: {e.message}"
                                       if e.status == 400 else e.message)
                    await self._linger()
                    return
                if not await self._run_app(req, body):
                    return
        except _Closed:
            return

    async def _run_app(self, req: _Request, body: bytes) -> bool:
        """Run the app for one request; False when the connection must close."""
        path, _, query = req.target.partition(b"?")
        method = req.method.decode()
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": req.version.decode(), "method": method, "scheme": "http",
            "path": unquote(path.decode("latin-1")), "raw_path": path, "query_string": query,
            "root_path": "", "headers": req.headers, "client": self.client, "server": self.server,
        }
        done = trio.Event()
        delivered = started = wrote = chunked = finished = False
        keep_alive = req.keep_alive
        bodyless = method == "HEAD"
        held = b""                 # a head waiting for its body (responses with content-length)
        left: int | None = None    # bytes of the declared content-length not sent yet

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def write(data: bytes) -> None:
            nonlocal wrote
            wrote = True
            try:
                await self._write(data)
            except _Closed:
                done.set()
                raise OSError("the client closed the connection") from None

        async def send(message: dict[str, Any]) -> None:
            nonlocal started, chunked, keep_alive, bodyless, held, left, finished
            kind = message["type"]
            if kind == "http.response.start":
                if started:
                    raise RuntimeError("ASGI app started its response twice")
                status = message["status"]
                if not 100 <= status <= 999:
                    raise RuntimeError(f"ASGI app answered status {status!r}")
                lines = [_status_line(status)]
                length = None
                for name, value in message.get("headers", ()):
                    if _NAME.fullmatch(name) is None or _BAD_VALUE.search(value) is not None:
                        raise RuntimeError(f"ASGI app sent an invalid response header {name[:60]!r}")
                    low = name.lower()
                    if low == b"content-length":
                        if not value.isdigit():
                            raise RuntimeError(f"ASGI app sent content-length {value[:60]!r}")
                        length = int(value)
                    elif low == b"connection":
                        keep_alive = keep_alive and b"close" not in value.lower()
                    elif low != b"transfer-encoding":   # the server frames the body itself
                        lines.append(name + b": " + value)
                started = True
                bodyless = bodyless or status < 200 or status in (204, 304)
                if length is not None:
                    lines.append(b"content-length: %d" % length)
                    left = 0 if bodyless else length
                elif not bodyless:
                    if req.version == b"1.1":
                        chunked = True
                        lines.append(b"transfer-encoding: chunked")
                    else:
                        keep_alive = False   # the body ends with the connection
                if not keep_alive:
                    lines.append(b"connection: close")
                head = b"\r\n".join(lines) + b"\r\n\r\n"
                if left is None or bodyless:
                    await write(head)
                else:
                    held = head
            elif kind == "http.response.body":
                if not started or done.is_set():
                    raise RuntimeError("ASGI app sent a body outside a response")
                data = b"" if bodyless else message.get("body", b"")
                more = message.get("more_body", False)
                out, held = held, b""
                if left is not None:
                    if len(data) > left or (not more and len(data) < left):
                        raise RuntimeError("ASGI app's body does not match its content-length")
                    left -= len(data)
                    out += data
                elif chunked:
                    if data:
                        out += b"%x\r\n%s\r\n" % (len(data), data)
                    if not more:
                        out += b"0\r\n\r\n"
                else:
                    out += data
                if not more:
                    finished = True
                    done.set()
                if out:
                    await write(out)
            else:
                raise RuntimeError(f"ASGI message {kind!r} is not part of an HTTP response")

        try:
            await self.app(scope, receive, send)
        except OSError:
            return False   # the client left mid-response
        except Exception as e:
            log.exception("gateway: the app failed on %s %s", scope["method"], scope["path"])
            if not wrote:
                await self._refuse(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
            return False
        finally:
            done.set()
        if not started:
            await self._refuse(500, "internal error: the app sent no response", type="server_error")
            return False
        return keep_alive and finished   # not finished: it returned before the end of its body


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
