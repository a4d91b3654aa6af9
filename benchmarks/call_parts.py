"""What parts of the caller's work cost a call's round trip: variants in the same processes.

What: the round trip of ``call_one`` on an echo actor with parts of the caller's work taken
out, each as a ratio to a bare pyzmq echo's round trip (``benchmarks/actor_calls.py``'s floor)
measured in the same rounds, and as a difference from the shipped code's ratio in the same
pair of processes. Variants (the caller patches its own code between blocks; the actor is
the same throughout):

- ``shipped``: the runtime as it is;
- ``shipped_again``: the same code again, a control: how far two copies of one variant read
  apart here (the method's noise);
- ``no_header_work``: the request header written as a dict, without ``EndpointRef._header``'s
  plain-value check and trace lookup (valid for the plain calls made here only);
- ``no_schedule_point``: a spinning wait checks cancellation but does not yield to trio's
  scheduler (``Pending.wait`` run with ``checkpoint_if_cancelled`` for ``checkpoint``);
- ``first_point_only``: a spinning wait takes its schedule point when it starts spinning and
  no other (``CHECKPOINT_S`` in ``_conn`` set to ten times ``SPIN_S``);
- ``conn_request``: the caller's layers below ``EndpointRef``: ``Connection.request``,
  ``Pending.wait`` and ``reply_value`` on the same connection, with the header a dict
  written in place;
- ``trio_json``: no runtime on the caller's side at all: a trio task writes the same JSON
  header on a DEALER of its own to the same actor, waits as the runtime does (yield, poll
  ``ZMQ_EVENTS``, a trio checkpoint at the start and at least every ``CHECKPOINT_S``) and
  reads the reply with ``recv`` and ``loads``. What is left over the bare echo is the
  actor's side and the JSON both ways.

These are not ways to run: each takes out work a call has to do (see
``benchmarks/records/2026-12-07-call-caller-side.md``). They say what that work costs.

Why this design: whole runs of two commits separate ~0.03 only over many runs, since round
trips here are bimodal and the mix of modes drifts over seconds. Here the variants share one
pair of processes, in blocks of 200 calls in a fresh random order each round (a block's
predecessor changes its caches).

How: ``python benchmarks/call_parts.py [--quick]`` (full: 8 pairs of 25 rounds, about 80 s
here; quick: 3 pairs of 10, a smoke run in which the control alone moves by
hundredths). This process runs on core 0 and both servers on core 1 where the machine
has two cores. The last line is one JSON object: per variant the median over the pairs of
its ratio (``<variant>_over_bare``), and of its difference from ``shipped`` in the same pair
(``<variant>_minus_shipped``) with the number of pairs where it was lower
(``<variant>_lower_pairs``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import trio
import zmq
from actor_calls import BLOCK, EchoActor, _BareEcho, _pct, _pinned

from orchestrator.runtime import _calls, _conn, open_mesh
from orchestrator.runtime._wire import dumps, loads
from orchestrator.runtime._zsock import CHECKPOINT_S, SPIN_S, context, tune

VARIANTS = [
    "shipped",
    "shipped_again",
    "no_header_work",
    "no_schedule_point",
    "conn_request",
    "trio_json",
    "first_point_only",
]
_SHIPPED_HEADER = _calls.EndpointRef._header


def _plain_header(
    self: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[dict[str, Any], list[Any]]:
    return {"kind": kind, "endpoint": self._name, "args": list(args)}, []


class _Lowlevel:
    """``trio.lowlevel`` whose ``checkpoint`` checks cancellation only."""

    checkpoint = staticmethod(trio.lowlevel.checkpoint_if_cancelled)

    def __getattr__(self, name: str) -> Any:
        return getattr(trio.lowlevel, name)


class _TrioWithoutSchedulePoints:
    lowlevel = _Lowlevel()

    def __getattr__(self, name: str) -> Any:
        return getattr(trio, name)


def _use(variant: str) -> None:
    """Patch the caller's code for ``variant`` (every other patch undone)."""
    _calls.EndpointRef._header = _SHIPPED_HEADER  # type: ignore[method-assign]
    _conn.trio = trio  # type: ignore[attr-defined]
    _conn.CHECKPOINT_S = CHECKPOINT_S
    if variant == "no_header_work":
        _calls.EndpointRef._header = _plain_header  # type: ignore[method-assign,assignment]
    elif variant == "no_schedule_point":
        _conn.trio = _TrioWithoutSchedulePoints()  # type: ignore[attr-defined,assignment]
    elif variant == "first_point_only":
        _conn.CHECKPOINT_S = 10 * SPIN_S


async def _block(ep: Any, variant: str, dealer: Any) -> list[float]:
    """``BLOCK`` timed calls under ``variant`` (after one untimed)."""
    if variant == "conn_request":
        call = _conn_call(ep)
    elif variant == "trio_json":
        call = _json_call(dealer)
    else:
        call = ep.call_one
    _use(variant)
    try:
        await call(1)
        rtts = []
        for i in range(BLOCK):
            t = time.perf_counter()
            await call(i)
            rtts.append(time.perf_counter() - t)
        return rtts
    finally:
        _use("shipped")


def _conn_call(ep: Any) -> Any:
    conn = ep._src.connection_now(0)

    async def call(i: int) -> Any:
        p = conn.request({"kind": "call", "endpoint": "echo", "args": [i]}, [], reply=True, waits_next=True)
        await p.wait()
        return _conn.reply_value(p)

    return call


def _json_call(sock: Any) -> Any:
    events, pollin, noblock = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
    state = {"rtt": 0.0, "id": 0}

    async def call(i: int) -> Any:
        state["id"] += 1
        t0 = time.perf_counter()
        sock.send(dumps({"kind": "call", "endpoint": "echo", "args": [i], "id": state["id"]}), noblock)
        if state["rtt"] < 2 * SPIN_S:
            deadline, next_cp = t0 + SPIN_S, 0.0
            while (now := time.perf_counter()) < deadline:
                os.sched_yield()
                if sock.get(events) & pollin:
                    break
                if now >= next_cp:
                    await trio.lowlevel.checkpoint()
                    next_cp = time.perf_counter() + CHECKPOINT_S
        while True:  # parks when the reply did not come while spinning
            try:
                reply = loads(sock.recv(noblock))
                break
            except zmq.Again:
                await trio.lowlevel.wait_readable(sock.getsockopt(zmq.FD))
        state["rtt"] += 0.2 * (time.perf_counter() - t0 - state["rtt"])
        if reply["id"] != state["id"]:
            raise RuntimeError("trio_json: a reply to another request")
        return reply["value"]

    return call


async def _pair(rounds: int, pin: bool, shuffle: Any) -> dict[str, list[float]]:
    """One fresh actor and bare echo; per variant and for the bare echo, the round trips."""
    out: dict[str, list[float]] = {v: [] for v in [*VARIANTS, "bare"]}
    async with open_mesh(EchoActor, name="echo", env={"OMP_NUM_THREADS": "1"}) as mesh:
        ep = mesh[0].echo
        with tempfile.TemporaryDirectory(prefix="flotilla-bare-") as tmp:
            bare = _BareEcho(tmp)
            # The trio_json caller's own DEALER to the actor (the runtime's options and context).
            dealer = context().socket(zmq.DEALER)
            tune(dealer, tcp=False)
            dealer.connect(mesh.addresses[0])
            try:
                with _pinned(pin, [mesh.pids[0], bare.proc.pid]):
                    for _ in range(300):
                        await ep.call_one(1)
                        bare.call()
                    order = [*VARIANTS, "bare"]
                    for _ in range(rounds):
                        shuffle(order)  # a fixed order would give each variant the same predecessor
                        for name in order:
                            if name == "bare":
                                bare.call()
                                out[name] += [bare.call() for _ in range(BLOCK)]
                            else:
                                out[name] += await _block(ep, name, dealer)
            finally:
                bare.close()
                dealer.close(linger=0)
    return out


async def _run(quick: bool, pin: bool) -> dict[str, Any]:
    pin = pin and sys.platform == "linux" and {0, 1} <= os.sched_getaffinity(0)
    pairs, rounds = (3, 10) if quick else (8, 25)
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    shuffle = random.Random(0).shuffle
    for _ in range(pairs):
        rtts = await _pair(rounds, pin, shuffle)
        floor = _pct(rtts["bare"], 0.5)
        for v in VARIANTS:
            ratios[v].append(_pct(rtts[v], 0.5) / floor)
        print({v: round(ratios[v][-1], 3) for v in VARIANTS} | {"bare_p50_us": round(floor * 1e6, 1)}, flush=True)
    result: dict[str, Any] = {"pairs": pairs, "rounds": rounds, "block": BLOCK, "pinned": pin}
    for v in VARIANTS:
        result[f"{v}_over_bare"] = round(statistics.median(ratios[v]), 3)
        if v != "shipped":
            diffs = [a - b for a, b in zip(ratios[v], ratios["shipped"], strict=True)]
            result[f"{v}_minus_shipped"] = round(statistics.median(diffs), 3)
            result[f"{v}_lower_pairs"] = sum(d < 0 for d in diffs)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 pairs of 10 rounds (under a minute)")
    ap.add_argument("--no-pin", action="store_true", help="leave threads where the scheduler puts them")
    args = ap.parse_args()
    print(json.dumps(trio.run(_run, args.quick, not args.no_pin)))


if __name__ == "__main__":
    main()
