"""A codec helper process (see `_shared`): encodes chunks of snapshots in shared memory.

Run as ``python _helper.py <socket fd>`` by `_shared._Helper`, never imported by the
package. It loads `_chunks` (numpy, zstandard, xxhash) without importing the package,
whose ``__init__`` imports torch: the helper starts in ~0.1 s and ~25 MB.

Protocol on the socket, all little-endian; nothing is pickled:

* ready: the helper sends ``b"R"`` once.
* request: 12 bytes (json length, job rows, descriptors), with that many file
  descriptors attached (``SCM_RIGHTS``); the JSON ``{"level", "algo", "arenas": [ids of
  the attached descriptors], "sizes": [their sizes], "drop": [ids no longer needed],
  "chunk_bytes"}``; then 6 int64 per job row (see `_shared.Job`).
* reply: u32 0, the frames' lengths (u32 each), the digests, the frames; or u32 n > 0
  and an n-byte message when a request is malformed (the helper then goes on).

It exits when the socket reaches end-of-file (its parent is gone).
"""

from __future__ import annotations

import importlib
import json
import mmap
import socket
import struct
import sys
import types
from pathlib import Path

import numpy as np

_PREAMBLE = struct.Struct("<III")
_COLUMNS = 6
_WORD_SIZES = (1, 2, 4, 8)


def _load_chunks() -> types.ModuleType:
    """This directory's `_chunks` as a module of a stand-in package (no torch import)."""
    pkg = types.ModuleType("_flotilla_codec")
    pkg.__path__ = [str(Path(__file__).resolve().parent)]
    sys.modules["_flotilla_codec"] = pkg
    return importlib.import_module("_flotilla_codec._chunks")


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = sock.recv(n - len(data), socket.MSG_WAITALL)
        if not more:
            raise EOFError
        data += more
    return data


def _encode(
    C: types.ModuleType, maps: dict[int, mmap.mmap], rows: list[tuple[int, ...]], ws: object, hasher, chunk_bytes: int
) -> tuple[list[bytes], list[bytes]]:
    def view(aid: int, off: int, n: int, w: int) -> np.ndarray:
        mm = maps.get(aid)
        if mm is None:
            raise ValueError(f"unknown arena {aid}")
        if off < 0 or off + n * w > len(mm):
            raise ValueError(f"chunk at {off}+{n * w} runs past arena {aid} ({len(mm)} bytes)")
        return np.frombuffer(mm, C.word_dtype(w), n, off)

    frames, digests = [], []
    for old_id, old_off, new_id, new_off, n, w in rows:
        if w not in _WORD_SIZES or n < 0:
            raise ValueError(f"bad chunk: {n} words of {w} bytes")
        old = None if old_id == -1 else view(old_id, old_off, n, w)  # -1: a keyframe chunk
        new = view(new_id, new_off, n, w)
        # The scan is picked per chunk here (per tensor in the caller): it never changes the frame.
        sparse = old is not None and C.looks_sparse(old, new, chunk_bytes)
        frames.append(C.encode_chunk(old, new, ws, sparse=sparse))
        digests.append(hasher(new))
    return frames, digests


def main(fd: int) -> None:
    C = _load_chunks()
    sock = socket.socket(fileno=fd)
    maps: dict[int, mmap.mmap] = {}
    spaces: dict[int, object] = {}
    sock.sendall(b"R")
    while True:
        try:
            pre, fds, _, _ = socket.recv_fds(sock, _PREAMBLE.size, 16)
            if not pre:
                return
            pre += _read(sock, _PREAMBLE.size - len(pre))
            head_len, njobs, nfds = _PREAMBLE.unpack(pre)
            head = json.loads(_read(sock, head_len))
            flat = struct.unpack(f"<{njobs * _COLUMNS}q", _read(sock, 8 * _COLUMNS * njobs))
        except EOFError:
            return
        try:
            if len(fds) != nfds or len(head["arenas"]) != nfds:
                raise ValueError(f"{len(fds)} descriptors arrived, {nfds} announced")
            for aid, f, size in zip(head["arenas"], fds, head["sizes"], strict=True):
                maps[aid] = mmap.mmap(f, size, prot=mmap.PROT_READ)
            for aid in head["drop"]:
                mm = maps.pop(aid, None)
                if mm is not None:
                    mm.close()
            level = int(head["level"])
            ws = spaces.get(level) or spaces.setdefault(level, C.Workspace(level))
            rows = [flat[i : i + _COLUMNS] for i in range(0, len(flat), _COLUMNS)]
            frames, digests = _encode(C, maps, rows, ws, C.HASHERS[head["algo"]], int(head["chunk_bytes"]))
        except (ValueError, KeyError, TypeError, OSError) as e:
            msg = f"{type(e).__name__}: {e}".encode()
            sock.sendall(struct.pack("<I", len(msg)) + msg)
            continue
        finally:
            for f in fds:
                _close(f)
        sock.sendall(struct.pack(f"<I{len(frames)}I", 0, *map(len, frames)) + b"".join(digests))
        for f in frames:
            sock.sendall(f)


def _close(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass


if __name__ == "__main__":
    main(int(sys.argv[1]))
