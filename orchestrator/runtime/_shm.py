"""Large frames between processes on one machine, through shared memory.

Over ``ipc://`` every byte of a ZeroMQ message goes through the kernel socket and
ZeroMQ's I/O threads on both sides, several times slower than one ``memcpy`` into memory
that is already mapped. So on a socket
whose peers share the machine (both ends of an ``ipc://`` address), a data frame of at
least ``SHM_MIN_BYTES`` travels as a segment file in ``/dev/shm``:

* the sender copies the frame once into a segment of its own pool (segments are reused,
  so their pages are already allocated and mapped) and sends an empty frame in its place;
* the receiver maps the segment and hands the mapping on as the frame, without copying:
  a tensor decoded from it lives in the segment. When the last reference to that memory
  goes away, the receiver marks the segment free and the sender may reuse it.

Wire format: the message's header frame gains a prefix, ``b"S" + JSON + b"\\n"``, where
the JSON is ``[[frame index after the header, segment name, nbytes], ...]``; a plain header is a JSON
object and always starts with ``{``, so the two cannot be confused. A segment is
``_HEAD`` bytes of state (uint32: 0 free, 1 in use by a receiver) followed by data.

Trust: a receiver opens only names of the form ``flotilla-<pid>-<n>`` in ``/dev/shm``,
owned by its own user, regular files at least as large as declared. A segment it cannot
use becomes an empty frame (logged), so decoding the message fails with a ``WireError``
naming the size mismatch instead of the message vanishing.

A sender may also lend a segment's memory out before sending (``lend_buffer``): what it
writes there (a batch concatenated in place) then travels without the copy. Sending that
buffer hands the segment to the receiver as above; a lent buffer never sent returns to
the pool when the sender drops it.

Lifetime: a process unlinks its free segments when it exits; a segment still marked in
use stays for its receiver, which unlinks it when done with it if the sender has exited.
The next process that creates a pool removes the segments of processes that no longer
exist (so a crash leaks nothing past the next run).
When ``/dev/shm`` is missing or full, frames fall back to ZeroMQ. ``FLOTILLA_SHM=0``
turns the path off; ``FLOTILLA_SHM_MIN_BYTES`` sets the threshold (default 1 MiB).
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import json
import mmap
import os
import re
import stat
import struct
import weakref
from typing import Any

from ._ratelimit import clip

__all__ = [
    "ENABLED",
    "SHM_MIN_BYTES",
    "SegmentPool",
    "export_frames",
    "import_frames",
    "lend_buffer",
    "segments_created",
]

ENABLED = os.environ.get("FLOTILLA_SHM", "1") != "0" and os.path.isdir("/dev/shm")
SHM_MIN_BYTES = int(os.environ.get("FLOTILLA_SHM_MIN_BYTES", str(1 << 20)))
IDLE_BYTES = int(os.environ.get("FLOTILLA_SHM_IDLE_MB", "1024")) << 20  # free segments kept

_DIR = "/dev/shm"
_PREFIX = "flotilla-"
_HEAD = 64  # state word, padded so data stays 64-byte aligned
_NAME = re.compile(r"flotilla-(\d+)-(\d+)")
_FREE, _BUSY = 0, 1
_STATE = struct.Struct("<I")
_ids = itertools.count()  # segment names, unique in this process


class _Segment:
    __slots__ = ("lent", "mm", "name", "sent", "size")

    def __init__(self, name: str, size: int, mm: mmap.mmap) -> None:
        self.name, self.size, self.mm = name, size, mm
        self.lent = False  # this process still refers to its memory (`SegmentPool.lend`)
        self.sent = False  # the lent memory was sent: the receiver frees the segment

    def busy(self) -> bool:
        """In use by a receiver, or lent out here."""
        return self.lent or _STATE.unpack_from(self.mm, 0)[0] != _FREE


class SegmentPool:
    """The sending side: this process's segments, reused once their receiver frees them.

    ``put(buf)`` returns the name of a segment now holding a copy of ``buf`` (marked in
    use), or None when no segment can be had (``/dev/shm`` full or missing: the caller
    sends the frame through ZeroMQ instead). Free segments beyond ``idle_bytes`` in all
    are unlinked, oldest first.
    """

    def __init__(self, idle_bytes: int = IDLE_BYTES) -> None:
        self.idle_bytes = idle_bytes
        self.segments: list[_Segment] = []
        self.created = 0  # segments made (a reused one is not counted again)
        self._lent: dict[int, _Segment] = {}  # lent segments not sent yet, by data address
        _sweep_dead()
        atexit.register(self.close)

    def lend(self, n: int) -> memoryview | None:
        """``n`` writable bytes in a segment (marked in use), or None when none can be had.

        ``put`` of this very buffer (all of it, from its start) sends the segment without
        copying, once; the segment is then the receiver's to free. Dropped unsent (every
        reference to the memory gone), it is free again.
        """
        seg = self._take(n)
        if seg is None:
            return None
        data = (ctypes.c_uint8 * n).from_buffer(seg.mm, _HEAD)
        seg.lent, seg.sent = True, False
        address = ctypes.addressof(data)
        self._lent[address] = seg
        weakref.finalize(data, self._returned, seg, address)
        return memoryview(data).cast("B")

    def _returned(self, seg: _Segment, address: int) -> None:
        """The lent memory is no longer referenced here: unsent, the segment is free again."""
        self._lent.pop(address, None)
        seg.lent = False
        if not seg.sent:
            _STATE.pack_into(seg.mm, 0, _FREE)

    def _sending_lent(self, buf: memoryview) -> str | None:
        """The name of the lent segment ``buf`` is (marked sent), or None if it is not one."""
        if not self._lent or buf.readonly:
            return None
        try:
            address = ctypes.addressof(ctypes.c_uint8.from_buffer(buf))
        except (TypeError, ValueError):  # not a plain writable buffer
            return None
        seg = self._lent.get(address)
        if seg is None or buf.nbytes > seg.size - _HEAD:
            return None
        del self._lent[address]  # sent once: a second send of it copies
        seg.sent = True
        return seg.name

    def put(self, buf: memoryview) -> str | None:
        n = buf.nbytes
        name = self._sending_lent(buf)
        if name is not None:
            return name
        seg = self._take(n)
        if seg is None:
            return None
        seg.mm[_HEAD : _HEAD + n] = buf
        return seg.name

    def _take(self, n: int) -> _Segment | None:
        """A free segment for ``n`` data bytes (reused, else made), marked in use; None when
        none can be had."""
        seg = self._free_fitting(n) or self._create(n)
        if seg is not None:
            _STATE.pack_into(seg.mm, 0, _BUSY)
        return seg

    def _free_fitting(self, n: int) -> _Segment | None:
        best = None
        for seg in self.segments:  # a handful of segments: a scan is cheaper than an index
            if n <= seg.size - _HEAD and not seg.busy() and (best is None or seg.size < best.size):
                best = seg
        if best is not None and best.size - _HEAD > 4 * n + (1 << 20):
            return None  # do not pin a huge segment under a small frame
        return best

    def _create(self, n: int) -> _Segment | None:
        self._trim()
        size = -(-_size_class(_HEAD + max(n, SHM_MIN_BYTES)) // mmap.PAGESIZE) * mmap.PAGESIZE
        name = f"{_PREFIX}{os.getpid()}-{next(_ids)}"
        path = os.path.join(_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS on a later write
            mm = mmap.mmap(fd, size)
        except OSError:
            os.unlink(path)
            return None
        finally:
            os.close(fd)
        seg = _Segment(name, size, mm)
        self.segments.append(seg)
        self.created += 1
        return seg

    def _trim(self) -> None:
        free = [s for s in self.segments if not s.busy()]
        idle = sum(s.size for s in free)
        for seg in free:  # oldest first
            if idle <= self.idle_bytes:
                break
            self._drop(seg)
            idle -= seg.size

    def _drop(self, seg: _Segment) -> None:
        self.segments.remove(seg)
        try:
            os.unlink(os.path.join(_DIR, seg.name))
        except FileNotFoundError:
            pass
        try:
            seg.mm.close()
        except BufferError:  # lent memory still referenced at exit: the mapping goes with the process
            pass

    def close(self) -> None:
        """Unlink the free segments and those lent and never sent; one a receiver still
        holds stays for it."""
        for seg in list(self.segments):
            if not seg.busy() or (seg.lent and not seg.sent):
                self._drop(seg)
        self.segments.clear()


def _size_class(n: int) -> int:
    """``n`` rounded up to the next of eight steps per power of two (at most 1/8 more): a
    frame a little larger than the last (the next batch of trajectories, the next delta)
    then fits a segment already made, instead of a fresh one whose allocation and first
    writes cost several times a copy into memory already mapped."""
    step = 1 << max(0, n.bit_length() - 4)  # an eighth of the power of two at or below n
    return -(-n // step) * step


_pool: SegmentPool | None = None


def _the_pool() -> SegmentPool:
    global _pool
    if _pool is None:
        _pool = SegmentPool()
    return _pool


def segments_created() -> int:
    """Segments this process has made to send frames (0 before any); reuse adds none."""
    return 0 if _pool is None else _pool.created


def lend_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of writable memory that a message to a peer on this machine carries without
    a copy: it is handed to the receiver through shared memory. Elsewhere (a remote peer, no
    ``/dev/shm``, fewer than ``SHM_MIN_BYTES``) it is a plain buffer and travels as any.

    Fill it, send it once (as a frame, or as the storage of a tensor built on it), then
    drop it: the receiver may reuse the memory as soon as it is done with it, so the sender
    must not read or write it after sending.
    """
    if ENABLED and nbytes >= SHM_MIN_BYTES:
        buf = _the_pool().lend(nbytes)
        if buf is not None:
            return buf
    return memoryview(bytearray(nbytes))


def _nbytes(frame: Any) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


def export_frames(frames: list[Any], header_at: int) -> list[Any]:
    """Move the large data frames (after ``header_at``) into segments; returns the frames to send.

    Frames that stay (small ones, or any when no segment can be had) are unchanged.
    """
    table = []
    for i in range(header_at + 1, len(frames)):
        f = frames[i]
        if _nbytes(f) < SHM_MIN_BYTES:
            continue
        buf = f if isinstance(f, memoryview) else memoryview(f)
        name = _the_pool().put(buf)
        if name is None:
            break
        if not table:
            frames = list(frames)
        table.append([i - header_at, name, buf.nbytes])  # a ROUTER peer sees one more frame first
        frames[i] = b""
    if table:
        frames[header_at] = b"S" + json.dumps(table, separators=(",", ":")).encode() + b"\n" + bytes(frames[header_at])
    return frames


def import_frames(frames: list[Any], header_at: int, log: Any) -> list[Any]:
    """Replace the frames a prefixed header names by mappings of their segments (in place).

    Raises ValueError for a malformed table (the caller drops the message); a segment
    that cannot be used becomes an empty frame and is logged.
    """
    head = frames[header_at]
    cut = head.find(b"\n")
    try:
        table = json.loads(head[1:cut]) if cut > 0 else None
    except ValueError:
        table = None
    if type(table) is not list:
        raise ValueError("malformed shared-memory table in a message header")
    frames[header_at] = head[cut + 1 :]
    for entry in table:
        if not (
            type(entry) is list
            and len(entry) == 3
            and type(entry[0]) is int
            and type(entry[1]) is str
            and type(entry[2]) is int
            and entry[2] >= 0
            and 0 < entry[0] < len(frames) - header_at
        ):
            raise ValueError(f"malformed shared-memory entry {entry!r}")
        offset, name, n = entry
        index = header_at + offset
        try:
            frames[index] = _map(name, n)
        except OSError as exc:
            log(f"shared-memory frame {clip(repr(name))} ({n} bytes) unavailable: {clip(exc)}")
            frames[index] = b""
    return frames


def _map(name: str, n: int) -> memoryview:
    if _NAME.fullmatch(name) is None:
        raise OSError(f"not a segment name: {name!r}")
    fd = os.open(os.path.join(_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size < _HEAD + n:
            raise OSError(f"segment {name!r} is not a {_HEAD + n}-byte file of this user")
        mm = mmap.mmap(fd, _HEAD + n)
    finally:
        os.close(fd)
    if _STATE.unpack_from(mm, 0)[0] != _BUSY:
        mm.close()
        raise OSError(f"segment {name!r} is not marked in use (sent twice?)")
    data = (ctypes.c_uint8 * n).from_buffer(mm, _HEAD) if n else bytearray()
    if n:
        # the segment is free again once nothing refers to its memory any more
        weakref.finalize(data, _release, mm, name)
    return memoryview(data).cast("B")


def _release(mm: mmap.mmap, name: str) -> None:
    """Mark a received segment free; unlink it if its sender has exited meanwhile."""
    _STATE.pack_into(mm, 0, _FREE)
    m = _NAME.fullmatch(name)
    if m is not None and not _alive(int(m.group(1))):
        try:
            os.unlink(os.path.join(_DIR, name))
        except OSError:
            pass


def _sweep_dead() -> None:
    """Remove segments left by processes of this user that no longer exist."""
    try:
        names = os.listdir(_DIR)
    except OSError:
        return
    uid = os.getuid()
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None or _alive(int(m.group(1))):
            continue
        path = os.path.join(_DIR, name)
        try:
            if os.stat(path, follow_symlinks=False).st_uid == uid:
                os.unlink(path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
