"""Per-chunk kernels: XOR, sparse/dense layout, byte planes, zstd, hashing.

A tensor's raw bytes are cut every `chunk_bytes` bytes; each chunk is one zstd
frame. A chunk is read as little-endian words of the tensor's item size
(1, 2, 4 or 8 bytes; other item sizes as single bytes). Its *change word*
x = old ^ new (for a keyframe, old = 0) is laid out before compression as:

* sparse (few changed words): ``b"\\x01" | nnz:u32le | gap planes | value planes``
  with gap_i = pos_i - pos_{i-1} (pos_{-1} = -1, so every gap >= 1) as u32 and
  the changed words' x values, each array split into byte planes;
* dense: ``b"\\x00" | value planes`` of all m words.

Byte planes put byte j of every word together. A small bf16 change only
flips low mantissa bits, so the high plane is zeros and costs almost nothing;
gaps below 256 leave three planes of zeros. Sparse wins while
nnz * (4 + w) <= m * w raw bytes (bf16: up to a third of the words changed).

Every kernel here is numpy, hashlib/xxhash or zstd on large buffers, all of
which release the GIL, so chunks run in parallel on a thread pool. zstd
contexts are not thread-safe: each worker thread owns a `Workspace`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import zstandard

from ._errors import CorruptPayloadError

__all__ = ["HASHERS", "Workspace", "decode_xor_into", "default_hash_algo", "encode_chunk", "tree_hash", "word_dtype"]

_SPARSE, _DENSE = 1, 0
_WORD = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def _sha256(buf) -> bytes:
    return hashlib.sha256(buf).digest()


HASHERS: dict[str, Callable[[object], bytes]] = {"sha256": _sha256}
try:  # xxh3 is ~10 GB/s per core against sha256's ~1.2, and releases the GIL.
    import xxhash

    HASHERS["xxh3-128"] = xxhash.xxh3_128_digest
except ImportError:  # pragma: no cover - exercised only where xxhash is absent
    pass


def default_hash_algo() -> str:
    """xxh3-128 when the `xxhash` package is installed, else sha256."""
    return "xxh3-128" if "xxh3-128" in HASHERS else "sha256"


def tree_hash(algo: str, chunk_digests: list[bytes]) -> str:
    """Tensor hash: `algo` over the concatenated per-chunk digests, hex."""
    return HASHERS[algo](b"".join(chunk_digests)).hex()


def word_dtype(itemsize: int) -> np.dtype:
    """Word used to diff a tensor of this item size (odd sizes: bytes)."""
    return _WORD.get(itemsize, _WORD[1])


class Workspace:
    """One worker thread's zstd contexts and scratch buffers (not thread-safe).

    Scratch buffers are sized by the largest chunk seen and reused, so they
    never grow with the tensor size; zstd contexts are made on first use.
    """

    def __init__(self, level: int) -> None:
        self._level = level
        self._cctx: zstandard.ZstdCompressor | None = None
        self._dctx: zstandard.ZstdDecompressor | None = None
        self._bufs: dict[str, np.ndarray] = {}

    @property
    def cctx(self) -> zstandard.ZstdCompressor:
        if self._cctx is None:
            self._cctx = zstandard.ZstdCompressor(level=self._level, write_content_size=True)
        return self._cctx

    @property
    def dctx(self) -> zstandard.ZstdDecompressor:
        if self._dctx is None:
            self._dctx = zstandard.ZstdDecompressor()
        return self._dctx

    def buf(self, key: str, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """Scratch `key` viewed as `dtype`, grown to at least `nbytes` (never shrunk)."""
        b = self._bufs.get(key)
        if b is None or b.size < nbytes:
            b = self._bufs[key] = np.empty(nbytes, np.uint8)
        return b[:nbytes].view(dtype)


def _to_planes(words: np.ndarray, out: np.ndarray, *, destroy: bool) -> None:
    """Byte j of every word -> out[j*n:(j+1)*n]. With destroy, shifts `words` in place."""
    n, w = words.size, words.dtype.itemsize
    if w == 1:
        np.copyto(out[:n], words)
        return
    src = words if destroy else words.copy()
    for j in range(w):
        np.copyto(out[j * n : (j + 1) * n], src, casting="unsafe")  # keeps the low byte
        if j + 1 < w:
            np.right_shift(src, 8, out=src)


def _xor_planes_into(planes: np.ndarray, target: np.ndarray, tmp: np.ndarray) -> None:
    """target ^= words assembled from byte planes (tmp: scratch words like target)."""
    n, w = target.size, target.dtype.itemsize
    for j in range(w):
        np.copyto(tmp, planes[j * n : (j + 1) * n], casting="unsafe")
        if j:
            np.left_shift(tmp, 8 * j, out=tmp)
        np.bitwise_xor(target, tmp, out=target)


def _from_planes(planes: np.ndarray, dtype: np.dtype, n: int) -> np.ndarray:
    out = np.zeros(n, dtype)
    if n:
        _xor_planes_into(planes, out, np.empty(n, dtype))
    return out


def encode_chunk(old: np.ndarray | None, new: np.ndarray, ws: Workspace) -> bytes:
    """One zstd frame for the change from `old` to `new` (word arrays of equal
    size; old None means zeros, i.e. a keyframe chunk)."""
    m, w = new.size, new.dtype.itemsize
    mask = ws.buf("mask", m, np.dtype(bool))
    if old is None:
        np.not_equal(new, 0, out=mask)
    else:
        np.not_equal(old, new, out=mask)
    nnz = int(np.count_nonzero(mask))
    if nnz * (4 + w) <= m * w:
        pos = np.flatnonzero(mask)
        vals = new[pos] if old is None else np.bitwise_xor(old[pos], new[pos])
        gaps = np.diff(pos, prepend=-1).astype("<u4")
        body = np.empty(5 + (4 + w) * nnz, np.uint8)
        body[0] = _SPARSE
        body[1:5] = np.frombuffer(np.uint32(nnz).astype("<u4").tobytes(), np.uint8)
        _to_planes(gaps, body[5 : 5 + 4 * nnz], destroy=True)
        _to_planes(vals, body[5 + 4 * nnz :], destroy=True)
    else:
        x = ws.buf("words", m * w, new.dtype)
        if old is None:
            np.copyto(x, new)
        else:
            np.bitwise_xor(old, new, out=x)
        body = ws.buf("body", 1 + m * w, np.dtype(np.uint8))
        body[0] = _DENSE
        _to_planes(x, body[1:], destroy=True)
    return ws.cctx.compress(body)


def decode_xor_into(frame, target: np.ndarray, ws: Workspace, *, tensor: str, chunk: int) -> None:
    """target ^= the change word carried by `frame` (target: word array).

    Decompresses and validates the whole body before writing, so on any
    CorruptPayloadError (bad frame, wrong size, positions out of range)
    `target` is untouched. A frame that decodes cleanly to wrong values is
    caught later by the hash.
    """
    m, w = target.size, target.dtype.itemsize
    limit = 5 + (4 + w) * m
    where = f"chunk {chunk}: "
    try:
        size = zstandard.frame_content_size(frame)
        if size < 0 or size > limit:
            raise CorruptPayloadError(where + f"frame declares {size} bytes, at most {limit} allowed", tensor=tensor)
        body = np.frombuffer(ws.dctx.decompress(frame, allow_extra_data=False), np.uint8)
    except zstandard.ZstdError as e:
        raise CorruptPayloadError(where + f"zstd: {e}", tensor=tensor) from None
    if body.size == 0:
        raise CorruptPayloadError(where + "empty body", tensor=tensor)
    mode = int(body[0])
    if mode == _DENSE:
        if body.size != 1 + m * w:
            raise CorruptPayloadError(where + f"dense body is {body.size} bytes, expected {1 + m * w}", tensor=tensor)
        _xor_planes_into(body[1:], target, ws.buf("words", m * w, target.dtype))
        return
    if mode != _SPARSE or body.size < 5:
        raise CorruptPayloadError(where + f"unknown chunk layout {mode}", tensor=tensor)
    nnz = int(body[1:5].view("<u4")[0])
    if nnz > m or body.size != 5 + (4 + w) * nnz:
        raise CorruptPayloadError(where + f"sparse body of {body.size} bytes does not fit {nnz} changes", tensor=tensor)
    if nnz == 0:
        return
    gaps = _from_planes(body[5 : 5 + 4 * nnz], np.dtype("<u4"), nnz)
    pos = np.cumsum(gaps, dtype=np.int64)
    pos -= 1
    if gaps.min() == 0 or pos[-1] >= m:
        raise CorruptPayloadError(where + "change positions repeat or run past the chunk", tensor=tensor)
    vals = _from_planes(body[5 + 4 * nnz :], target.dtype, nnz)
    target[pos] ^= vals
