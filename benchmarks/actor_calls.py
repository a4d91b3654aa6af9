"""Actor runtime benchmark: Flotilla's runtime next to Monarch and Ray, same echo actor.

What: round-trip time of a small ``call_one`` (p50, p99), throughput of 1,000
concurrent small calls, and the echo of a 16 MB and a 256 MB tensor (GB/s
counting both directions), on this runtime (ipc) and, when importable, on
Monarch (``torchmonarch``) and Ray (``pip install -e '.[bench]'``).

Why: every controller <-> actor interaction rides this path. Targets (issue 2):
``rtt_p50_us`` <= 150 and at least 5x below Monarch's; ``echo16_gbps`` >= 2.

The floor: a bare pyzmq echo (the runtime's DEALER/ROUTER sockets over ipc, one small
frame each way, both sides waiting with the runtime's spin-then-park policy, no header
encoding, dispatch or trio) runs in the same run: each pair of processes takes rounds of one
block of 200 round trips per echo (after 20 untimed ones, so that each server's spin has
caught up), in a fresh random order each round, so that drift over seconds and a block's
predecessor fall on every echo alike. Both round trips move with where the scheduler
puts each thread, which a process keeps for its life, so the round trips are taken over
several fresh pairs of processes (an actor and a bare echo each; 3 with ``--quick``, 7
without), with this process pinned to core 0 and both servers to core 1 where the machine
has two cores (``--no-pin``: wherever the scheduler puts them).
``rtt_over_bare_zmq`` is the median over the pairs of each pair's ``rtt_p50`` /
``bare_rtt_p50`` (issue 30: <= 1.3; every pair's ratio is in
``rtt_over_bare_zmq_pairs``): what the runtime adds to a round trip over what ZeroMQ
itself costs. ``rtt_p50_us`` and ``bare_zmq_rtt_p50_us`` pool the pairs' round trips.
A third echo in the same rounds, on the same sockets and spin policy, has both sides
build and read a small JSON header (the runtime's ``dumps`` and ``loads``) and nothing
else: ``json_over_bare_zmq`` (median over the pairs) is what reading and writing one
header in Python costs over the bare floor, a floor for any Python runtime's call;
``json_zmq_rtt_p50_us`` pools its round trips.

How: ``python benchmarks/actor_calls.py [--quick] [--no-peers] [--no-pin]``. Each peer runs in
its own subprocess (``--peer monarch|ray``) and is reported absent when it is
not installed or fails. The last line of output is one JSON object.

Waiting callers spin briefly before parking when replies come back fast
(``orchestrator/runtime/_conn.py``); ``rtt_caller_cpu_us`` is the caller's CPU
per round trip, and ``park_rtt_p50_us`` is the same loop with spinning off
(``FLOTILLA_SPIN_US=0``), measured in a subprocess of the same run.

Large frames between local processes travel through ``/dev/shm`` segments
(``orchestrator/runtime/_shm.py``); ``zmq_echo16_gbps`` / ``zmq_echo256_gbps`` are the
same echoes with that path off (``FLOTILLA_SHM=0``: every byte through ZeroMQ's ipc
sockets), measured in a subprocess of the same run. Each echo size is sent once untimed
first (``echo16_first_gbps``, ``echo256_first_gbps``: that transfer also allocates the
segments both sides then reuse). Issue 15's targets:
``echo256_gbps`` >= 2.0, ``echo16_gbps`` and ``rtt_p50_us`` no worse than before.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

import zmq

from orchestrator.runtime import Actor, endpoint

MB = 1 << 20


class EchoActor(Actor):
    """Returns what it is given (the same actor on every runtime)."""

    @endpoint
    async def echo(self, x: Any) -> Any:
        return x


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def _sizes(quick: bool) -> dict[str, int]:
    return {
        "rtt": 3000 if quick else 10000,
        "rtt_pairs": 3 if quick else 7,
        "conc_rounds": 3 if quick else 7,
        "echo16": 3 if quick else 7,
        "echo256": 1 if quick else 3,
    }


def _tensor(nbytes: int) -> Any:
    import torch

    return torch.ones(nbytes // 4, dtype=torch.float32)


# -- Flotilla ------------------------------------------------------------------------
def _pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of ``pid`` (ZeroMQ's I/O thread too) to ``cpus``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that just ended
            pass


@contextlib.contextmanager
def _pinned(pin: bool, servers: list[int | None]) -> Iterator[None]:
    """With ``pin``, this process on core 0 and the ``servers`` on core 1 while inside."""
    everywhere = os.sched_getaffinity(0)
    if pin:
        _pin(os.getpid(), {0})
        for pid in servers:
            assert pid is not None
            _pin(pid, {1})
    try:
        yield
    finally:
        if pin:
            _pin(os.getpid(), everywhere)


async def _timed_calls(ep: Any, count: int) -> tuple[list[float], float]:
    """``count`` echo calls one after another, each timed; and the caller's CPU seconds."""
    rtts = []
    c0 = time.process_time()
    for i in range(count):
        t = time.perf_counter()
        await ep.call_one(i)
        rtts.append(time.perf_counter() - t)
    return rtts, time.process_time() - c0


BLOCK = 200  # timed round trips of one echo in a row
WARM = 20  # untimed ones before each block: the server's spin follows its recent gaps (_zsock),
# and after the other echoes' blocks it parks until ~15 requests have come close together


async def _rtt_pair(
    n: dict[str, int], pin: bool, shuffle: Callable[[list[str]], None]
) -> tuple[list[float], list[float], list[float], float]:
    """One fresh actor process, bare echo and JSON echo, their blocks interleaved so all
    see the same machine: rounds of one block each, in a fresh random order each round (a
    fixed order would give each echo the same predecessor, which changes its caches). With
    ``pin``, this process runs on core 0 and both servers on core 1 (each process with its
    ZeroMQ I/O thread), so the ratio does not depend on where the scheduler happened to put
    each thread. Returns the call's round trips, the bare echo's, the JSON echo's, and the
    caller's CPU seconds over the calls."""
    from actor_calls import EchoActor as Echo  # importable by the actor process (it inherits our import path)

    from orchestrator.runtime import open_mesh

    cpu = 0.0
    async with open_mesh(Echo, name="echo", env={"OMP_NUM_THREADS": "1"}) as mesh:
        ep = mesh[0].echo
        await ep.call_one(0)
        with tempfile.TemporaryDirectory(prefix="flotilla-bare-") as tmp:
            bare, json_echo = _BareEcho(tmp), _BareEcho(tmp, parse=True)
            out: dict[str, list[float]] = {"call": [], "bare": [], "json": []}
            order = list(out)
            try:
                with _pinned(pin, [mesh.pids[0], bare.proc.pid, json_echo.proc.pid]):
                    for _ in range(200):
                        await ep.call_one(1)
                        bare.call()
                        json_echo.call()
                    for _ in range(max(1, n["rtt"] // BLOCK)):
                        shuffle(order)
                        for name in order:
                            if name == "call":
                                for _ in range(WARM):
                                    await ep.call_one(1)
                                r, c = await _timed_calls(ep, BLOCK)
                                out[name] += r
                                cpu += c
                            else:
                                echo = bare if name == "bare" else json_echo
                                for _ in range(WARM):
                                    echo.call()
                                out[name] += [echo.call() for _ in range(BLOCK)]
            finally:
                bare.close()
                json_echo.close()
    return out["call"], out["bare"], out["json"], cpu


async def _floor(n: dict[str, int], pin: bool) -> dict[str, Any]:
    """Round trips of a call and of the bare echo over ``n["rtt_pairs"]`` fresh pairs."""
    pin = pin and sys.platform == "linux" and {0, 1} <= os.sched_getaffinity(0)
    rtts: list[float] = []
    bare_rtts: list[float] = []
    json_rtts: list[float] = []
    ratios: list[float] = []
    json_ratios: list[float] = []
    cpu = 0.0
    shuffle = random.Random(0).shuffle
    for _ in range(n["rtt_pairs"]):
        r, b, j, c = await _rtt_pair(n, pin, shuffle)
        rtts += r
        bare_rtts += b
        json_rtts += j
        cpu += c
        ratios.append(_pct(r, 0.5) / _pct(b, 0.5))
        json_ratios.append(_pct(j, 0.5) / _pct(b, 0.5))
    return {
        # The caller's CPU per round trip: the price of spinning instead of parking.
        "rtt_caller_cpu_us": cpu / len(rtts) * 1e6,
        "rtt_p50_us": _pct(rtts, 0.5) * 1e6,
        "rtt_p99_us": _pct(rtts, 0.99) * 1e6,
        "bare_zmq_rtt_p50_us": _pct(bare_rtts, 0.5) * 1e6,
        "bare_zmq_rtt_p99_us": _pct(bare_rtts, 0.99) * 1e6,
        "rtt_over_bare_zmq": statistics.median(ratios),
        "rtt_over_bare_zmq_pairs": [round(x, 3) for x in ratios],
        "json_zmq_rtt_p50_us": _pct(json_rtts, 0.5) * 1e6,
        "json_over_bare_zmq": statistics.median(json_ratios),
        "rtt_pinned": pin,
    }


async def _flotilla(quick: bool, part: str = "all", pin: bool = True) -> dict[str, Any]:
    """``part``: ``all`` (round trips against the floor, then throughput and echoes),
    ``rtt`` (one actor's round trips and the caller's CPU only) or ``echo`` (throughput
    and echoes only)."""
    import trio
    from actor_calls import EchoActor as Echo  # importable by the actor process (it inherits our import path)

    from orchestrator.runtime import open_mesh

    n = _sizes(quick)
    out: dict[str, Any] = {}
    if part == "rtt":
        async with open_mesh(Echo, name="echo", env={"OMP_NUM_THREADS": "1"}) as mesh:
            ep = mesh[0].echo
            for _ in range(200):
                await ep.call_one(1)
            rtts, cpu = await _timed_calls(ep, n["rtt"])
        return {
            "rtt_caller_cpu_us": cpu / len(rtts) * 1e6,
            "rtt_p50_us": _pct(rtts, 0.5) * 1e6,
            "rtt_p99_us": _pct(rtts, 0.99) * 1e6,
        }
    if part == "all":
        out.update(await _floor(n, pin))

    async with open_mesh(Echo, name="echo", env={"OMP_NUM_THREADS": "1"}) as mesh:
        ep = mesh[0].echo
        for _ in range(200):
            await ep.call_one(1)

        async def one(i: int) -> None:
            assert await ep.call_one(i) == i

        rates = []
        for _ in range(n["conc_rounds"]):
            t = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(1000):
                    nursery.start_soon(one, i)
            rates.append(1000 / (time.perf_counter() - t))
        out["calls_per_s"] = statistics.median(rates)
        for key, size, reps in (("echo16_gbps", 16 * MB, n["echo16"]), ("echo256_gbps", 256 * MB, n["echo256"])):
            x = _tensor(size)
            await ep.call_one(x[:1024])  # the actor imports torch on its first tensor
            # The first transfer of a size also allocates its shared-memory segments on both
            # sides; it is reported apart, the figure is the steady state that reuses them.
            t = time.perf_counter()
            first = await ep.call_one(x)
            out[key.replace("_gbps", "_first_gbps")] = 2 * size / (time.perf_counter() - t) / 1e9
            del first
            speeds = []
            for _ in range(reps):
                t = time.perf_counter()
                back = await ep.call_one(x)
                speeds.append(2 * size / (time.perf_counter() - t) / 1e9)
                assert back.shape == x.shape
                del back
            out[key] = statistics.median(speeds)
            del x
    return out


# -- Bare pyzmq: the floor under a call ---------------------------------------------
# The runtime's sockets (DEALER caller, ROUTER actor, ipc://, orchestrator/runtime/_conn.py
# and _server.py, made by the runtime's context: its threads' scheduling policy, _zsock.py)
# with nothing above them: one small frame each way, no header encoding,
# no endpoint dispatch, no trio. Both sides wait as the runtime's do (orchestrator/runtime/
# _zsock.py): the caller polls for up to SPIN_S while its recent replies came back within
# 2 * SPIN_S, the echo polls for up to SPIN_S after a request while requests have been
# arriving within 2 * SPIN_S of each other; otherwise they block in the kernel.
_BARE_FRAME = b'{"id":12345,"ep":"echo","args":[12345],"kw":{}}'


_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # as the runtime reads them (_zsock)


def _pollin(sock: Any) -> bool:
    return bool(sock.get(_EVENTS) & _POLLIN)


def _bare_server(address: str, parse: bool = False) -> None:
    """The echo's side; ``parse``: read the request's JSON header and answer with a JSON
    header of its own (the runtime's ``loads`` and ``dumps``), as any Python runtime must."""
    import zmq

    from orchestrator.runtime._wire import dumps, loads
    from orchestrator.runtime._zsock import SPIN_S, context, tune

    sock = context().socket(zmq.ROUTER)
    tune(sock, tcp=False)
    sock.bind(address)
    print("ready", flush=True)
    last, gap = 0.0, 1.0
    while True:
        if gap < 2 * SPIN_S and SPIN_S > 0:
            deadline = last + SPIN_S
            while time.perf_counter() < deadline and not _pollin(sock):
                os.sched_yield()
        frames = sock.recv_multipart()  # blocks in the kernel when nothing came while spinning
        now = time.perf_counter()
        gap += 0.2 * (now - last - gap)
        last = now
        if frames[1] == b"stop":
            return
        if parse:
            header = loads(frames[1])
            frames[1] = dumps({"id": header["id"], "kind": "ok", "value": header["args"][0]})
        sock.send_multipart(frames, flags=zmq.NOBLOCK)


class _BareEcho:
    """The caller's side of the bare echo; the echo runs in its own process. ``parse``:
    both sides build and read a JSON header (``_bare_server``)."""

    def __init__(self, tmp: str, parse: bool = False) -> None:
        import zmq

        from orchestrator.runtime._zsock import context, tune

        self.parse = parse
        self.address = f"ipc://{tmp}/{'json' if parse else 'bare'}-echo"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--json-server" if parse else "--bare-server", self.address],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        self.sock = context().socket(zmq.DEALER)
        tune(self.sock, tcp=False)
        self.sock.connect(self.address)
        self.rtt_ewma = 0.0
        self.calls = 0

    def call(self) -> float:
        import zmq

        from orchestrator.runtime._wire import dumps, loads
        from orchestrator.runtime._zsock import SPIN_S

        t0 = time.perf_counter()
        if self.parse:
            self.calls += 1
            self.sock.send(
                dumps({"kind": "call", "endpoint": "echo", "args": [self.calls], "id": self.calls}), zmq.NOBLOCK
            )
        else:
            self.sock.send(_BARE_FRAME, zmq.NOBLOCK)
        if self.rtt_ewma < 2 * SPIN_S:
            deadline = t0 + SPIN_S
            while time.perf_counter() < deadline and not _pollin(self.sock):
                os.sched_yield()
        reply = self.sock.recv()
        if self.parse and loads(reply)["value"] != self.calls:
            raise RuntimeError("json echo: a reply to another request")
        dt = time.perf_counter() - t0
        self.rtt_ewma += 0.2 * (dt - self.rtt_ewma)
        return dt

    def close(self) -> None:
        import zmq

        self.sock.send(b"stop", zmq.NOBLOCK)
        self.proc.wait(timeout=10)
        self.sock.close(linger=0)


# -- Monarch -------------------------------------------------------------------------
def _monarch(quick: bool) -> dict[str, float]:
    from monarch.actor import Actor as MActor
    from monarch.actor import endpoint as mendpoint
    from monarch.actor import this_host

    class MonarchEcho(MActor):
        @mendpoint
        async def echo(self, x: Any) -> Any:
            return x

    n = _sizes(quick)

    async def run() -> dict[str, float]:
        procs = this_host().spawn_procs(per_host={"procs": 1})
        actor = procs.spawn("echo", MonarchEcho)
        try:
            for _ in range(50):
                await actor.echo.call_one(1)
            rtts = []
            for i in range(n["rtt"] // 5):
                t = time.perf_counter()
                await actor.echo.call_one(i)
                rtts.append(time.perf_counter() - t)
            x = _tensor(16 * MB)
            await actor.echo.call_one(x)
            speeds = []
            for _ in range(n["echo16"]):
                t = time.perf_counter()
                await actor.echo.call_one(x)
                speeds.append(2 * 16 * MB / (time.perf_counter() - t) / 1e9)
            return {
                "monarch_rtt_p50_us": _pct(rtts, 0.5) * 1e6,
                "monarch_rtt_p99_us": _pct(rtts, 0.99) * 1e6,
                "monarch_echo16_gbps": statistics.median(speeds),
            }
        finally:
            await procs.stop()

    return asyncio.run(run())


# -- Ray -----------------------------------------------------------------------------
def _ray(quick: bool) -> dict[str, float]:
    import ray

    n = _sizes(quick)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:

        @ray.remote
        class RayEcho:
            def echo(self, x: Any) -> Any:
                return x

        actor = RayEcho.remote()
        for _ in range(50):
            ray.get(actor.echo.remote(1))
        rtts = []
        for i in range(n["rtt"] // 5):
            t = time.perf_counter()
            ray.get(actor.echo.remote(i))
            rtts.append(time.perf_counter() - t)
        x = _tensor(16 * MB)
        ray.get(actor.echo.remote(x))
        speeds = []
        for _ in range(n["echo16"]):
            t = time.perf_counter()
            ray.get(actor.echo.remote(x))
            speeds.append(2 * 16 * MB / (time.perf_counter() - t) / 1e9)
        return {
            "ray_rtt_p50_us": _pct(rtts, 0.5) * 1e6,
            "ray_rtt_p99_us": _pct(rtts, 0.99) * 1e6,
            "ray_echo16_gbps": statistics.median(speeds),
        }
    finally:
        ray.shutdown()


def _run_peer(peer: str, quick: bool) -> dict[str, float]:
    """Run one peer in a subprocess so its runtime cannot disturb ours (or crash the run)."""
    cmd = [sys.executable, __file__, "--peer", peer] + (["--quick"] if quick else [])
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=25 if quick else 180,
            check=False,
            env={
                **os.environ,
                "RAY_DISABLE_USAGE_STATS": "1",
                **({"FLOTILLA_SHM": "0"} if peer == "zmq" else {"FLOTILLA_SPIN_US": "0"}),
            },
        )
    except subprocess.TimeoutExpired:
        print(f"{peer}: timed out, reported absent", file=sys.stderr)
        return {}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        print(f"{peer}: absent ({proc.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
        return {}
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    p.add_argument("--no-peers", action="store_true", help="measure only this runtime")
    p.add_argument(
        "--no-pin", action="store_true", help="leave the round trips' processes where the scheduler puts them"
    )
    p.add_argument("--peer", choices=["park", "zmq", "monarch", "ray"], help=argparse.SUPPRESS)
    p.add_argument("--bare-server", metavar="ADDRESS", help=argparse.SUPPRESS)
    p.add_argument("--json-server", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.bare_server or args.json_server:
        _bare_server(args.bare_server or args.json_server, parse=bool(args.json_server))
        return
    import torch

    torch.set_num_threads(1)
    import trio

    if args.peer == "park":  # this runtime with spinning off (FLOTILLA_SPIN_US=0)
        park = trio.run(_flotilla, args.quick, "rtt")
        print(json.dumps({f"park_{k}": v for k, v in park.items()}))
        return
    if args.peer == "zmq":  # this runtime with large frames through ZeroMQ, not /dev/shm
        zmq_only = trio.run(_flotilla, args.quick, "echo")
        print(json.dumps({f"zmq_{k}": v for k, v in zmq_only.items() if k.startswith("echo")}))
        return
    if args.peer:
        result = _monarch(args.quick) if args.peer == "monarch" else _ray(args.quick)
        print(json.dumps(result))
        return

    result: dict[str, Any] = trio.run(_flotilla, args.quick, "all", not args.no_pin)
    result.update(_run_peer("park", args.quick))
    result.update(_run_peer("zmq", args.quick))
    print(
        f"bare pyzmq echo (same sockets, transport and spin policy): p50 {result['bare_zmq_rtt_p50_us']:.0f} us, "
        f"p99 {result['bare_zmq_rtt_p99_us']:.0f} us; the call's p50 is {result['rtt_over_bare_zmq']:.2f}x that",
        file=sys.stderr,
    )
    print(
        f"flotilla: rtt p50 {result['rtt_p50_us']:.0f} us, p99 {result['rtt_p99_us']:.0f} us, "
        f"{result['calls_per_s']:.0f} calls/s, echo 16 MB {result['echo16_gbps']:.2f} GB/s, "
        f"256 MB {result['echo256_gbps']:.2f} GB/s (through ZeroMQ instead of /dev/shm: "
        f"{result.get('zmq_echo16_gbps', float('nan')):.2f}, "
        f"{result.get('zmq_echo256_gbps', float('nan')):.2f})",
        file=sys.stderr,
    )
    if not args.no_peers:
        for peer in ("monarch", "ray"):
            figures = _run_peer(peer, args.quick)
            if figures:
                print(f"{peer}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()), file=sys.stderr)
            result.update(figures)
    if "monarch_rtt_p50_us" in result:
        result["rtt_speedup_vs_monarch"] = result["monarch_rtt_p50_us"] / result["rtt_p50_us"]
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
