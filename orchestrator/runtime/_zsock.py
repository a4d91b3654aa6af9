"""Driving a non-blocking ZeroMQ socket from trio without busy polling.

pyzmq has no trio integration. ZMQ_FD is an edge-triggered signal: it becomes
readable when the socket's state may have changed, and any call that reads
ZMQ_EVENTS (including a send) may consume that edge. So the single reader task
drains while ``EVENTS & POLLIN``, and every send re-checks ``EVENTS`` and wakes
the reader if input is pending; otherwise a message that arrived during the
send could sit unread until the next unrelated wake-up.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import trio
import zmq

__all__ = ["ZSocket", "context", "tune"]

_DRAIN_BATCH = 64  # messages handled before yielding to other tasks


def context() -> zmq.Context[Any]:
    """The process-wide ZeroMQ context (one I/O thread)."""
    return zmq.Context.instance()


def tune(sock: zmq.Socket[Any], *, tcp: bool) -> None:
    """Options every runtime socket gets.

    High-water marks are unlimited: a full queue would make a non-blocking send
    fail (DEALER) or drop a message silently (ROUTER), and callers bound their
    own concurrency. Linger is 0 so closing never blocks a trio loop.
    """
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 20)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    if tcp:
        # Heartbeats let both sides notice a vanished peer within seconds.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 6000)


class ZSocket:
    """A ZeroMQ socket with one reader task and synchronous, non-blocking sends.

    ``on_message(frames)`` is called from the reader task for every message
    (frames are ``zmq.Frame`` objects, zero-copy); it must not block.
    Cancellation: cancelling ``run`` closes the socket. Errors: a send that
    would block raises ``zmq.Again`` (cannot happen with unlimited HWMs unless
    the socket has no peer pipe at all).
    """

    def __init__(self, sock: zmq.Socket[Any], on_message: Callable[[list[Any]], None]) -> None:
        self.sock = sock
        self._on_message = on_message
        self._fd = sock.getsockopt(zmq.FD)
        self._wait_scope: trio.CancelScope | None = None
        self.closed = False

    def send(self, frames: list[Any], *, copy: bool = False) -> None:
        """Queue one multipart message without blocking (tensor frames are not copied)."""
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket closed")
        self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
        if self._wait_scope is not None and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._wait_scope.cancel()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read until cancelled; the socket is closed on exit."""
        sock = self.sock
        try:
            task_status.started()
            while True:
                n = 0
                while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        self._on_message(frames)
                    except Exception as exc:  # noqa: BLE001 - one bad message must not stop the reader
                        log(f"dropped a message: {exc!r}")
                    n += 1
                    if n % _DRAIN_BATCH == 0:
                        await trio.lowlevel.checkpoint()
                with trio.CancelScope() as scope:
                    self._wait_scope = scope
                    await trio.lowlevel.wait_readable(self._fd)
                self._wait_scope = None
        finally:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._wait_scope = None
            try:
                trio.lowlevel.notify_closing(self._fd)
            except RuntimeError:  # outside a trio run (interpreter shutdown)
                pass
            self.sock.close(linger=0)


def log(msg: str) -> None:
    """Runtime diagnostics go to stderr: they must never take a process down."""
    try:
        print(f"[flotilla.runtime] {msg}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - stderr may be gone at shutdown
        pass
