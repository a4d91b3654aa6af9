"""Entry point of an actor process: ``python -m orchestrator.runtime._child --cls mod:Cls ...``.

Lifecycle: bind, report the bound address on ``--ready-fd``, serve until
SIGTERM/SIGINT or until the spawning process exits (then ``on_stop`` runs), so no actor
outlives its spawner.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import threading
from typing import Any

import trio
import zmq

from . import _actor
from ._curve import TRUST_SELF_ENV, Curve, start_authenticator
from ._server import Server
from ._zsock import context, tune

__all__ = ["GC_GEN0", "main"]

GC_GEN0 = 50_000
"""Allocations between two young-generation collections in an actor process (default 700).

An actor allocates a few objects per token and per message, most short-lived; at the
default, the cyclic collector ran thousands of young and dozens of full collections a
minute in the demo's env actor (12% of its CPU, full passes of 100-150 ms over the
episodes it holds). Objects alive once the actor is constructed (modules, model,
tokenizer) are frozen out of collection (``gc.freeze``).
"""


async def _stop_with_parent(parent_pid: int, scope: trio.CancelScope) -> None:
    """Stop when the spawning process exits (a pidfd: no polling).

    PR_SET_PDEATHSIG is not used: it fires when the spawning *thread* exits,
    and trio spawns processes from worker threads that come and go.
    """
    try:
        fd = os.pidfd_open(parent_pid)
    except (OSError, AttributeError):
        return  # no pidfd support: rely on the owner's SIGTERM/SIGKILL
    try:
        if os.getppid() != parent_pid:
            scope.cancel()  # the parent died before we started watching
            return
        await trio.lowlevel.wait_readable(fd)
        scope.cancel()
    finally:
        trio.lowlevel.notify_closing(fd)
        os.close(fd)


async def _serve(cls: Any, args: argparse.Namespace) -> None:
    ctx = context()
    curve = Curve.from_env()
    trust_self = os.environ.get(TRUST_SELF_ENV, "1") != "0"
    auth = (
        start_authenticator(ctx, curve, trust_self=trust_self)
        if curve is not None and args.bind.startswith("tcp://")
        else None
    )
    sock = ctx.socket(zmq.ROUTER)
    try:
        tune(sock, tcp=args.bind.startswith("tcp://"))
        if auth is not None and curve is not None:
            curve.serve(sock)
        sock.bind(args.bind)
        address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if args.advertise:
            port = address.rsplit(":", 1)[1]
            address = f"tcp://{args.advertise}:{port}"
        server = Server(cls, sock, name=args.name, rank=args.rank, local=args.bind.startswith("ipc://"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, nursery.cancel_scope, server)
            if args.parent_pid is not None:
                nursery.start_soon(_stop_with_parent, args.parent_pid, nursery.cancel_scope)
            await nursery.start(server.serve)
            nursery.start_soon(_freeze_when_ready, server)
            if args.autostart:
                await server.autostart()
            if args.ready_fd is not None:
                os.write(args.ready_fd, (address + "\n").encode())
                os.close(args.ready_fd)
            else:
                print(f"listening on {address}", flush=True)
    finally:
        sock.close(linger=0)  # no-op once the server closed it (with its own linger)
        if auth is not None:
            auth.stop()


async def _freeze_when_ready(server: Server) -> None:
    """Once the actor is constructed, what start-up made is never collected again."""
    await server.ready.wait()
    gc.collect()
    gc.freeze()


DRAIN_S = 30.0
"""Longest an actor's ``on_signal`` (its drain) may take before the process stops anyway."""
DRAIN_FLUSH_MS = 2000
"""Longest the socket of a drained actor waits at close for its last replies to leave."""


def unsent_tcp_bytes() -> int | None:
    """Bytes this process's TCP connections hold that the peer has not acknowledged (the
    `tx_queue` of /proc/net/tcp and tcp6); None where that cannot be read (not Linux)."""
    try:
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        total = 0
        for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
            with open(table) as f:
                next(f)  # the header
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[9] in inodes:
                        total += int(cols[4].split(":")[0], 16)
        return total
    except (OSError, ValueError, StopIteration):
        return None


def other_threads_state() -> tuple[int, bool] | None:
    """CPU time of this process's threads but the calling one, in ns (/proc schedstat), and
    whether one of them is running or waiting for a core (state R in /proc stat: a starved
    thread's CPU time does not grow); None where that cannot be read."""
    me = str(threading.get_native_id())
    try:
        total, runnable = 0, False
        for tid in os.listdir("/proc/self/task"):
            if tid != me:
                try:
                    with open(f"/proc/self/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[0])
                    with open(f"/proc/self/task/{tid}/stat") as f:
                        runnable = runnable or f.read().rpartition(")")[2].split()[0] == "R"
                except FileNotFoundError:  # the thread ended meanwhile
                    continue
        return total, runnable
    except (OSError, ValueError, IndexError):
        return None


async def replies_sent(poll_s: float = 0.01, quiet_polls: int = 3) -> None:
    """Returns once ZeroMQ looks done sending: for `quiet_polls` polls in a row the TCP send
    queues were empty and the other threads (ZeroMQ's I/O thread, which encrypts a CURVE
    message whole before it writes a byte) used under a fifth of the interval and none was
    running or waiting for a core; at once where either cannot be read."""
    quiet = 0
    before = other_threads_state()
    while quiet < quiet_polls:
        await trio.sleep(poll_s)
        unsent, now = unsent_tcp_bytes(), other_threads_state()
        if unsent is None or now is None or before is None:
            return
        busy = now[0] - before[0] >= poll_s * 1e9 / 5 or now[1]
        quiet = quiet + 1 if unsent == 0 and not busy else 0
        before = now


async def _stop_on_signal(scope: trio.CancelScope, server: Any = None) -> None:
    """The first SIGTERM (or SIGINT, unless ignored) stops gracefully: the actor's
    ``on_signal`` runs first, while calls are still served (at most DRAIN_S), then the
    running calls are cancelled and on_stop runs.

    Later signals are ignored, so a repeated SIGTERM cannot kill the process in
    the middle of on_stop (trio restores the default handler when the receiver
    closes); the owner's SIGKILL after its grace period still can.
    """
    stop = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        stop.append(signal.SIGINT)
    try:
        with trio.open_signal_receiver(*stop) as signals:
            async for _ in signals:
                actor = getattr(server, "actor", None)
                if actor is not None:
                    with trio.move_on_after(DRAIN_S):
                        await actor.on_signal()
                    # The replies the drain ended with may still be queued: they get a
                    # moment to leave when the socket closes (nothing else is left to block).
                    server.linger_ms = DRAIN_FLUSH_MS
                    # Linger covers the messages ZeroMQ has not started to send; one it is
                    # encrypting or writing to a TCP connection is cut off when the socket
                    # closes. Wait for it to leave first.
                    with trio.move_on_after(DRAIN_FLUSH_MS / 1000):
                        await replies_sent()
                scope.cancel()
                return
    finally:
        for signum in stop:
            signal.signal(signum, signal.SIG_IGN)


def actor_class(path: str) -> type[_actor.Actor]:
    """Import ``module:QualName`` (from the command line of a trusted spawner, never a message)."""
    import importlib

    module, _, qual = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, _actor.Actor)):
        raise TypeError(f"{path} is not an Actor subclass")
    return obj


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m orchestrator.runtime._child")
    p.add_argument("--cls", required=True, help="actor class as module:QualName")
    p.add_argument("--bind", required=True, help="ZeroMQ address to bind (ipc:// or tcp://)")
    p.add_argument("--name", default="actor")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--ready-fd", type=int, default=None)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--advertise", default=None, help="host name to report instead of the bind IP")
    p.add_argument(
        "--autostart", action="store_true", help="construct the actor without arguments instead of waiting for init"
    )
    args = p.parse_args(argv)
    _actor.rank_of_this_process = args.rank
    gc.set_threshold(GC_GEN0, *gc.get_threshold()[1:])
    if args.parent_pid is not None:
        # A terminal's Ctrl-C reaches the whole process group; the owner decides what it
        # means (finish the step, checkpoint) and stops its actors itself with SIGTERM.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    cpus = os.environ.get("FLOTILLA_CPUS")
    if cpus:  # pin this actor to its cores (the owner emulates separate devices on one machine)
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    if os.environ.get("FLOTILLA_TRACE_FILE"):  # the owner traces: same file, same sampling
        from ._tracing import configure_from_env

        configure_from_env(f"{args.name}[{args.rank}]")
    cls = actor_class(args.cls)
    try:
        trio.run(_serve, cls, args)
    finally:
        # Sockets closed with a linger send what they still hold only while the context
        # lives: terminate it (it waits at most that linger; the rest closed with none).
        context().destroy(linger=0)


if __name__ == "__main__":
    main()
