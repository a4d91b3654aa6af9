"""Delta encoding in few, large numpy calls: the change scan runs over whole memory runs.

`encode_chunk` finds one chunk's changes in ~40 numpy calls. On a small model (a
few dozen tensors, chunks of a few hundred KB) most of an encode is then per-call
overhead under the GIL, and a second thread adds hand-offs of the GIL, not speed.
Here the scan runs once per *range* (several chunks, up to a whole snapshot):

* A *run* is a stretch of memory holding several tensors of one item size, laid out
  identically in the previous and the new snapshot (same storage offsets relative
  to the run's start). A publisher's flat snapshot (`wire_snapshot(..., flat=True)`)
  is one run per item size; any other snapshot is one run per tensor. Bytes between
  a run's tensors (alignment padding) are scanned too, and their changes, if any,
  are dropped: they belong to no chunk.
* A range (chunks of one run, split between the workers) is scanned in ~15 calls:
  changed 8-byte groups, then changed words inside them, as `encode_chunk` does per
  chunk. Each chunk's changes are then a slice of the range's; a chunk whose changes
  fit the gaps layout is assembled from strided views of the range's gap and value
  bytes in one `np.concatenate`, and compressed.
* A chunk that needs another layout (bitmap, dense), or whose bytes are not aligned
  to the 8-byte groups, goes through `encode_chunk` itself.

The frames are byte-identical to `encode_chunk`'s (the layout decision and the body
are the same; tested), so receivers are unchanged.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ._chunks import Workspace, to_planes, encode_chunk, word_dtype

__all__ = ["Range", "plan_ranges", "encode_range"]

_MAX_PAD = 4096  # bytes between two tensors that may still share a run


@dataclass(frozen=True, slots=True)
class _Tensor:
    index: int  # in the message's tensor order
    offset: int  # first word, relative to the run
    words: int


@dataclass(slots=True)
class Range:
    """Chunks [first, last) of one run, scanned together by one worker."""

    prev: np.ndarray  # the run's words (previous snapshot)
    new: np.ndarray
    chunks: list[tuple[int, int, int, int]]  # (tensor index, chunk index, start word, stop word), run-relative


def _storage_view(t: torch.Tensor) -> tuple[int, int]:
    """(storage data pointer, byte offset of t in it)."""
    return t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size()


def _region(t: torch.Tensor, start: int, stop: int) -> np.ndarray:
    """Bytes [start, stop) of t's storage as a numpy uint8 array (shares memory)."""
    whole = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return whole[start:stop].numpy()


def _runs(names: Sequence[str], prev: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
          ) -> list[tuple[np.ndarray, np.ndarray, list[_Tensor]]]:
    """Group tensors into runs (see the module docstring); (prev words, new words, tensors)."""
    entries = []
    for i, name in enumerate(names):
        q, p = new[name], prev[name]
        (qs, qo), (ps, po) = _storage_view(q), _storage_view(p)
        entries.append((q.element_size(), qs, ps, qo, po, i, q.numel() * q.element_size()))
    entries.sort()
    runs: list[list[tuple]] = []
    for e in entries:
        w, qs, ps, qo, po, _i, nbytes = e
        if runs:
            last = runs[-1]
            w0, qs0, ps0, qo0, po0, _, _ = last[0]
            _, _, _, qe, _, _, ne = last[-1]
            end = qe + ne
            if (w, qs, ps) == (w0, qs0, ps0) and qo - qo0 == po - po0 and 0 <= qo - end <= _MAX_PAD:
                last.append(e)
                continue
        runs.append([e])
    out = []
    for run in runs:
        w, _, _, q0, p0, _, _ = run[0]
        _, _, _, qe, _, _, ne = run[-1]
        size = qe + ne - q0
        dt = word_dtype(w)
        first_q, first_p = new[names[run[0][5]]], prev[names[run[0][5]]]
        qwords = _region(first_q, q0, q0 + size).view(dt)
        pwords = _region(first_p, p0, p0 + size).view(dt)
        tensors = [_Tensor(i, (qo - q0) // dt.itemsize, nb // dt.itemsize) for _, _, _, qo, _, i, nb in run]
        out.append((pwords, qwords, tensors))
    return out


def plan_ranges(names: Sequence[str], prev: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor],
                split: Callable[[int, int], list[tuple[int, int]]], target_bytes: int) -> list[Range]:
    """The chunks of every tensor (as `split(words, item size)` cuts them), grouped into
    ranges of about `target_bytes` that never cross a run."""
    ranges: list[Range] = []
    for pwords, qwords, tensors in _runs(names, prev, new):
        w = qwords.dtype.itemsize
        current: Range | None = None
        size = 0
        for t in tensors:
            for j, (s, e) in enumerate(split(t.words, w)):
                if current is None or size >= target_bytes:
                    current = Range(pwords, qwords, [])
                    ranges.append(current)
                    size = 0
                current.chunks.append((t.index, j, t.offset + s, t.offset + e))
                size += (e - s) * w
    return ranges


def _changes(p: np.ndarray, q: np.ndarray, a: int, b: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Changes of words [a, b): (positions, x = old ^ new at them, indices of the changed
    8-byte groups, counted from word a; for 8-byte words, the changed words). None when
    so many groups changed that no chunk of the range could take the gaps layout as a
    whole: then positions would cost more memory than they save (`encode_chunk` decides
    chunk by chunk instead)."""
    w = q.dtype.itemsize
    r = 8 // w if w < 8 else 1
    full = (b - a) // r * r  # words covered by whole groups
    qg = q[a:a + full].view("<u8") if r > 1 else q[a:a + full]
    pg = p[a:a + full].view("<u8") if r > 1 else p[a:a + full]
    mask = np.not_equal(pg, qg)
    if int(np.count_nonzero(mask)) * r * (4 + w) > 1.5 * (b - a) * w:
        return None
    gpos = np.flatnonzero(mask)
    del mask
    gx = np.take(qg, gpos, mode="clip")
    np.bitwise_xor(gx, np.take(pg, gpos, mode="clip"), out=gx)
    if r > 1:
        words = gx.view(q.dtype)
        sub = np.flatnonzero(words != 0)
        vals = np.take(words, sub, mode="clip")
        del words, gx
        shift = r.bit_length() - 1
        pos = np.take(gpos, sub >> shift, mode="clip")
        np.left_shift(pos, shift, out=pos)
        np.bitwise_or(pos, sub & (r - 1), out=pos)
        del sub
    else:
        pos, vals = gpos, gx
    if full < b - a:  # the last words, short of a group
        tail = np.flatnonzero(np.not_equal(p[a + full:b], q[a + full:b])) + full
        tx = np.bitwise_xor(np.take(q[a:b], tail), np.take(p[a:b], tail))
        pos, vals = np.concatenate([pos, tail]), np.concatenate([vals, tx])
    pos += a
    return pos, vals, gpos


def encode_range(rng: Range, ws: Workspace, hasher: Callable[[object], bytes]
                 ) -> list[tuple[int, int, bytes, bytes]]:
    """(tensor index, chunk index, frame, digest of the new bytes) for each chunk of `rng`."""
    p, q = rng.prev, rng.new
    w = q.dtype.itemsize
    r = 8 // w if w < 8 else 1
    a, b = rng.chunks[0][2], rng.chunks[-1][3]
    found = _changes(p, q, a, b)
    if found is None:
        return [(ti, ci, encode_chunk(p[s:e], q[s:e], ws), hasher(q[s:e])) for ti, ci, s, e in rng.chunks]
    pos, vals, gpos = found
    out: list[tuple[int, int, bytes, bytes]] = []
    starts = np.array([c[2] for c in rng.chunks], dtype=np.int64)
    stops = np.array([c[3] for c in rng.chunks], dtype=np.int64)
    lo, hi = np.searchsorted(pos, starts), np.searchsorted(pos, stops)
    glo = np.searchsorted(gpos, (starts - a) // r)
    ghi = np.searchsorted(gpos, (stops - a) // r)
    n = pos.size
    gaps = np.empty(n, "<u4")
    if n:
        np.subtract(pos[1:], pos[:-1], out=gaps[1:], casting="unsafe")
        firsts = lo[lo < hi]
        gaps[firsts] = pos[firsts] - starts[lo < hi] + 1
    gplanes, vplanes = np.empty(4 * n, np.uint8), np.empty(w * n, np.uint8)
    to_planes(gaps, gplanes)
    to_planes(vals, vplanes)
    gp = [gplanes[c * n:(c + 1) * n] for c in range(4)]
    vp = [vplanes[c * n:(c + 1) * n] for c in range(w)]
    for k, (ti, ci, s, e) in enumerate(rng.chunks):
        m = e - s
        nnz = int(hi[k] - lo[k])
        groups = int(ghi[k] - glo[k])
        aligned = r == 1 or ((s - a) * w % 8 == 0 and m * w % 8 == 0)
        # encode_chunk's choice (`_gap_changes`): gaps unless the changed groups, then the
        # changed words, say that a bitmap or a dense body is smaller.
        if not aligned or groups * r * (4 + w) > 1.5 * m * w or nnz * (4 + w) > m * w:
            frame = encode_chunk(p[s:e], q[s:e], ws)
        else:
            i, j = int(lo[k]), int(hi[k])
            head = np.frombuffer(struct.pack("<BI", 1, nnz), np.uint8)
            body = np.concatenate([head, *(x[i:j] for x in gp), *(x[i:j] for x in vp)])
            frame = bytes(memoryview(ws.cctx.compress(body)))
        out.append((ti, ci, frame, hasher(q[s:e])))
    return out
