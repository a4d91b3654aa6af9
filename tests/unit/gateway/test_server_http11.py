"""HTTP/1.1 conformance of the lean server (``actors.gateway._server``), black-box over
real loopback sockets: message framing and parsing on the request side (pipelining,
smuggling-prone headers, malformed heads and chunks: RFC 9112), connection management
(HTTP/1.0, ``Connection: close``), and what the server does with an app's response
(chunked streams, HEAD, no answer, a bad header, a body longer than declared).

These pin behaviour, not an implementation: they speak raw bytes and read the answer
with the small client below, which checks its framing (status line, chunk sizes).
``test_server.py`` holds the basic cases; these add to them."""
from __future__ import annotations

import json

import pytest
import trio

from actors.gateway._server import serve_asgi
from tests.unit.gateway.test_server import echo_app

MAX_BODY = 100
_OPEN: list[trio.SocketStream] = []   # client connections, closed after each test


async def app(scope, receive, send) -> None:
    """``echo_app``, plus paths whose answers exercise the response side."""
    path = scope["path"]

    async def start(*headers: tuple[bytes, bytes]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": list(headers)})

    async def body(data: bytes, more: bool = False) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": more})

    if path == "/stream":   # no content-length: chunked to 1.1 clients, close-delimited to 1.0
        await receive()
        await start((b"content-type", b"text/plain"))
        for part in (b"ab", b"cd", b""):
            await body(part, more=True)
        await body(b"ef")
    elif path == "/len":    # a declared body, sent also to HEAD (the server must drop it)
        await start((b"content-length", b"5"))
        await body(b"hello")
    elif path == "/silent":
        await receive()     # returns without answering
    elif path == "/split":  # response splitting attempt
        await start((b"x-a", b"1\r\nx-injected: yes"), (b"content-length", b"2"))
        await body(b"ok")
    elif path == "/long":   # more body than declared
        await start((b"content-length", b"3"))
        await body(b"ab", more=True)
        await body(b"cdef")
    else:
        await echo_app(scope, receive, send)


@pytest.fixture
async def addr(nursery):
    url = await nursery.start(lambda task_status: serve_asgi(app, max_body=MAX_BODY, task_status=task_status))
    host, port = url.removeprefix("http://").rsplit(":", 1)
    yield host, int(port)
    while _OPEN:
        await _OPEN.pop().aclose()


class _Client:
    """One raw connection: ``send`` bytes, read framed responses back (1xx skipped)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream, self.buf = stream, b""

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def _fill(self) -> bool:
        with trio.fail_after(5):
            try:
                data = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:   # a reset: the server closed with input unread
                data = b""
        self.buf += data
        return bool(data)

    async def read_until(self, sep: bytes) -> bytes | None:
        """The bytes before ``sep`` (consumed); None if the server closes first."""
        while sep not in self.buf:
            if not await self._fill():
                return None
        out, _, self.buf = self.buf.partition(sep)
        return out

    async def _take(self, n: int) -> bytes:
        """``n`` bytes, or fewer if the server closes first."""
        while len(self.buf) < n and await self._fill():
            pass
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    async def rest(self) -> bytes:
        """Everything until the server closes the connection."""
        while await self._fill():
            pass
        out, self.buf = self.buf, b""
        return out

    async def closes(self) -> bool:
        """True when the server closes the connection with nothing more sent."""
        return await self.rest() == b""

    async def response(self, *, head: bool = False) -> tuple[int, dict[str, str], bytes] | None:
        """(status, headers, body) of the next final response; None if closed before a head."""
        while True:
            raw = await self.read_until(b"\r\n\r\n")
            if raw is None:
                return None
            assert raw.startswith(b"HTTP/1."), f"not a status line: {raw[:60]!r}"
            lines = raw.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            if not 100 <= status < 200:
                break
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        if head or status in (204, 304):
            return status, headers, b""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            chunks = []
            while (size := int((await self.read_until(b"\r\n") or b"").split(b";")[0], 16)) > 0:
                chunks.append(await self._take(size))
                assert await self._take(2) == b"\r\n", "chunk data not followed by CRLF"
            while await self.read_until(b"\r\n"):   # trailers, up to the empty line
                pass
            return status, headers, b"".join(chunks)
        if "content-length" in headers:
            return status, headers, await self._take(int(headers["content-length"]))
        return status, headers, await self.rest()   # close-delimited


async def _connect(addr) -> _Client:
    _OPEN.append(stream := await trio.open_tcp_stream(*addr))
    return _Client(stream)


async def _one(addr, raw: bytes, *, head: bool = False):
    c = await _connect(addr)
    await c.send(raw)
    return c, await c.response(head=head)


async def _assert_still_serving(addr) -> None:
    _, r = await _one(addr, b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
    assert r is not None and r[0] == 200 and json.loads(r[2])["path"] == "/ok"


def _post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n".encode() + extra + b"\r\n" + body


# -- request side ---------------------------------------------------------------------------

async def test_pipelined_requests_in_one_write_are_answered_in_order(addr) -> None:
    c = await _connect(addr)
    await c.send(_post("/first", b"1") + b"GET /second?q=2 HTTP/1.1\r\nHost: x\r\n\r\n")
    r1, r2 = await c.response(), await c.response()
    assert json.loads(r1[2]) == {"method": "POST", "path": "/first", "query": "", "body": "1"}
    assert json.loads(r2[2]) == {"method": "GET", "path": "/second", "query": "q=2", "body": ""}


async def test_empty_lines_before_the_request_line_are_ignored(addr) -> None:
    _, r = await _one(addr, b"\r\n\r\nGET /after-blank HTTP/1.1\r\nHost: x\r\n\r\n")
    assert r is not None and r[0] == 200 and json.loads(r[2])["path"] == "/after-blank"


_CHUNKED = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("raw, status", [
    pytest.param(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 8\r\n\r\n"
                 b"3\r\nabc\r\n0\r\n\r\n", 400, id="te-and-cl"),
    pytest.param(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501, id="te-gzip"),
    pytest.param(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
                 400, id="two-content-lengths"),
    pytest.param(b"GET / HTTP/1.1\r\n\r\n", 400, id="no-host"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n folded\r\n\r\n", 400, id="obs-fold"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n\r\n", 400, id="ctl-in-value"),
    pytest.param(b"GET / HTTP/1.1\r\nHost : x\r\n\r\n", 400, id="space-before-colon"),
    pytest.param(_CHUNKED + b"zz\r\nabc\r\n0\r\n\r\n", 400, id="bad-chunk-size"),
    pytest.param(_CHUNKED + b"50\r\n" + b"a" * 80 + b"\r\n50\r\n" + b"b" * 80 + b"\r\n0\r\n\r\n", 413,
                 id="chunked-over-max-body"),
    pytest.param(b"G\x01T / HTTP/1.1\r\nHost: x\r\n\r\n", 400, id="ctl-in-method"),
    pytest.param(b"GET /a b HTTP/1.1\r\nHost: x\r\n\r\n", 400, id="space-in-target"),
])
async def test_bad_framing_and_syntax_get_an_error_and_a_close(addr, raw, status) -> None:
    c, r = await _one(addr, raw)
    assert r is not None, f"closed without an answer (expected {status})"
    got, headers, body = r
    assert got == status and headers.get("connection") == "close"
    assert json.loads(body)["error"]["message"]
    assert await c.closes()
    await _assert_still_serving(addr)


async def test_expect_100_continue_is_answered_before_the_body_is_sent(addr) -> None:
    c = await _connect(addr)
    await c.send(b"POST /wait HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    interim = await c.read_until(b"\r\n\r\n")
    assert interim is not None and interim.startswith(b"HTTP/1.1 100")
    await c.send(b"hello")
    r = await c.response()
    assert r[0] == 200 and json.loads(r[2])["body"] == "hello"


async def test_a_head_trickling_in_byte_by_byte_is_served(addr) -> None:
    raw = _post("/slow", b"trickle")
    c = await _connect(addr)
    for i in range(40):
        await c.send(raw[i:i + 1])
        await trio.lowlevel.checkpoint()   # let the server read each piece on its own
    await c.send(raw[40:])
    r = await c.response()
    assert r[0] == 200 and json.loads(r[2])["body"] == "trickle"


# -- connection management ------------------------------------------------------------------

async def test_http10_request_is_answered_then_closed(addr) -> None:
    c, r = await _one(addr, b"GET /ten HTTP/1.0\r\n\r\n")
    assert r[0] == 200 and json.loads(r[2])["path"] == "/ten"
    assert await c.closes()


async def test_connection_close_is_echoed_and_honoured(addr) -> None:
    c, r = await _one(addr, b"GET /bye HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert r[0] == 200 and r[1].get("connection", "").lower() == "close"
    assert await c.closes()


# -- response side --------------------------------------------------------------------------

async def test_a_stream_is_chunked_to_http11_and_the_connection_goes_on(addr) -> None:
    c, r = await _one(addr, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = r
    assert status == 200 and headers.get("transfer-encoding", "").lower() == "chunked"
    assert "content-length" not in headers and body == b"abcdef"
    await c.send(_post("/next", b"n"))
    r2 = await c.response()
    assert r2[0] == 200 and json.loads(r2[2])["path"] == "/next"


async def test_a_stream_to_http10_is_unframed_and_ended_by_close(addr) -> None:
    _, r = await _one(addr, b"GET /stream HTTP/1.0\r\n\r\n")
    status, headers, body = r   # read to the close: the server ended the body by closing
    assert status == 200 and "transfer-encoding" not in headers and "content-length" not in headers
    assert body == b"abcdef"


async def test_head_gets_the_headers_and_no_body(addr) -> None:
    c, r = await _one(addr, b"HEAD /len HTTP/1.1\r\nHost: x\r\n\r\n", head=True)
    assert r is not None, "HEAD got no answer"
    assert r[0] == 200 and r[1].get("content-length") == "5"
    await c.send(b"GET /after-head HTTP/1.1\r\nHost: x\r\n\r\n")
    r2 = await c.response()   # stray body bytes would stand before this status line
    assert r2[0] == 200 and json.loads(r2[2])["path"] == "/after-head"


async def test_an_app_that_never_answers_gets_a_500(addr) -> None:
    _, r = await _one(addr, b"GET /silent HTTP/1.1\r\nHost: x\r\n\r\n")
    assert r[0] == 500 and json.loads(r[2])["error"]["message"]
    await _assert_still_serving(addr)


async def test_crlf_in_a_response_header_does_not_split_the_response(addr) -> None:
    c, r = await _one(addr, b"GET /split HTTP/1.1\r\nHost: x\r\n\r\n")
    if r is None:   # closed without a complete head: nothing injected in what came
        assert b"x-injected" not in c.buf.lower()
    else:
        assert r[0] == 500 and "x-injected" not in r[1]
    await _assert_still_serving(addr)


async def test_a_body_longer_than_its_content_length_is_cut_and_closed(addr) -> None:
    c, r = await _one(addr, b"GET /long HTTP/1.1\r\nHost: x\r\n\r\n")
    if r is not None and r[0] != 500:
        assert r[0] == 200 and len(r[2]) <= 3
        assert await c.closes(), "bytes beyond content-length, or the connection left open"
    await _assert_still_serving(addr)
