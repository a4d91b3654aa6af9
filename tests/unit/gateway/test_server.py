"""The lean HTTP/1.1 server (``actors.gateway._server``) over real loopback sockets:
bad HTTP and oversized requests get JSON errors, a failing app costs one request, not
the server, and keep-alive, 100-continue and chunked bodies work."""
from __future__ import annotations

import json

import pytest
import trio

from actors.gateway._server import serve_asgi


async def echo_app(scope, receive, send) -> None:
    """Echoes the request; ``/boom`` fails before answering, ``/half`` after starting a stream."""
    msg = await receive()
    if scope["path"] == "/boom":
        raise ValueError("the app broke")
    if scope["path"] == "/half":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        raise ValueError("broke mid-stream")
    body = json.dumps({"method": scope["method"], "path": scope["path"], "query": scope["query_string"].decode(),
                       "body": msg["body"].decode()}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def address(nursery):
    url = await nursery.start(lambda task_status: serve_asgi(echo_app, max_body=1000, task_status=task_status))
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def _exchange(addr, *requests: bytes) -> list[tuple[int, dict, bytes]]:
    """Send raw requests on one connection; the responses read back (status, headers, body)."""
    stream = await trio.open_tcp_stream(*addr)
    buf = b""
    out = []
    async with stream:
        for raw in requests:
            await stream.send_all(raw)
            while True:
                head, sep, rest = buf.partition(b"\r\n\r\n")
                if sep:
                    lines = head.decode().split("\r\n")
                    status = int(lines[0].split()[1])
                    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
                    if status == 100:
                        buf = rest
                        continue
                    n = int(headers.get("content-length", -1))
                    if n >= 0 and len(rest) >= n:
                        out.append((status, headers, rest[:n]))
                        buf = rest[n:]
                        break
                chunk = await stream.receive_some(65536)
                if not chunk:
                    out.append((0, {}, buf))   # closed by the server
                    return out
                buf += chunk
    return out


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def test_keep_alive_query_and_percent_decoded_path(address) -> None:
    (s1, _, b1), (s2, _, b2) = await _exchange(address, _post("/s/a%20b/v1?x=1", b"hello"),
                                               _post("/two", b"again"))
    assert (s1, s2) == (200, 200)
    assert json.loads(b1) == {"method": "POST", "path": "/s/a b/v1", "query": "x=1", "body": "hello"}
    assert json.loads(b2)["body"] == "again"


async def test_chunked_body_and_100_continue(address) -> None:
    chunked = (b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n"
               b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    [(status, _, body)] = await _exchange(address, chunked)
    assert status == 200 and json.loads(body)["body"] == "abcde"


@pytest.mark.parametrize("raw, status", [
    (b"THIS IS NOT HTTP\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n", 400),
    (_post("/big", b"x" * 1001), 413),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"y" * 70_000 + b"\r\n\r\n", 431),
])
async def test_bad_requests_get_json_errors_and_the_server_goes_on(address, raw, status) -> None:
    [(got, headers, body)] = await _exchange(address, raw)
    assert got == status and headers["connection"] == "close"
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    [(ok, _, _)] = await _exchange(address, _post("/fine", b"{}"))
    assert ok == 200


async def test_a_failing_app_costs_one_request(address) -> None:
    [(status, _, body)] = await _exchange(address, _post("/boom", b""))
    assert status == 500 and "ValueError: the app broke" in json.loads(body)["error"]["message"]
    # A stream that breaks after its head: the connection is closed, the body cut short.
    [(status, _, rest)] = await _exchange(address, _post("/half", b""))
    assert status == 0 and rest.startswith(b"HTTP/1.1 200") and not rest.endswith(b"0\r\n\r\n")
    [(ok, _, _)] = await _exchange(address, _post("/fine", b"{}"))
    assert ok == 200


async def test_a_client_leaving_mid_request_does_not_stop_the_server(address) -> None:
    stream = await trio.open_tcp_stream(*address)
    await stream.send_all(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly part")
    await stream.aclose()
    [(ok, _, _)] = await _exchange(address, _post("/fine", b"{}"))
    assert ok == 200


async def test_an_idle_connection_is_closed_after_keep_alive(nursery) -> None:
    url = await nursery.start(lambda task_status: serve_asgi(echo_app, keep_alive_s=0.2, task_status=task_status))
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(_post("/one", b"x"))
        first = await stream.receive_some(65536)
        assert first.startswith(b"HTTP/1.1 200")
        with trio.fail_after(5):   # the server closes it: end of stream, no bytes
            assert await stream.receive_some(65536) == b""
