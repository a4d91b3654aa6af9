"""Per-chunk kernels: XOR, three sparse/dense layouts, byte planes, zstd, hashing.

A tensor's raw bytes are cut every `chunk_bytes` bytes; each chunk is one zstd
frame. A chunk is read as m little-endian words of the tensor's item size w
(1, 2, 4 or 8 bytes; other item sizes as single bytes). Its change words
x = old ^ new (for a keyframe old = 0) are laid out before compression as one
of (nnz = number of nonzero x):

* gaps (1), few changes: ``1 | nnz:u32le | gap planes | value planes`` with
  gap_i = pos_i - pos_{i-1} (pos_{-1} = -1, so gaps >= 1) as u32, and the
  nonzero x in position order. Near the entropy bound when changes are rare.
* bitmap (2), many changes: ``2 | nnz:u32le | ceil(m/8) bitmap bytes (LSB
  first) | value planes``. Cheaper to build and smaller than gaps once more
  than ~10% of words change.
* dense (0), nearly everything changed (keyframes): ``0 | planes of all x``.

Byte planes put byte j of every word together: a small bf16 change flips only
low mantissa bits, so the high plane is zeros and costs almost nothing, and
gaps below 256 leave three planes of zeros.

Everything runs as numpy, xxhash/hashlib and zstd calls on large buffers,
which release the GIL, so chunks run in parallel on a thread pool; zstd
contexts are not thread-safe, so each worker owns a `Workspace`. Per chunk of
L bytes a worker holds at most ~8 L of scratch (index arrays are int64).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import zstandard

from ._errors import CorruptPayloadError

__all__ = [
    "HASHERS",
    "Workspace",
    "decode_xor_into",
    "default_hash_algo",
    "encode_changes",
    "encode_chunk",
    "looks_sparse",
    "tree_hash",
    "word_dtype",
]

_DENSE, _GAPS, _BITMAP = 0, 1, 2
_BLOCK = 1 << 18  # words per bitmap-decode step, bounding its int64 positions
_WORD = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def _sha256(buf) -> bytes:
    return hashlib.sha256(buf).digest()


HASHERS: dict[str, Callable[[object], bytes]] = {"sha256": _sha256}
try:  # xxh3 hashes several times faster than sha256 per core, and releases the GIL.
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


def _fast_params(level: int) -> zstandard.ZstdCompressionParameters | None:
    """zstd parameters for the fast levels (<= 1): matches of 7+ bytes and a 64-entry
    hash table. Byte planes of weights and of their changes hold few long repeats, so
    the default match search mostly costs time without shrinking the output; the
    literals' entropy coding, where the gain is, stays. None (plain `level`) above 1.
    Figures: benchmarks/records/2026-11-30-weightsync.md."""
    if level > 1:
        return None
    return zstandard.ZstdCompressionParameters.from_level(
        level, min_match=7, hash_log=6, search_log=1, write_content_size=True
    )


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
            params = _fast_params(self._level)
            self._cctx = (
                zstandard.ZstdCompressor(level=self._level, write_content_size=True)
                if params is None
                else zstandard.ZstdCompressor(compression_params=params)
            )
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


def _to_planes(words: np.ndarray, out: np.ndarray) -> None:
    """Byte j of every word -> out[j*n:(j+1)*n]. Consumes `words` (shifted in place)."""
    n, w = words.size, words.dtype.itemsize
    for j in range(w):
        np.copyto(out[j * n : (j + 1) * n], words, casting="unsafe")  # keeps the low byte
        if j + 1 < w:
            np.right_shift(words, 8, out=words)


def _xor_planes_into(planes: np.ndarray, target: np.ndarray, tmp: np.ndarray) -> None:
    """target ^= words assembled from byte planes (tmp: scratch words like target)."""
    n, w = target.size, target.dtype.itemsize
    for j in range(w):
        np.copyto(tmp, planes[j * n : (j + 1) * n], casting="unsafe")
        if j:
            np.left_shift(tmp, 8 * j, out=tmp)
        np.bitwise_xor(target, tmp, out=target)


def _write_planes_into(planes: np.ndarray, target: np.ndarray) -> None:
    """target = words assembled from byte planes, highest byte first (Horner: shift, OR)."""
    n, w = target.size, target.dtype.itemsize
    np.copyto(target, planes[(w - 1) * n : w * n], casting="unsafe")
    for j in range(w - 2, -1, -1):
        np.left_shift(target, 8, out=target)
        np.bitwise_or(target, planes[j * n : (j + 1) * n], out=target, casting="unsafe")


def _from_planes(planes: np.ndarray, dtype: np.dtype, n: int) -> np.ndarray:
    out = np.zeros(n, dtype)
    if n:
        _xor_planes_into(planes, out, np.empty(n, dtype))
    return out


def _planes_into(words: np.ndarray, out: np.ndarray) -> None:
    """Byte j of every word -> out[j*n:(j+1)*n], in one strided copy (``words`` untouched).

    Slower per byte than `_to_planes`' shifts, but one numpy call instead of 2w - 1: for
    the small gap and value arrays of a delta, what costs is the calls -- each one a
    release and re-take of the GIL that the other worker thread may be holding."""
    n, w = words.size, words.dtype.itemsize
    out.reshape(w, n)[...] = words.view(np.uint8).reshape(n, w).T


_SPARSE = (0.003, 0.1)
"""Below this fraction of changed words (estimated from a sample), changes are found
8-byte groups first: the first figure for chunks under 1 MiB, the second for larger
ones. A scan of every word is cheap while the chunk fits in cache and dearer beyond, so
large chunks gain from the group scan up to a larger changed fraction than small ones,
which gain only when almost nothing changed."""


def looks_sparse(old: np.ndarray, new: np.ndarray, chunk_bytes: int) -> bool:
    """Whether a sample of every 1021st word has fewer changed than `_SPARSE` allows for
    chunks of `chunk_bytes` (a few microseconds; it only picks `encode_chunk`'s scan,
    never the layout). Asked once per tensor by the calling thread, before the workers
    start: inside a worker every extra numpy call is one more hand-over of the GIL
    between the workers."""
    limit = _SPARSE[chunk_bytes >= 1 << 20]
    a, b = old[::1021], new[::1021]
    return a.size > 0 and np.count_nonzero(a != b) < limit * a.size


def _sparse_changes(old: np.ndarray, new: np.ndarray, ws: Workspace) -> tuple[np.ndarray, np.ndarray]:
    """(positions, x values) of the changed words, found 8-byte groups first.

    np.flatnonzero costs ~1 ns per element scanned, so finding changed groups and
    then changed words inside only those is ~3x cheaper for bf16 than scanning every
    word -- while changes are sparse; at a few percent of words changed the second
    pass costs more than it saves.
    """
    m, w = new.size, new.dtype.itemsize
    r = 8 // w if w < 8 and (m * w) % 8 == 0 else 1
    wide_new, wide_old = (new.view("<u8"), old.view("<u8")) if r > 1 else (new, old)
    mask = ws.buf("mask", wide_new.size, np.dtype(bool))
    np.not_equal(wide_old, wide_new, out=mask)
    # Indices come from flatnonzero, so they are in range: mode="clip" skips
    # numpy's bounds-checked, buffered path.
    gpos = np.flatnonzero(mask)
    gx = np.take(wide_new, gpos, mode="clip")
    np.bitwise_xor(gx, np.take(wide_old, gpos, mode="clip"), out=gx)
    if r == 1:
        return gpos, gx
    words = gx.view(new.dtype)
    sub = np.flatnonzero(words != 0)  # nonzero() on bool is ~2x faster than on ints
    vals = np.take(words, sub, mode="clip")
    del words, gx
    low = (sub & (r - 1)).astype(np.uint8)
    shift = r.bit_length() - 1
    np.right_shift(sub, shift, out=sub)
    pos = np.take(gpos, sub, mode="clip")
    del sub, gpos
    np.left_shift(pos, shift, out=pos)
    np.bitwise_or(pos, low, out=pos, casting="unsafe")
    return pos, vals


def _xor_words(old: np.ndarray | None, new: np.ndarray, ws: Workspace) -> np.ndarray:
    """``old ^ new`` (a copy of ``new`` when old is None) in ``ws``'s scratch."""
    x = ws.buf("words", new.size * new.dtype.itemsize, new.dtype)
    if old is None:
        np.copyto(x, new)
    else:
        np.bitwise_xor(old, new, out=x)
    return x


def _header(body: np.ndarray, mode: int, nnz: int) -> None:
    body[0] = mode
    body[1:5].view("<u4")[0] = nnz


def _gaps_body(pos: np.ndarray, vals: np.ndarray) -> np.ndarray:
    nnz, w = pos.size, vals.dtype.itemsize
    gaps = np.empty(nnz, "<u4")
    if nnz:
        gaps[0] = pos[0] + 1
        np.subtract(pos[1:], pos[:-1], out=gaps[1:], casting="unsafe")
    body = np.empty(5 + (4 + w) * nnz, np.uint8)
    _header(body, _GAPS, nnz)
    _planes_into(gaps, body[5 : 5 + 4 * nnz])
    _planes_into(vals, body[5 + 4 * nnz :])
    return body


def encode_chunk(old: np.ndarray | None, new: np.ndarray, ws: Workspace, *, sparse: bool = False) -> bytes:
    """One zstd frame for the change from `old` to `new` (word arrays of equal
    size; old None means zeros, i.e. a keyframe chunk); `sparse`: few words changed
    (`looks_sparse`), so they are found 8-byte groups first.

    The layout: gaps while their body is no larger than the words (up to a third of
    bf16 words changed; they compress best), else a bitmap while it saves a tenth, else
    dense planes. Few numpy calls per chunk: two worker threads share the GIL between
    their calls.
    """
    m, w = new.size, new.dtype.itemsize
    nbits = (m + 7) // 8
    if sparse and old is not None:
        pos, vals = _sparse_changes(old, new, ws)
        if (4 + w) * pos.size <= m * w:
            return bytes(memoryview(ws.cctx.compress(_gaps_body(pos, vals))))
        del pos, vals  # the sample misled: scan again below
    changed = ws.buf("changed", m, np.dtype(bool))
    if old is None:  # a keyframe: nearly every word nonzero, positions would be waste
        np.not_equal(new, 0, out=changed)
        nnz = int(np.count_nonzero(changed))
        pos = np.flatnonzero(changed) if nbits + w * nnz <= 0.9 * w * m else None
    else:
        np.not_equal(old, new, out=changed)
        pos = np.flatnonzero(changed)
        nnz = pos.size
    gaps = (4 + w) * nnz <= m * w
    if pos is not None and (gaps or nbits + w * nnz <= 0.9 * w * m):
        # Only the changed words are XORed: a pass over the chunk saved.
        vals = np.take(new, pos, mode="clip")
        if old is not None:
            np.bitwise_xor(vals, np.take(old, pos, mode="clip"), out=vals)
        if gaps:
            body = _gaps_body(pos, vals)
        else:
            del pos
            body = np.empty(5 + nbits + w * nnz, np.uint8)
            _header(body, _BITMAP, nnz)
            body[5 : 5 + nbits] = np.packbits(changed, bitorder="little")
            _planes_into(vals, body[5 + nbits :])
    else:
        del pos
        x = _xor_words(old, new, ws)
        body = ws.buf("body", 1 + m * w, np.dtype(np.uint8))
        body[0] = _DENSE
        _to_planes(x, body[1:])
    # python-zstandard returns a bytes object that keeps its compressBound-sized
    # allocation (only the length is trimmed); copy so a stored delta costs its
    # wire size in memory, not its raw size.
    return bytes(memoryview(ws.cctx.compress(body)))


def encode_changes(pos: np.ndarray, vals: np.ndarray, m: int, ws: Workspace) -> bytes:
    """The frame `encode_chunk(old, new)` makes, from the change alone: `pos` the positions
    of the changed words of an `m`-word chunk, ascending, and `vals` their `old ^ new` words
    (numpy word dtype). For the gaps layout this touches only the changes; otherwise the
    XOR words are laid out in scratch and encoded against zeros, which `encode_chunk` turns
    into the same positions, values and layout (its choices depend on `old ^ new` alone)."""
    w = vals.dtype.itemsize
    if (4 + w) * pos.size <= m * w:
        return bytes(memoryview(ws.cctx.compress(_gaps_body(pos, vals))))
    x = ws.buf("xwords", m * w, vals.dtype)
    x[...] = 0
    x[pos] = vals
    zeros = ws.buf("zwords", m * w, vals.dtype)
    zeros[...] = 0
    return encode_chunk(zeros, x, ws)


def decode_xor_into(
    frame,
    target: np.ndarray,
    ws: Workspace,
    *,
    tensor: str,
    chunk: int,
    overwrite: bool = False,
    positions: bool = False,
) -> np.ndarray | None:
    """target ^= the change words carried by `frame` (target: word array); with
    `overwrite`, target = those words (a keyframe chunk over whatever target held:
    a dense body is assembled straight into target, in half the passes of an XOR).

    With `positions`, returns the ascending int64 positions (within the chunk) of the
    words the frame marks as changed (exactly the words whose value changed), or None
    for a dense body (any word may have changed). Without it, always None.

    Decompresses and validates the whole body before writing, so on any
    CorruptPayloadError (bad frame, wrong size, positions out of range)
    `target` is untouched. A frame that decodes cleanly to wrong values is
    caught later by the hash.
    """
    m, w = target.size, target.dtype.itemsize
    nbits = (m + 7) // 8
    limit = 5 + max((4 + w) * m, nbits + w * m)

    def bad(problem: str) -> CorruptPayloadError:
        return CorruptPayloadError(f"chunk {chunk}: {problem}", tensor=tensor)

    try:
        size = zstandard.frame_content_size(frame)
        if size < 0 or size > limit:
            raise bad(f"frame declares {size} bytes, at most {limit} allowed")
        body = np.frombuffer(ws.dctx.decompress(frame, allow_extra_data=False), np.uint8)
    except zstandard.ZstdError as e:
        raise bad(f"zstd: {e}") from None
    mode = int(body[0]) if body.size else -1
    if mode == _DENSE:
        if body.size != 1 + m * w:
            raise bad(f"dense body is {body.size} bytes, expected {1 + m * w}")
        if overwrite:
            _write_planes_into(body[1:], target)
        else:
            _xor_planes_into(body[1:], target, ws.buf("words", m * w, target.dtype))
        return None
    if mode not in (_GAPS, _BITMAP) or body.size < 5:
        raise bad(f"unknown chunk layout {mode}")
    nnz = int(body[1:5].view("<u4")[0])
    index_bytes = 4 * nnz if mode == _GAPS else nbits
    if nnz > m or body.size != 5 + index_bytes + w * nnz:
        raise bad(f"body of {body.size} bytes does not fit {nnz} changes")
    if nnz == 0:
        if overwrite:
            target.fill(0)
        return np.empty(0, np.int64) if positions else None
    vals = _from_planes(body[5 + index_bytes :], target.dtype, nnz)
    if mode == _GAPS:
        gaps = _from_planes(body[5 : 5 + index_bytes], np.dtype("<u4"), nnz)
        pos = np.cumsum(gaps, dtype=np.int64)
        pos -= 1
        if gaps.min() == 0 or pos[-1] >= m:
            raise bad("change positions repeat or run past the chunk")
        if overwrite:
            target.fill(0)
        target[pos] ^= vals
        return pos if positions else None
    bits = body[5 : 5 + nbits]
    changed = np.unpackbits(bits, count=m, bitorder="little").view(bool)
    if int(np.count_nonzero(changed)) != nnz or np.count_nonzero(np.unpackbits(bits)) != nnz:
        raise bad(f"bitmap does not mark exactly {nnz} changes")
    if overwrite:
        target.fill(0)
    done = 0
    found: list[np.ndarray] = []
    for start in range(0, m, _BLOCK):  # blockwise, so positions stay O(_BLOCK)
        pos = np.flatnonzero(changed[start : start + _BLOCK])
        pos += start
        target[pos] ^= vals[done : done + pos.size]
        done += pos.size
        if positions:
            found.append(pos)
    return np.concatenate(found).astype(np.int64, copy=False) if positions else None
