"""Wire format: tensors bit-exact (incl. 256 MB), malformed messages, no torch at import."""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import trio
import zmq
from pydantic import BaseModel, ConfigDict, PrivateAttr

from orchestrator.runtime import WireError, open_mesh
from orchestrator.runtime._wire import decode, dumps, encode, loads

from ._actors import Echo

torch.set_num_threads(1)

DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int32, torch.int64, torch.bool]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _random(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype in (torch.int32, torch.int64):
        return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=dtype)
    t = torch.randn(shape, generator=g) * 100
    return t.clamp(-448, 448).to(dtype)


def _roundtrip(value: Any) -> Any:
    frames: list[Any] = []
    tree = encode(value, frames)
    header = dumps({"v": tree})
    return decode(json.loads(header)["v"], [header, *[bytes(f) for f in frames]])


def test_headers_read_back_as_the_json_module_reads_them() -> None:
    """Whatever writes a header, the json module reads the same values from it, and a
    header the json module refuses is refused with its reason."""
    header = {
        "id": 2**70,
        "kind": "ok",
        "value": [float("nan"), float("inf"), -float("inf"), -0.0, 0.1 + 0.2, 5e-324, 1e300],
        "text": ["é中😀", "\x00\"\\", "\ud800 lone surrogate"],
        "tree": {"a": [None, True, False, {"b": []}]},
    }
    frame = dumps(header)
    assert repr(json.loads(frame)) == repr(header)
    assert repr(loads(frame)) == repr(header)
    for bad, reason in (
        (b"\xff{}", "can't decode byte"),
        (b'{"a":', "Expecting value"),
        (b'{"a":1}{', "Extra data"),
        (b"{'a':1}", "property name enclosed in double quotes"),
    ):
        with pytest.raises(WireError, match=reason):
            loads(bad)
    for not_an_object in (b"[1]", b'"x"', b"[" * 300 + b"]" * 300):
        with pytest.raises(WireError, match="must be a JSON object"):
            loads(not_an_object)


def test_encode_decode_in_process() -> None:
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        t = _random(dtype, (3, 5), g)
        back = _roundtrip({"t": t, "col": t[:, 1]})  # a non-contiguous view too
        assert back["t"].dtype == dtype and back["t"].shape == (3, 5)
        assert torch.equal(_bits(back["t"]), _bits(t))
        assert torch.equal(_bits(back["col"]), _bits(t[:, 1]))
    scalar = _roundtrip(torch.tensor(3.5))
    assert scalar.shape == () and scalar.item() == 3.5
    empty = _roundtrip(torch.zeros(0, 4, dtype=torch.int64))
    assert empty.shape == (0, 4) and empty.dtype == torch.int64
    back = _roundtrip(torch.arange(10))
    back += 1  # received tensors are writable
    assert back.tolist() == list(range(1, 11))
    # lazy views whose bytes are not their values arrive as their values
    z = torch.tensor([1 + 2j, 3 - 1j])
    assert torch.equal(_roundtrip(z.conj()), torch.tensor([1 - 2j, 3 + 1j]))
    assert torch.equal(_roundtrip(z.conj().imag), torch.tensor([-2.0, 1.0]))  # a negative view


class Plain(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    n: int = 3
    x: float | None = None
    _note: str = PrivateAttr(default="private")


class Color(enum.Enum):
    RED = "red"


class Mixed(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    color: Color
    ids: list[int]
    t: torch.Tensor
    inner: Plain


def test_models_travel_as_their_declared_fields() -> None:
    """Plain-valued models go as their instance dict; extra fields and private attributes
    stay behind (as for every model); other fields are encoded one by one."""
    p = Plain(name="a", x=1.5, extra_one=7)
    p._note = "changed"
    tree = encode(p, [])
    assert tree["v"] == {"name": "a", "n": 3, "x": 1.5}
    back = _roundtrip(p)
    assert type(back) is Plain and back == Plain(name="a", x=1.5) and back._note == "private"
    m = Mixed(color=Color.RED, ids=[1, 2], t=torch.arange(4), inner=Plain(name="b"))
    back = _roundtrip(m)
    assert back.color is Color.RED and back.ids == [1, 2] and back.inner == Plain(name="b")
    assert torch.equal(back.t, torch.arange(4))
    # fields that do not validate are refused on arrival, naming the model and the field
    path = f"{__name__}:Plain"
    with pytest.raises(WireError, match=r"invalid .*Plain.*\n.*name"):
        decode({"__t": "model", "c": path, "v": {"n": 1}}, [b"{}"])

    def local() -> type[BaseModel]:
        class Hidden(BaseModel):  # not reachable by its path: arrives as a dict
            a: int

        return Hidden

    assert _roundtrip(local()(a=1)) == {"a": 1}


def test_encode_rejects_unsupported_values_naming_the_position() -> None:
    with pytest.raises(TypeError, match=r"value\['x'\]\[1\]: cannot send a value of type"):
        encode({"x": [1, object()]}, [])
    with pytest.raises(TypeError, match="only dense tensors"):
        encode(torch.eye(3).to_sparse(), [])


@pytest.mark.parametrize(
    "tree, frames, match",
    [
        ({"__t": "bytes", "f": 1, "n": 10**15}, [b"abc"], "declared"),
        ({"__t": "bytes", "f": 5, "n": 3}, [b"abc"], "out of range"),
        ({"__t": "tensor", "d": "float32", "s": [10**6, 10**6], "f": 1, "n": 4}, [b"abcd"], "needs"),
        ({"__t": "tensor", "d": "object", "s": [1], "f": 1, "n": 8}, [b"12345678"], "dtype"),
        ({"__t": "tensor", "d": "int64", "s": [-1], "f": 1, "n": 8}, [b"12345678"], "shape"),
        ([{"__t": "bytes", "f": 1, "n": 3}, {"__t": "bytes", "f": 1, "n": 3}], [b"abc"], "twice"),
        ([1, 2], [b"unreferenced"], "references 0"),
        ({"__t": "model", "c": "os:system", "v": {}}, [], None),
        ({"__t": "handle", "v": {"kind": "nope"}}, [], "handle"),
        ({"__t": "eval", "v": "1+1"}, [], "unknown tag"),
    ],
)
def test_decode_rejects_inconsistent_messages(tree: Any, frames: list[bytes], match: str | None) -> None:
    if match is None:  # a class path naming a non-model is not resolved: fields arrive as a dict
        assert decode(tree, [b"{}", *frames]) == {}
        return
    with pytest.raises(WireError, match=match):
        decode(tree, [b"{}", *frames])


async def test_tensors_round_trip_bit_exact_through_an_actor() -> None:
    g = torch.Generator().manual_seed(1)
    with trio.fail_after(60):
        async with open_mesh(Echo) as mesh:
            batch = {str(d): _random(d, (7, 33), g) for d in DTYPES}
            batch["nan"] = torch.tensor([float("nan"), -0.0, float("inf")])
            back = await mesh[0].echo.call_one(batch)
            assert back.keys() == batch.keys()
            for k, t in batch.items():
                assert back[k].dtype == t.dtype and back[k].shape == t.shape, k
                assert torch.equal(_bits(back[k]), _bits(t)), k
            typed = await mesh[0].tensor.call_one(batch[str(torch.bfloat16)])
            assert torch.equal(_bits(typed), _bits(batch[str(torch.bfloat16)]))
            big = torch.arange(64 * 2**20, dtype=torch.int32)
            big[::4096] = torch.randint(0, 2**31 - 1, (big[::4096].numel(),), generator=g, dtype=torch.int32)
            assert big.numel() * 4 == 256 * 2**20
            back_big = await mesh[0].tensor.call_one(big.view(torch.float32))
            assert torch.equal(back_big.view(torch.int32), big)


@contextmanager
def raw_dealer(address: str) -> Iterator[zmq.Socket[Any]]:
    """A bare DEALER socket to an actor: messages go out exactly as built, no runtime."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()


async def _recv(sock: zmq.Socket[Any]) -> list[bytes]:
    while not sock.get(zmq.EVENTS) & zmq.POLLIN:
        await trio.lowlevel.wait_readable(sock.getsockopt(zmq.FD))
    return sock.recv_multipart(zmq.NOBLOCK)


async def test_malformed_messages_are_rejected_and_actor_keeps_serving() -> None:
    bad_messages = [
        ([b"not json at all"], None),
        ([b"[1, 2, 3]"], None),
        ([b""], None),
        ([b'{"id": 1, "kind": "call", "endpoint": "echo", "args": [{"__t": "bytes", "f": 1, "n": 5}]}'], 1),
        ([b'{"id": 2, "kind": "call", "endpoint": "echo", "args": [1]}', b"extra frame"], 2),
        (
            [
                (
                    b'{"id": 3, "kind": "call", "endpoint": "echo", "args": [{"__t": "tensor", "d": "float32", '
                    b'"s": [1000000000, 1000000], "f": 1, "n": 4000000000000000}]}'
                ),
                b"tiny",
            ],
            3,
        ),
        ([b'{"id": 4, "kind": "call", "endpoint": "no_such_endpoint", "args": []}'], 4),
        ([b'{"id": 5, "kind": "call", "endpoint": "echo", "args": "not a list"}'], 5),
        ([b'{"id": 6, "kind": "launch_missiles"}'], 6),
        ([b'{"id": "x", "kind": "call", "endpoint": "echo", "args": [1]}'], None),
        ([b'{"id": 7, "kind": "init", "args": [], "kwargs": {}}'], 7),  # a second init is refused
        ([b'{"id": 8, "kind": "call", "endpoint": "scale", "args": [[1.0]], "kwargs": {"bogus": 1}}'], 8),
    ]
    with trio.fail_after(30):
        async with open_mesh(Echo) as mesh:
            with raw_dealer(mesh.addresses[0]) as sock:
                for frames, rid in bad_messages:
                    sock.send_multipart(frames)
                    reply = await _recv(sock)
                    header = json.loads(reply[0])
                    assert header["kind"] == "bad", frames
                    assert header["id"] == rid, frames
                    assert header["message"]
                    assert await mesh[0].echo.call_one(42) == 42
                sock.send_multipart([b'{"id": 9, "kind": "cancel"}'])  # unknown cancel: ignored
                assert await mesh[0].scale.call_one([1.5]) == [3.0]


def test_importing_orchestrator_does_not_import_torch() -> None:
    runtime_only = (
        "import orchestrator.runtime, sys; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'opentelemetry' not in sys.modules, 'otel imported'"
    )
    package = "import orchestrator, sys; assert 'torch' not in sys.modules, 'torch imported'"
    for code in (runtime_only, package):
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_reader_spins_only_while_messages_come_back_to_back() -> None:
    """An actor's socket polls for the next request only when requests have been arriving
    within the spin window of each other; sparse traffic parks on the FD every time."""
    from orchestrator.runtime._zsock import SPIN_S, ZSocket

    if SPIN_S == 0:
        pytest.skip("spinning is off (FLOTILLA_SPIN_US=0)")
    ctx = zmq.Context.instance()
    addr = f"inproc://spin-test-{os.getpid()}"
    got: list[bytes] = []
    server = ZSocket(ctx.socket(zmq.PAIR), lambda frames: got.append(frames[0]), spin=True)
    server.sock.bind(addr)
    client = ctx.socket(zmq.PAIR)
    client.connect(addr)
    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                for i in range(10):  # 20 ms apart: far outside the window
                    client.send(b"%d" % i)
                    await trio.sleep(0.02)
                assert server.spins <= 1 and server.gap_ewma > 2 * SPIN_S
                for i in range(200):  # back to back
                    client.send(b"x")
                    while len(got) < 11 + i:
                        await trio.lowlevel.checkpoint()
                assert server.spins > 50
                nursery.cancel_scope.cancel()
    finally:
        client.close(linger=0)


async def test_a_spinning_reader_checkpoints_when_input_is_already_there() -> None:
    """Each spin wait is a trio checkpoint, even when the next message arrived before its
    first poll: a steady flood of requests must not starve the actor's other tasks. (A
    checkpoint is a cancellation point: under a cancelled scope the wait raises instead of
    returning.)"""
    from time import perf_counter

    from orchestrator.runtime._zsock import SPIN_S, ZSocket

    if SPIN_S == 0:
        pytest.skip("spinning is off (FLOTILLA_SPIN_US=0)")
    ctx = zmq.Context.instance()
    addr = f"inproc://spin-flood-test-{os.getpid()}"
    server = ZSocket(ctx.socket(zmq.PAIR), lambda frames: None, spin=True)
    server.sock.bind(addr)
    client = ctx.socket(zmq.PAIR)
    client.connect(addr)
    try:
        client.send(b"x")
        server._last = perf_counter() + 10  # a window that cannot close during the test
        with trio.CancelScope() as scope:
            scope.cancel()
            await server._spin_wait()
        assert scope.cancelled_caught
        assert await server._spin_wait() is True  # the message is still there to read
    finally:
        client.close(linger=0)
        server.close()


def test_a_send_that_a_spin_follows_yields_the_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeroMQ's I/O thread runs under SCHED_BATCH: a message leaves when the sending thread
    yields. A spinning socket yields right after its reply to a lone request, and once per
    drain within a burst; one whose requests come sparsely (it parks between them) does not;
    a caller that polls next (``check=False``) yields after its send; any other send does
    not."""
    from orchestrator.runtime import _zsock
    from orchestrator.runtime._zsock import ZSocket

    ctx = zmq.Context.instance()
    addr = f"inproc://yield-test-{os.getpid()}"
    yields: list[int] = []
    monkeypatch.setattr(_zsock.os, "sched_yield", lambda: yields.append(1))
    server = ZSocket(ctx.socket(zmq.PAIR), lambda frames: server.send([b"re:" + frames[0]]), spin=True)
    server.sock.bind(addr)
    replies: list[bytes] = []
    client = ZSocket(ctx.socket(zmq.PAIR), lambda frames: replies.append(frames[0]))
    client.sock.connect(addr)
    try:
        client.send([b"sparse"])
        assert yields == []  # an ordinary send
        server.poll()
        assert yields == []  # requests have been coming far apart: the reader parks next
        server.gap_ewma = 0.0  # ... and now back to back
        client.send([b"lone"])
        server.poll()
        assert len(yields) == 1
        for i in range(5):
            client.send([b"%d" % i])
        server.poll()
        assert len(yields) == 2  # five replies, one yield
        client.send([b"next"], check=False)
        assert len(yields) == 3
        client.poll()
        assert replies == [b"re:sparse", b"re:lone", *(b"re:%d" % i for i in range(5))]
    finally:
        client.close()
        server.close()


def test_marked_headers_say_whether_frames_follow_and_an_unmarked_peer_garbles_only_its_own() -> None:
    """Runtime sockets mark a header that more frames follow (``+``); a DEALER reads a
    header starting with ``{`` as a whole message without asking. A peer that sends
    more after such a header gets those frames read as messages of their own; the
    messages after them arrive intact. A ROUTER (many peers) never trusts a mark."""
    from orchestrator.runtime._zsock import ZSocket

    ctx = zmq.Context.instance()
    addr = f"inproc://marks-test-{os.getpid()}"
    router = ctx.socket(zmq.ROUTER)
    router.bind(addr)
    got: list[list[Any]] = []
    dealer = ZSocket(ctx.socket(zmq.DEALER), got.append, marked=True)
    dealer.sock.connect(addr)
    served: list[list[Any]] = []
    server = ZSocket(ctx.socket(zmq.ROUTER), served.append, copy_parts=2, marked=True)
    server.sock.bind(addr + "-server")
    raw = ctx.socket(zmq.DEALER)
    raw.connect(addr + "-server")
    try:
        dealer.send([b'{"id":1}', b"data"])  # marked on the way out
        ident, head, data = router.recv_multipart()
        assert (head, data) == (b'+{"id":1}', b"data")
        router.send_multipart([ident, b'+{"id":2}', b"payload"])
        router.send_multipart([ident, b'{"id":3}'])
        router.send_multipart([ident, b'{"id":4}', b"unmarked extra"])  # a peer that does not mark
        router.send_multipart([ident, b'{"id":5}'])
        deadline = time.monotonic() + 10
        while len(got) < 5 and time.monotonic() < deadline:
            dealer.poll()
        assert [[bytes(f) for f in m] for m in got] == [
            [b'{"id":2}', b"payload"],  # the mark is taken off; the frame follows
            [b'{"id":3}'],
            [b'{"id":4}'],
            [b"unmarked extra"],  # read as a message of its own (dropped as malformed upstream)
            [b'{"id":5}'],  # intact
        ]
        raw.send_multipart([b'{"id":6}', b"unmarked extra"])
        raw.send_multipart([b'+{"id":7}', b"x"])
        while len(served) < 2 and time.monotonic() < deadline:
            server.poll()
        assert [[bytes(f) for f in m[1:]] for m in served] == [[b'{"id":6}', b"unmarked extra"], [b'{"id":7}', b"x"]]
    finally:
        dealer.close()
        server.close()
        raw.close(linger=0)
        router.close(linger=0)
