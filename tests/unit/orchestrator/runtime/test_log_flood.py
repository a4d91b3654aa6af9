"""A flood of malformed requests over real ZeroMQ sockets cannot flood the log.

10,000 bad requests from 20 peers (each its own ZeroMQ identity, as separate connections
of an attacker are), many carrying 100 kB values: every one is rejected and counted, the
actor keeps serving, and its stderr gets a few bounded lines, each with the count of the
rejections it stands for.
"""

from __future__ import annotations

import json
import re
import time

import trio
import zmq

from orchestrator.runtime import open_mesh
from orchestrator.runtime._zsock import REPEAT_S
from tests.unit.orchestrator.runtime._actors import Counter

N, PEERS = 10_000, 20
BIG = "v" * 100_000


def _bad(i: int) -> list[bytes]:
    kind = i % 4
    if kind == 0:
        return [json.dumps({"id": i, "kind": "call", "endpoint": "no_such_" + BIG, "args": []}).encode()]
    if kind == 1:
        return [b"{not json " + BIG[: 1000 + i % 5000].encode()]
    if kind == 2:
        return [json.dumps({"id": i, "kind": "call", "endpoint": "incr", "args": [BIG]}).encode()]
    return [json.dumps({"id": "x" * (i % 2000), "kind": "call"}).encode()]


async def test_ten_thousand_rejected_messages_give_a_few_bounded_lines(capfd) -> None:
    ctx = zmq.Context.instance()
    async with open_mesh(Counter, 0, procs=1, name="victim") as mesh:
        capfd.readouterr()  # start-up output is not the flood's
        socks = []
        for p in range(PEERS):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, f"rogue-{p}".encode())
            s.setsockopt(zmq.SNDHWM, 0)
            s.connect(mesh.addresses[0])
            socks.append(s)
        t0 = time.monotonic()
        try:
            socks[0].send_multipart(_bad(0))  # first alone: the line it gets holds a 100 kB value
            with trio.fail_after(30):
                while (await mesh[0].runtime_stats.call_one())["rejected_messages"] < 1:
                    await trio.sleep(0.02)
            for i in range(1, N):
                socks[i % PEERS].send_multipart(_bad(i))
                if i % 500 == 499:
                    await trio.lowlevel.checkpoint()
            with trio.fail_after(120):
                while (st := await mesh[0].runtime_stats.call_one())["rejected_messages"] < N:
                    await trio.sleep(0.1)
            elapsed = time.monotonic() - t0
            assert st["rejected_messages"] == N
            assert st["rejected_by_peer"] == {f"rogue-{p}".encode().hex(): N // PEERS for p in range(PEERS)}
            assert await mesh[0].incr.call_one(5) == 5  # the actor kept serving
        finally:
            for s in socks:
                s.close(linger=0)
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    rejected = [ln for ln in lines if "rejected a request from peer" in ln]
    # One line per REPEAT_S whichever the peer, plus the first.
    assert 1 <= len(rejected) <= 2 + elapsed / REPEAT_S, (len(rejected), elapsed)
    assert len(lines) <= len(rejected) + 2, lines[:5]  # nothing else repeats per message
    assert max(len(ln) for ln in lines) <= 500, max(len(ln) for ln in lines)
    assert "more)" in err  # the long values were cut, with a count of what was left out
    counted = sum(int(m) for m in re.findall(r"and (\d+) more like it", err))
    assert counted <= N - len(rejected)


def test_clip_bounds_an_outside_value_to_one_line_with_a_count() -> None:
    from orchestrator.runtime import clip

    assert clip("short") == "short"
    assert clip("a\nb\r\nc") == "a\\nb\\r\\nc"  # one line whatever the value holds
    long = clip("x" * 100_149)
    assert long == "x" * 300 + "... (99849 more)"
    assert clip(ValueError("y" * 50), 10) == "y" * 10 + "... (40 more)"
