"""Driving a non-blocking ZeroMQ socket from trio without busy polling.

pyzmq has no trio integration. ZMQ_FD is an edge-triggered signal: it becomes
readable when the socket's state may have changed, and any call that reads
ZMQ_EVENTS (including a send) may consume that edge. So the single reader task
drains while ``EVENTS & POLLIN``, and every send re-checks ``EVENTS`` and wakes
the reader if input is pending; otherwise a message that arrived during the
send could sit unread until the next unrelated wake-up.

Spin-then-park. A task parked on the FD is woken through the kernel (ZeroMQ's
I/O thread signals, epoll returns, the thread is rescheduled), which on a small
VM costs tens of microseconds per hop. Where messages come back to back, a
short poll beats that: a caller whose connection's recent replies came back
within ``2 * SPIN_S`` polls for its reply for up to ``SPIN_S`` before parking
(``_conn.Pending.wait``), and an actor whose requests have been arriving within
``2 * SPIN_S`` of each other polls for the next one as long after serving one
(``ZSocket(spin=True)``). Both yield the core (``sched_yield``) between polls and
let other trio tasks run when they start spinning and at least every
``CHECKPOINT_S`` after, so ZeroMQ's I/O thread and the actor's own work still run
(a trio checkpoint costs several times a poll, so not every poll is one).
Slow endpoints and sparse traffic never spin; an idle process never spins.
``FLOTILLA_SPIN_US=0`` turns it off (e.g. when callers share cores with busy
actors).

ZeroMQ's own threads run under ``SCHED_BATCH`` (Linux). Woken by a send, such a
thread does not preempt the thread that sent: it runs when that thread next yields
or on an idle core. So a send that a spin will follow yields at once: a caller about to
poll for its reply, and a spinning actor's reply to a lone request (within a burst of
requests the replies leave together, when the drain yields). Under the default
policy it preempts the sender at once, and on a machine whose cores are all busy the
sender may then wait out other processes' time slices before it gets its core back
(benchmarks/records/2026-12-06-zmq-batch-threads.md). The policy only changes who runs
first on a wake-up, not anyone's share of the CPU.
``FLOTILLA_ZMQ_BATCH=0`` keeps the default policy.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from time import perf_counter
from typing import Any

import trio
import zmq

from . import _shm
from ._ratelimit import RateLimiter, clip

__all__ = ["CHECKPOINT_S", "SPIN_S", "ZSocket", "context", "tune"]

SPIN_S = float(os.environ.get("FLOTILLA_SPIN_US", "250")) * 1e-6
CHECKPOINT_S = 50e-6  # while spinning, the longest stretch between two trio checkpoints

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_NOBLOCK, _NOBLOCK_MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
_BATCH = 256  # messages the reader handles before yielding
_COPY_BELOW = zmq.COPY_THRESHOLD  # smaller frames are copied even when sent with copy=False
# pyzmq's compiled send. Its Python layer above (zmq.Socket.send) only adds draft-API
# options (routing_id, group), which the runtime never uses, and costs about 1 µs a frame.
_send_copy = zmq.backend.Socket.send
_get = zmq.backend.Socket.get
_RCVMORE = int(zmq.RCVMORE)


_BATCH_THREADS = os.environ.get("FLOTILLA_ZMQ_BATCH", "1") != "0" and hasattr(os, "SCHED_BATCH")
_tuned: zmq.Context[Any] | None = None  # the context whose threads' policy was set


def context() -> zmq.Context[Any]:
    """The process-wide ZeroMQ context (one I/O thread, ``SCHED_BATCH``: see above; the
    policy applies to threads the context starts after this first call, i.e. all of
    them when the runtime makes the process's first socket)."""
    global _tuned
    ctx = zmq.Context.instance()
    if ctx is not _tuned:
        if _BATCH_THREADS:
            try:
                ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
            except zmq.ZMQError as exc:  # a libzmq without the option: the default policy
                log(f"ZeroMQ's threads keep the default scheduling policy: {exc}")
        _tuned = ctx
    return ctx


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

    ``on_message(frames)`` is called for every message (the first
    ``copy_parts`` frames as ``bytes``, the rest as zero-copy ``zmq.Frame``);
    it must not block. It may return True to end the drain there, without the
    check for more input: only when nothing that may still be queued is awaited
    by anyone, since input left behind is read only when someone next looks
    (a send's check, a poll, a new edge on the FD). With ``shm=True`` (both ends
    on this machine) large data frames travel through shared memory (``_shm``);
    the header is frame ``copy_parts - 1`` both ways. With ``marked=True`` (both
    ends runtime sockets) a header that more frames follow starts with ``+`` (or
    ``S``, a shared-memory table; the ``+`` is taken off before ``on_message``), and
    a socket with one peer (not a ROUTER) reads a header starting with ``{`` as the
    whole message, as ``bytes``, without asking whether more follow: a ``zmq.Frame``
    or a ``ZMQ_RCVMORE`` read costs several times the receive itself, on every
    call's path. A peer that sends more frames after such a header garbles only its
    own messages (the rest are read as messages of their own, and dropped as
    malformed). It runs in the
    reader task, or inside ``send`` when the send consumed the FD's edge
    while input was pending (then the sender drains, since the reader would
    not be woken). Cancellation: cancelling ``run`` closes the socket.
    Errors: a send that would block raises ``zmq.Again`` (only possible when
    the socket has no peer pipe at all, as HWMs are unlimited).
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        on_message: Callable[[list[Any]], bool | None],
        *,
        close_on_exit: bool = True,
        copy_parts: int = 1,
        spin: bool = False,
        shm: bool = False,
        marked: bool = False,
    ) -> None:
        self.sock = sock
        self._close_on_exit = close_on_exit
        # Leading frames (routing id, header) arrive as bytes: cheaper than zmq.Frame
        # for small parts; the rest stay zero-copy frames.
        self._copy_parts = copy_parts
        self._on_message = on_message
        self._shm = shm and _shm.ENABLED
        self._marked = marked
        self._fd = sock.getsockopt(zmq.FD)
        self._routed = sock.type == zmq.ROUTER
        # A ROUTER's peers share its input: one that sent more frames after an unmarked
        # header would shift every message after it, so a ROUTER never trusts a mark.
        self._trusts_marks = marked and not self._routed
        self._draining = False
        self.closed = False
        self._spin = spin and SPIN_S > 0
        self._last = 0.0  # when the last message was handled (spinning sockets only)
        self.gap_ewma = 1.0  # seconds between messages, recent average (spinning sockets only)
        self.spins = 0  # times the reader polled instead of parking
        self._handled = 0  # messages handled by the drain under way (or the last one)

    def send(self, frames: list[Any], *, copy: bool = False, check: bool = True) -> None:
        """Queue one multipart message without blocking (large frames are not copied).

        ``check=False`` skips handling input that became pending during the send: only
        for a caller that polls (``poll``) before it next waits. Such a caller, and a
        spinning socket answering a lone request, yield the core right after the send so
        that ZeroMQ's I/O thread passes the message on at once (see the module's notes).
        """
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket closed")
        sock = self.sock
        if len(frames) > self._copy_parts:  # frames follow the header (frame h)
            h = self._copy_parts - 1
            if self._shm:
                frames = _shm.export_frames(frames, h)
            if self._marked and frames[h][:1] != b"S":
                frames = list(frames)
                frames[h] = b"+" + frames[h]
        last = len(frames) - 1
        for i, f in enumerate(frames):
            flags = _NOBLOCK_MORE if i < last else _NOBLOCK
            if type(f) is bytes and len(f) < _COPY_BELOW:  # ids and headers: copied either way
                _send_copy(sock, f, flags)
            else:
                sock.send(f, flags, copy=copy)
        self._sent(check)

    def send_header(self, header: bytes, ident: bytes | None = None, *, check: bool = True) -> None:
        """``send`` for a message that is only a header (after ``ident``, the routing id,
        on a ROUTER socket): no large frames to handle. Most requests and replies are
        such messages, and this is the hot path of a call."""
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket closed")
        sock = self.sock
        if ident is not None:
            _send_copy(sock, ident, _NOBLOCK_MORE)
        _send_copy(sock, header, _NOBLOCK)
        self._sent(check)

    def _sent(self, check: bool) -> None:
        """After a send: yield the core, or handle input that became pending (``send``)."""
        if not check or (self._spinning() and (not self._draining or self._handled == 1)):
            # The message leaves now: ZeroMQ's I/O thread (SCHED_BATCH) runs when this
            # thread yields, which a caller about to spin for its reply or a spinning actor
            # answering a lone request would otherwise do only after more of its own work
            # (returning to the wait, finishing the drain). Replies within a burst leave
            # together, and so do those of an actor that parks between requests.
            os.sched_yield()
        if check and not self._draining and self.sock.get(_EVENTS) & _POLLIN:
            self._drain()

    def poll(self) -> None:
        """Handle whatever input is pending now, without waiting (for callers that spin)."""
        if not self._draining and not self.closed:
            self._drain()

    def _drain(self, limit: int = -1, *, pending: bool = False) -> bool:
        """Handle pending messages; False if ``limit`` stopped it with input left.

        ``pending``: the caller has just seen ``EVENTS & POLLIN`` (the first check is skipped).
        """
        sock, handle = self.sock, self._on_message
        self._draining = True
        self._handled = 0
        try:
            while not self.closed and (pending or sock.get(_EVENTS) & _POLLIN):
                pending = False
                if limit == 0:
                    return False
                limit -= 1
                frames: list[Any] = []
                try:
                    if self._routed:  # a ROUTER's message: its routing id, then at least one frame
                        frames.append(sock.recv(_NOBLOCK))
                    if self._trusts_marks:
                        frames.append(head := sock.recv(_NOBLOCK))
                        more = head[:1] != b"{" and _get(sock, _RCVMORE)  # unmarked: ask
                    else:
                        more = True
                    # A frame received as a zmq.Frame says whether more follow, which is
                    # cheaper than asking the socket (ZMQ_RCVMORE); the leading parts are
                    # kept as bytes. Only the first receive can find nothing.
                    while more:
                        frame = sock.recv(_NOBLOCK, copy=False)
                        frames.append(frame.bytes if len(frames) < self._copy_parts else frame)
                        more = frame.more
                except zmq.Again:
                    break
                h = self._copy_parts - 1  # the header's index
                if self._marked and len(frames) > h and frames[h][:1] == b"+":
                    frames[h] = frames[h][1:]
                if self._shm and len(frames) > self._copy_parts and frames[h][:1] == b"S":
                    try:
                        frames = _shm.import_frames(frames, h, log)
                    except ValueError as exc:
                        log_repeated("dropped", f"dropped a message: {clip(exc)}")
                        continue
                self._handled += 1
                try:
                    done = handle(frames)
                except Exception as exc:
                    log_repeated("dropped", f"dropped a message: {clip(repr(exc))}")
                    done = False
                if self._spin:  # timed after the handler, whose reply (if any) has left
                    now = perf_counter()
                    self.gap_ewma += 0.2 * (now - self._last - self.gap_ewma)
                    self._last = now
                if done:
                    break
        finally:
            self._draining = False
        return True

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read until cancelled; the socket is closed on exit unless its owner closes it."""
        try:
            task_status.started()
            await self.read()
        finally:
            if self._close_on_exit:
                self.close()

    async def read(self, until: Callable[[], bool] | None = None) -> None:
        """The reader loop: drain, then spin or park on the FD, until cancelled.

        With ``until``, it is asked after every drain (before this task waits again) and
        the loop returns when it says True: a handler has given the reading task other
        work, and whoever reads next calls ``read`` again (the socket stays open). Only
        one task may be in ``read`` at a time.
        """
        pending = False
        while True:
            drained = self._drain(_BATCH, pending=pending)
            if until is not None and until():
                return
            if not drained:
                pending = False
                await trio.lowlevel.checkpoint()  # a flood must not starve other tasks
            else:
                pending = self._spinning() and await self._spin_wait()
                if not pending:
                    await trio.lowlevel.wait_readable(self._fd)

    def _spinning(self) -> bool:
        """Whether the reader polls for the next message rather than parking: a spinning
        socket whose messages have been arriving within ``2 * SPIN_S`` of each other."""
        return self._spin and self.gap_ewma < 2 * SPIN_S

    async def _spin_wait(self) -> bool:
        """Poll for input until ``SPIN_S`` after the last message was handled; True if some came."""
        deadline = self._last + SPIN_S
        sock = self.sock
        self.spins += 1
        first, next_cp = True, 0.0
        while (now := perf_counter()) < deadline and not self.closed:
            # This core's other threads run first: ZeroMQ's I/O thread has the replies just
            # sent to pass on, and a trio checkpoint costs several times a yield.
            os.sched_yield()
            pending = sock.get(_EVENTS) & _POLLIN
            # The calls just started run here, even when the next message is already in (a
            # steady flood must not starve them); after that, at least every CHECKPOINT_S
            # while nothing has come. A message that has come is read first: the spin after
            # it starts with a checkpoint again.
            if first or (not pending and now >= next_cp):
                first = False
                await trio.lowlevel.checkpoint()
                next_cp = perf_counter() + CHECKPOINT_S
            if pending:
                return True
        return False

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket; messages still queued get ``linger_ms`` to leave, provided
        the process terms its context before it exits (see ``_child``)."""
        if not self.closed:
            self.closed = True
            try:
                trio.lowlevel.notify_closing(self._fd)
            except RuntimeError:  # outside a trio run (interpreter shutdown)
                pass
            self.sock.close(linger=linger_ms)


def log(msg: str) -> None:
    """Runtime diagnostics go to stderr: they must never take a process down."""
    try:
        print(f"[flotilla.runtime] {msg}", file=sys.stderr, flush=True)
    except Exception:
        pass


REPEAT_S = 5.0
"""Seconds between two lines of one kind of repeated wire event (malformed messages,
rejected requests); the events in between are counted into the next line."""

_repeats = RateLimiter(REPEAT_S)


def log_repeated(kind: str, msg: str) -> None:
    """`log` for an event a peer can repeat at will: at most one line per `kind` per
    `REPEAT_S`, with the count of those held back; put outside values in `msg` through
    `clip`."""
    _repeats.log(kind, msg, log)
