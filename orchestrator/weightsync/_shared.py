"""Snapshots in shared memory, encoded by helper processes instead of threads.

Why: a chunk's encoding is a string of numpy and zstd calls. Each call lets the GIL go
and must take it back, so two encoding *threads* wait on each other at every call, and
with small chunks (a small model's) the calls are short and many. Two *processes* share
no GIL, so for small chunks the calling thread and helper processes outrun threads
(`benchmarks/weightsync.py` reports both paths on the same deltas). Chunks of 1 MiB
and more stay on threads (`_codec._HELPER_CHUNK`). A helper can only read what it can
map, so this path needs snapshots that live in shared memory.

Arenas: `allocate` puts a snapshot's tensors back to back (64-byte aligned) in one
anonymous shared file (``memfd_create``, so nothing is named in the file system and
nothing can leak: the memory goes when the last mapping and descriptor go). The
tensors are ordinary CPU tensors viewing the mapping. Once no tensor uses an arena it
is kept for the next snapshot of the same size (up to ``FLOTILLA_SHM_IDLE_MB`` of free
arenas), so neither process maps and faults in fresh pages at every publish. `locate`
tells whether a tensor lies in an arena in use, and where.

Helpers: `threads - 1` processes (``_helper.py``, which imports numpy, zstandard and
xxhash but not torch: ~0.1 s to start), started on first use and kept for the process.
Until a helper has said it is ready, the caller encodes with threads as before. A
request carries the descriptors of arenas the helper has not seen yet (``SCM_RIGHTS``
over a Unix socketpair from this process; nothing else can reach it), and the chunks as
rows of integers; the reply carries each chunk's zstd frame and digest. Nothing is
pickled. A helper that dies or answers wrongly is stopped, its chunks are encoded by
the caller, and the next call starts a fresh one. A helper exits when this process
goes (its socket reads end-of-file).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import mmap
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

__all__ = ["Job", "allocate", "encode_on_helpers", "helper_stats", "locate", "share", "start_helpers"]

log = logging.getLogger("flotilla.weightsync")

_ALIGN = 64
_HELPER = Path(__file__).with_name("_helper.py")
_PREAMBLE = struct.Struct("<III")  # json bytes, job rows, descriptors attached
_COLUMNS = 6  # old arena (-1: keyframe), old offset, new arena, new offset, words, word size
_MAX_FDS = 16

Job = tuple[int, int, int, int, int, int]
"""One chunk for a helper: (old arena or -1 for a keyframe, old byte offset, new arena,
new byte offset, words, word size)."""

IDLE_BYTES = int(os.environ.get("FLOTILLA_SHM_IDLE_MB", "1024")) << 20
"""Free arenas kept for reuse, in bytes (the runtime's segment pool reads the same knob).
A publisher allocates a snapshot per step and drops the one before, so one kept arena
saves both processes mapping and faulting in fresh pages every step."""


class _Arena:
    __slots__ = ("fd", "id", "mm", "size", "start")

    def __init__(self, aid: int, fd: int, mm: mmap.mmap) -> None:
        self.id, self.fd, self.mm, self.size = aid, fd, mm, len(mm)
        self.start = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)


_lock = threading.RLock()  # guards the tables below (re-entrant: a finalizer may run inside)
_arenas: dict[int, _Arena] = {}  # every open arena, in use or free, by id
_in_use: set[int] = set()
_free: list[_Arena] = []  # oldest first
_next_id = 0


def allocate(spec: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> dict[str, torch.Tensor] | None:
    """Tensors of the given (name, dtype, shape), back to back in one shared arena, with
    undefined contents (like ``torch.empty``: a reused arena holds old bytes); None where
    shared memory cannot be had (no ``memfd_create``, out of memory): callers then use
    ordinary tensors. The arena is free again once no tensor uses it."""
    spans, size = [], 0  # (offset, bytes) per tensor
    for _, dtype, shape in spec:
        n = math.prod(shape) * dtype.itemsize
        spans.append((size, n))
        size += -(-n // _ALIGN) * _ALIGN
    arena = _take(max(size, _ALIGN))
    if arena is None:
        return None
    view = memoryview(arena.mm)
    weakref.finalize(view, _freed, arena.id)  # runs when the last tensor below is gone
    base = torch.frombuffer(view, dtype=torch.uint8)
    return {
        name: base[off : off + n].view(dtype).view(shape)
        for (name, dtype, shape), (off, n) in zip(spec, spans, strict=True)
    }


def _take(size: int) -> _Arena | None:
    """A free arena of exactly `size` bytes, or a new one."""
    global _next_id
    with _lock:
        for i, a in enumerate(_free):
            if a.size == size:
                del _free[i]
                _in_use.add(a.id)
                return a
        aid, _next_id = _next_id, _next_id + 1
    try:
        fd = os.memfd_create("flotilla-snapshot", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return None
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    except OSError:
        os.close(fd)
        return None
    arena = _Arena(aid, fd, mm)
    with _lock:
        _arenas[aid] = arena
        _in_use.add(aid)
    return arena


def _freed(aid: int) -> None:
    """No tensor uses arena `aid` any more: keep it for reuse, closing the oldest free
    arenas beyond `IDLE_BYTES`."""
    closing = []
    with _lock:
        if aid not in _in_use:  # a table reset by a fork (see `_after_fork`)
            return
        _in_use.discard(aid)
        _free.append(_arenas[aid])
        while _free and sum(a.size for a in _free) > IDLE_BYTES:
            a = _free.pop(0)
            del _arenas[a.id]
            closing.append(a)
    for a in closing:
        a.close()
        for h in _helpers:
            h.forget(a.id)


def share(snapshot: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of `snapshot` in one shared arena (or an ordinary copy where none can be had)."""
    out = allocate([(n, t.dtype, tuple(t.shape)) for n, t in snapshot.items()])
    if out is None:
        return {n: t.detach().clone() for n, t in snapshot.items()}
    for n, t in snapshot.items():
        out[n].copy_(t)
    return out


def locate(t: torch.Tensor) -> tuple[int, int] | None:
    """(arena id, byte offset) of a contiguous CPU tensor that lies in an arena in use."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    ptr = t.data_ptr()
    end = ptr + t.numel() * t.element_size()
    with _lock:
        for aid in _in_use:
            a = _arenas[aid]
            if a.start <= ptr and end <= a.start + a.size:
                return aid, ptr - a.start
    return None


def _fd(aid: int) -> tuple[int, int] | None:
    with _lock:
        a = _arenas.get(aid)
    return None if a is None else (a.fd, a.size)


class HelperError(RuntimeError):
    """A helper process died or broke the protocol (its chunks are then encoded here)."""


class _Helper:
    """One helper process and its end of the socketpair."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(_HELPER), str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        finally:
            theirs.close()
        self.sock = ours
        self.ready = False
        self.known: set[int] = set()  # arenas whose descriptor the helper holds
        self.forgotten: set[int] = set()  # arenas gone since the last request

    def is_ready(self) -> bool:
        """Whether the helper has started (it sends one byte then); never blocks."""
        if not self.ready and select.select([self.sock], [], [], 0)[0]:
            try:
                hello = self.sock.recv(1)
            except OSError:
                hello = b""
            if hello != b"R":
                raise HelperError(self._died())
            self.ready = True
        return self.ready

    def forget(self, aid: int) -> None:
        if aid in self.known:
            self.known.discard(aid)
            self.forgotten.add(aid)

    def submit(self, jobs: list[Job], *, level: int, algo: str, chunk_bytes: int) -> None:
        new = sorted(({j[0] for j in jobs if j[0] >= 0} | {j[2] for j in jobs}) - self.known)
        fds, sizes = [], []
        for aid in new:
            entry = _fd(aid)
            if entry is None:
                raise HelperError(f"arena {aid} was released during the encode")
            fds.append(entry[0])
            sizes.append(entry[1])
        if len(fds) > _MAX_FDS:
            raise HelperError(f"{len(fds)} new arenas in one request, at most {_MAX_FDS}")
        head = json.dumps(
            {
                "level": level,
                "algo": algo,
                "chunk_bytes": chunk_bytes,
                "arenas": new,
                "sizes": sizes,
                "drop": sorted(self.forgotten),
            }
        ).encode()
        rows = struct.pack(f"<{len(jobs) * _COLUMNS}q", *(v for j in jobs for v in j))
        try:
            pre = _PREAMBLE.pack(len(head), len(jobs), len(fds))
            if fds:
                socket.send_fds(self.sock, [pre], fds)
            else:
                self.sock.sendall(pre)
            self.sock.sendall(head + rows)
        except OSError as e:
            raise HelperError(f"helper unreachable: {e}") from None
        self.known.update(new)
        self.forgotten.clear()

    def collect(self, n: int, digest_size: int) -> list[tuple[bytes, bytes]]:
        status = struct.unpack("<I", self._read(4))[0]
        if status != 0:
            raise HelperError("helper refused the request: " + self._read(status).decode(errors="replace"))
        lens = struct.unpack(f"<{n}I", self._read(4 * n))
        digests = self._read(digest_size * n)
        frames = [self._read(k) for k in lens]
        return [(f, digests[i * digest_size : (i + 1) * digest_size]) for i, f in enumerate(frames)]

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:  # MSG_WAITALL returns short only on a signal or end-of-file
            try:
                more = self.sock.recv(n - len(data), socket.MSG_WAITALL)
            except OSError:
                more = b""
            if not more:
                raise HelperError(self._died())
            data += more
        return data

    def _died(self) -> str:
        self._stop()
        err = self.proc.stderr.read().decode(errors="replace").strip() if self.proc.stderr else ""
        self.close()
        return f"helper process exited ({self.proc.returncode}): {err[-500:] or 'no message'}"

    def _stop(self) -> None:
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        self._stop()
        if self.proc.stderr:
            self.proc.stderr.close()


_helpers: list[_Helper] = []
ENABLED = os.environ.get("FLOTILLA_CODEC_HELPERS", "1") != "0"
"""``FLOTILLA_CODEC_HELPERS=0`` keeps every encode on threads (snapshots still go to
shared memory when asked: that costs nothing)."""
MAX_FAILURES = 3
"""After this many helpers died or misbehaved, this process stops starting them (a helper
that cannot start at all would otherwise be started again at every encode)."""
stats = {"helper_encodes": 0, "helper_failures": 0}
"""Encodes that ran on helper processes, and helpers stopped for dying or misbehaving."""
_helpers_lock = threading.Lock()  # one encode at a time uses the helpers


def start_helpers(n: int, *, wait: float = 0.0) -> bool:
    """Start helper processes until there are `n`; they get ready in the background
    (~0.1 s). With `wait`, block up to that many seconds for them. Returns whether all
    `n` are ready."""
    deadline = time.monotonic() + wait
    while True:
        with _helpers_lock:
            ready = shared_helpers(n) is not None
        if ready or time.monotonic() >= deadline:
            return ready
        time.sleep(0.01)


def helper_stats() -> dict[str, float]:
    """{"helper_encodes": encodes run on helper processes, "helper_failures": helpers
    stopped for dying or misbehaving} in this process so far, and "helper_cpu_s": the CPU
    time of the helpers now running (Linux ``/proc/<pid>/schedstat``; 0 elsewhere)."""
    cpu = 0.0
    for h in list(_helpers):
        try:  # nanoseconds on a CPU (``/proc/<pid>/stat`` counts in 10 ms ticks)
            with open(f"/proc/{h.proc.pid}/schedstat") as f:
                cpu += int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
    return {**stats, "helper_cpu_s": cpu}


def _start(n: int) -> None:
    while len(_helpers) < n:
        _helpers.append(_Helper())


def shared_helpers(n: int) -> list[_Helper] | None:
    """`n` started helpers, or None while they are starting, or for good once
    `MAX_FAILURES` helpers have failed or when `ENABLED` is off (the caller uses threads
    then). Starts missing ones; the caller must hold `_helpers_lock`."""
    if not ENABLED or stats["helper_failures"] >= MAX_FAILURES:
        return None
    _start(n)
    ready = True
    for h in list(_helpers[:n]):
        try:
            ready = h.is_ready() and ready
        except HelperError as e:
            _drop(h, e)
            return None
    return _helpers[:n] if ready else None


def _after_fork() -> None:
    """In a forked child: forget the parent's helpers (their sockets are the parent's)
    and arenas (a free one handed out here would be written under the parent's feet)."""
    global _lock, _helpers_lock
    _lock, _helpers_lock = threading.RLock(), threading.Lock()
    _helpers.clear()
    _arenas.clear()
    _in_use.clear()
    _free.clear()


os.register_at_fork(after_in_child=_after_fork)


@atexit.register
def _close_all() -> None:
    for h in _helpers:
        h.close()
    _helpers.clear()


def encode_on_helpers(
    rows: list[Job],
    helpers: int,
    *,
    level: int,
    algo: str,
    chunk_bytes: int,
    digest_size: int,
    run_here: Callable[[list[int]], list[tuple[bytes, bytes]]],
) -> list[tuple[bytes, bytes]] | None:
    """Encode chunks split by bytes between `helpers` processes and the calling thread.

    `rows[i]` describes chunk i for a helper; `run_here(indices)` encodes those chunks
    in this thread. The helpers' shares are sent first, so they work while this thread
    prepares and encodes its own. Returns the (frame, digest) of every chunk in order,
    or None when the helpers are busy with another call or still starting (the caller
    then uses threads).
    """
    if not _helpers_lock.acquire(blocking=False):
        return None
    pending: list[tuple[_Helper, range]] = []  # sent, reply not yet read
    try:
        procs = shared_helpers(helpers)
        if procs is None:
            return None
        shares = _split_by_bytes(rows, len(procs) + 1)
        here = list(shares[-1])
        for h, part in zip(procs, shares[:-1], strict=True):
            try:
                h.submit([rows[i] for i in part], level=level, algo=algo, chunk_bytes=chunk_bytes)
                pending.append((h, part))
            except HelperError as e:  # its share runs here
                _drop(h, e)
                here += part
        results: list[tuple[bytes, bytes] | None] = [None] * len(rows)
        for i, r in zip(here, run_here(here), strict=True):
            results[i] = r
        while pending:
            h, part = pending[0]
            try:
                got = h.collect(len(part), digest_size)
            except HelperError as e:
                pending.pop(0)
                _drop(h, e)
                got = run_here(list(part))
            else:
                pending.pop(0)
            for i, r in zip(part, got, strict=True):
                results[i] = r
        stats["helper_encodes"] += 1
        return results  # type: ignore[return-value]
    finally:
        for h, _ in pending:  # a reply left unread (this thread raised): out of step
            _drop(h, HelperError("an encode stopped before reading this helper's reply"))
        _helpers_lock.release()


def _drop(h: _Helper, e: Exception) -> None:
    stats["helper_failures"] += 1
    later = (
        "until another helper is ready"
        if stats["helper_failures"] < MAX_FAILURES
        else f"from now on ({MAX_FAILURES} helpers failed: no more are started)"
    )
    log.warning("weightsync: %s; encoding on threads %s", e, later)
    h.close()
    if h in _helpers:
        _helpers.remove(h)


def _split_by_bytes(rows: list[Job], parts: int) -> list[range]:
    """Contiguous ranges of rows with about equal bytes each."""
    total = sum(r[4] * r[5] for r in rows)
    bounds, acc, k = [0], 0, 1
    for i, r in enumerate(rows):
        acc += r[4] * r[5]
        while k < parts and acc >= total * k / parts:
            bounds.append(i + 1)
            k += 1
    while len(bounds) <= parts:
        bounds.append(len(rows))
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]
