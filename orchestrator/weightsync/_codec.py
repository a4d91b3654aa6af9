"""Encode and apply weight messages: deltas between snapshots, and keyframes.

A *snapshot* is `dict[str, torch.Tensor]` of contiguous CPU tensors of any
dtype. Work is split into chunks (see `_chunks`) and run by `threads` workers:
the calling thread plus helpers from a process-wide pool (`_run`), each with
its own zstd contexts and scratch, kept between calls.

Memory: besides the snapshots, the message and the per-tensor hash digests,
encoding and applying hold only the workers' scratch, O(threads x
chunk_bytes); the chunk size is capped at largest_tensor_bytes / (8 x threads)
(never below 4 KiB) so that scratch stays under one copy of the largest
tensor even for tiny models. A thread's scratch stays allocated after a call
(at its largest chunk so far), so the next call allocates nothing.

Atomicity (`apply`): a delta is applied chunk by chunk in place, hashing each
chunk's new bytes as it goes. If any chunk fails to decode or any tensor's
hash disagrees, every chunk already applied is XORed again with its
(deterministically re-decoded) change, which restores it exactly, because
XOR is its own inverse. So a failed apply leaves the target bit-identical to
before, without a staging copy. A keyframe overwrites rather than XORs, so
it is checked in a first pass (decode into scratch, hash, discard) and
written in a second.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from ._auth import seal
from ._changes import NO_CHANGE, Changes, chunk_positions, gather_changes
from ._chunks import (
    HASHERS,
    Workspace,
    decode_xor_into,
    default_hash_algo,
    encode_chunk,
    looks_sparse,
    tree_hash,
    word_dtype,
)
from ._errors import DeltaError, HashMismatchError, MalformedMessageError, StructureMismatchError
from ._message import MessageMeta, Precision, TensorMeta, WeightMessage
from ._shared import Job, encode_on_helpers, locate

__all__ = ["Snapshot", "apply", "decode_keyframe", "encode_delta", "encode_keyframe", "snapshot_bytes"]

Snapshot = dict[str, torch.Tensor]
T = TypeVar("T")

DEFAULT_CHUNK_BYTES = 4 << 20
_MIN_CHUNK = 4096
_PARALLEL_APPLY_CHUNK = 1 << 20
"""Deltas cut into smaller chunks are applied by one thread. Decoding a delta's chunk is
a string of short numpy calls, and two workers hand the GIL back and forth between them,
so below this size a second thread costs more than it brings; above it, threads win.
Keyframes always use the threads: their dense chunks decode in a few long calls."""


_HELPER_CHUNK = 1 << 20
"""Snapshots in shared memory cut into smaller chunks are encoded by helper processes
(`_shared`), larger ones by threads. Small chunks mean many short numpy calls, and
threads hand the GIL back and forth between them, while processes share no GIL. Large
chunks are a few long calls each, so threads scale, and a helper's frames would cost a
copy through its socket."""


def snapshot_bytes(snapshot: Mapping[str, torch.Tensor]) -> int:
    """Raw bytes of a snapshot (what the GB/s figures are measured against)."""
    return sum(t.numel() * t.element_size() for t in snapshot.values())


def _words(t: torch.Tensor, name: str) -> np.ndarray:
    """The tensor's storage as a numpy word array (shares memory)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise StructureMismatchError("must be a contiguous CPU tensor", tensor=name)
    raw = t.detach().reshape(-1).view(torch.uint8).numpy()
    return raw.view(word_dtype(t.element_size()))


def _dtype(name: str, tensor: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise MalformedMessageError(f"unknown dtype {name!r}", tensor=tensor)
    return dt


def _chunk_size(requested: int, largest: int, threads: int) -> int:
    """`requested`, capped so the largest tensor still splits into 6 jobs per thread:
    enough to balance the workers and to keep their scratch (up to ~6 chunks a worker,
    when applying mixed layouts) under one copy of the largest tensor. Smaller chunks
    only add numpy calls, and every call hands the GIL between the workers."""
    cap = max(_MIN_CHUNK, largest // (6 * threads))
    return max(8, min(requested, cap) // 8 * 8)


@dataclass(frozen=True, slots=True)
class _Chunk:
    tensor: int  # index in meta.tensors
    index: int  # chunk index within the tensor
    frame: int  # index in message.frames
    start: int  # first word
    stop: int


def _split(nwords: int, wsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    per = chunk_bytes // wsize
    return [(s, min(s + per, nwords)) for s in range(0, nwords, per)]


def _run(jobs: list[Callable[[Workspace], T]], threads: int, level: int = 1) -> list[T | DeltaError]:
    """Run jobs on `threads` workers; a DeltaError is returned in its slot, not raised.

    The calling thread is one of the workers and the others come from a pool kept for
    the process (`_helpers`), so a call starts no thread. Workers take the next job
    index from a shared counter rather than one future per job: a message of many
    small tensors costs one hand-off per helper, not one per chunk, which matters on
    a loaded machine where every wake-up of a waiting thread may wait for a time
    slice. Each thread keeps its `Workspace` (zstd contexts, scratch) between calls.
    Any other exception is raised after every worker has stopped touching the inputs.
    """
    n = len(jobs)
    results: list[T | DeltaError | None] = [None] * n
    counter = itertools.count()

    def work() -> None:
        ws = _workspace(level)
        for i in counter:  # itertools.count's next() is atomic under the GIL
            if i >= n:
                return
            try:
                results[i] = jobs[i](ws)
            except DeltaError as e:
                results[i] = e

    helpers = min(threads, n) - 1
    if helpers <= 0:
        work()
        return results  # type: ignore[return-value]
    pool = _helpers(helpers)
    futures = [pool.submit(work) for _ in range(helpers)]
    try:
        work()
    finally:
        errors = [f.exception() for f in futures]  # waits for each
    for e in errors:
        if e is not None:
            raise e
    return results  # type: ignore[return-value]


_local = threading.local()
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _workspace(level: int) -> Workspace:
    """This thread's workspace for zstd `level` (made on first use, then reused)."""
    spaces: dict[int, Workspace] | None = getattr(_local, "spaces", None)
    if spaces is None:
        spaces = _local.spaces = {}
    ws = spaces.get(level)
    if ws is None:
        ws = spaces[level] = Workspace(level)
    return ws


def _helpers(n: int) -> ThreadPoolExecutor:
    """A process-wide pool of `n` helper threads (idle ones cost nothing but a stack)."""
    with _pools_lock:
        pool = _pools.get(n)
        if pool is None:
            pool = _pools[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="weightsync")
        return pool


def _check_same(prev: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> None:
    for name in new:
        if name not in prev:
            raise StructureMismatchError("in the new snapshot but not in the previous one", tensor=name)
    for name, p in prev.items():
        q = new.get(name)
        if q is None:
            raise StructureMismatchError("in the previous snapshot but not in the new one", tensor=name)
        if p.dtype != q.dtype or p.shape != q.shape:
            raise StructureMismatchError(
                f"changed from {p.dtype} {tuple(p.shape)} to {q.dtype} {tuple(q.shape)}", tensor=name
            )


def _helper_rows(
    prev: Mapping[str, torch.Tensor] | None,
    new: Mapping[str, torch.Tensor],
    names: list[str],
    wsizes: list[int],
    spans: list[tuple[int, int, int]],
) -> list[Job] | None:
    """The chunks as helper processes see them (`_shared.Job`), or None unless every
    tensor of both snapshots lies in shared memory."""
    at = []
    for n in names:
        if new[n].numel() == 0:  # no chunks (and no address to locate)
            at.append(((-1, 0), (-1, 0)))
            continue
        a_new = locate(new[n])
        a_old = (-1, 0) if prev is None else locate(prev[n])
        if a_new is None or a_old is None:
            return None
        at.append((a_old, a_new))
    rows = []
    for i, s, e in spans:
        (old_id, old_off), (new_id, new_off) = at[i]
        w = wsizes[i]
        rows.append((old_id, old_off + s * w if old_id >= 0 else 0, new_id, new_off + s * w, e - s, w))
    return rows


def _encode(
    prev: Mapping[str, torch.Tensor] | None,
    new: Mapping[str, torch.Tensor],
    *,
    version: int,
    base_version: int | None,
    precision: Precision,
    threads: int,
    level: int,
    chunk_bytes: int,
    hash_algo: str | None,
    auth_key: bytes | None,
) -> WeightMessage:
    algo = hash_algo or default_hash_algo()
    if algo not in HASHERS:
        raise ValueError(f"hash_algo {algo!r} unavailable here; have {sorted(HASHERS)}")
    largest = max((t.numel() * t.element_size() for t in new.values()), default=0)
    cb = _chunk_size(chunk_bytes, largest, threads)
    hasher = HASHERS[algo]
    names = list(new)
    wsizes = [word_dtype(new[n].element_size()).itemsize for n in names]
    spans = [
        (i, s, e)
        for i, n in enumerate(names)
        for s, e in _split(new[n].numel() * new[n].element_size() // wsizes[i], wsizes[i], cb)
    ]
    owner = [i for i, _, _ in spans]
    arrays: dict[int, tuple[np.ndarray | None, np.ndarray, bool]] = {}

    def job(k: int) -> Callable[[Workspace], tuple[bytes, bytes]]:
        i, s, e = spans[k]
        got = arrays.get(i)
        if got is None:  # once per tensor: its word arrays, and which scan suits it
            q = _words(new[names[i]], names[i])
            p = None if prev is None else _words(prev[names[i]], names[i])
            got = arrays[i] = (p, q, p is not None and looks_sparse(p, q, cb))
        p, q, sparse = got
        qs, ps = q[s:e], None if p is None else p[s:e]
        return lambda ws: (encode_chunk(ps, qs, ws, sparse=sparse), hasher(qs))

    results = None
    rows = _helper_rows(prev, new, names, wsizes, spans) if threads > 1 and cb < _HELPER_CHUNK else None
    if rows is not None:  # both snapshots in shared memory: helper processes, no GIL between them
        results = encode_on_helpers(
            rows,
            threads - 1,
            level=level,
            algo=algo,
            chunk_bytes=cb,
            digest_size=len(hasher(b"")),
            run_here=lambda idx: _run([job(k) for k in idx], 1, level),
        )
    if results is None:
        results = _run([job(k) for k in range(len(spans))], threads, level)
    frames: list[bytes] = []
    per_tensor: list[tuple[list[int], list[bytes]]] = [([], []) for _ in names]
    for i, (frame, digest) in zip(owner, results, strict=True):  # type: ignore[misc]
        frames.append(frame)
        per_tensor[i][0].append(len(frame))
        per_tensor[i][1].append(digest)
    metas = [  # built from checked tensors: skip validation (receivers validate what they parse)
        TensorMeta.model_construct(
            name=name,
            dtype=str(new[name].dtype).removeprefix("torch."),
            shape=tuple(new[name].shape),
            hash=tree_hash(algo, digests),
            chunks=tuple(lens),
        )
        for name, (lens, digests) in zip(names, per_tensor, strict=True)
    ]
    meta = MessageMeta(
        version=version,
        base_version=base_version,
        encoding="keyframe-zstd" if prev is None else "xor-zstd",
        precision=precision,
        hash_algo=algo,  # type: ignore[arg-type]
        chunk_bytes=cb,
        tensors=tuple(metas),
    )
    return seal(WeightMessage(meta, frames), auth_key)


def encode_delta(
    prev: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    version: int,
    base_version: int,
    precision: Precision,
    *,
    threads: int = 2,
    level: int = 1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    hash_algo: str | None = None,
    auth_key: bytes | None = None,
) -> WeightMessage:
    """Delta taking snapshot `prev` (at `base_version`) to `new` (at `version`).

    Both snapshots must hold the same names with the same dtypes and shapes,
    as contiguous CPU tensors; neither is modified. Raises
    StructureMismatchError naming the first offending tensor, ValueError for
    an unavailable hash_algo. The message is sealed (`weightsync.seal`) with
    `auth_key` (None: an unkeyed digest).
    """
    _check_same(prev, new)
    return _encode(
        prev, new, version=version, base_version=base_version, precision=precision,
        threads=threads, level=level, chunk_bytes=chunk_bytes, hash_algo=hash_algo,
        auth_key=auth_key,
    )  # fmt: skip


def encode_keyframe(
    snapshot: Mapping[str, torch.Tensor],
    version: int,
    precision: Precision,
    *,
    threads: int = 2,
    level: int = 1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    hash_algo: str | None = None,
    auth_key: bytes | None = None,
) -> WeightMessage:
    """Full compressed snapshot at `version`. Raises StructureMismatchError for
    a non-contiguous or non-CPU tensor. Sealed with `auth_key` like a delta."""
    return _encode(
        None, snapshot, version=version, base_version=None, precision=precision,
        threads=threads, level=level, chunk_bytes=chunk_bytes, hash_algo=hash_algo,
        auth_key=auth_key,
    )  # fmt: skip


def _plan(meta: MessageMeta, target: Mapping[str, torch.Tensor]) -> tuple[list[np.ndarray], list[_Chunk]]:
    """Validate a message's metadata against target and cut it into chunk jobs. Raises before any write."""
    if meta.hash_algo not in HASHERS:
        raise MalformedMessageError(f"hash {meta.hash_algo!r} is not available here (install xxhash)")
    wanted = {t.name for t in meta.tensors}
    for name in target:
        if name not in wanted:
            raise StructureMismatchError("in the target snapshot but not in the message", tensor=name)
    words: list[np.ndarray] = []
    chunks: list[_Chunk] = []
    frame = 0
    for i, tm in enumerate(meta.tensors):
        dt = _dtype(tm.dtype, tm.name)
        t = target.get(tm.name)
        if t is None:
            raise StructureMismatchError("not in the target snapshot", tensor=tm.name)
        if t.dtype != dt or tuple(t.shape) != tm.shape:
            raise StructureMismatchError(
                f"message has {tm.dtype} {list(tm.shape)}, target has "
                f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}",
                tensor=tm.name,
            )
        w = _words(t, tm.name)
        spans = _split(w.size, w.dtype.itemsize, meta.chunk_bytes)
        if len(spans) != len(tm.chunks):
            raise MalformedMessageError(f"{len(tm.chunks)} chunks listed, {len(spans)} expected", tensor=tm.name)
        words.append(w)
        for j, (s, e) in enumerate(spans):
            chunks.append(_Chunk(i, j, frame, s, e))
            frame += 1
    return words, chunks


def _verify(meta: MessageMeta, chunks: list[_Chunk], results: list[bytes | DeltaError]) -> DeltaError | None:
    digests: list[list[bytes]] = [[] for _ in meta.tensors]
    for c, r in zip(chunks, results, strict=True):
        if isinstance(r, DeltaError):
            return r
        digests[c.tensor].append(r)
    for tm, ds in zip(meta.tensors, digests, strict=True):
        got = tree_hash(meta.hash_algo, ds)
        if got != tm.hash:
            return HashMismatchError(f"hash of new bytes is {got}, message says {tm.hash}", tensor=tm.name)
    return None


def apply(
    message: WeightMessage, target: Mapping[str, torch.Tensor], *, threads: int = 2, changes: bool = False
) -> Changes | None:
    """Apply `message` to `target` in place, exactly, verifying every tensor's hash.
    With `changes`, returns for a delta what it changed (`Changes`); otherwise, and for
    a keyframe, None.

    A delta needs target to hold the message's base version; a keyframe
    overwrites whatever target holds. Target must hold exactly the message's
    tensor names, dtypes and shapes, as contiguous CPU tensors.

    Errors (all DeltaError subclasses, each naming the tensor): Structure-
    MismatchError, MalformedMessageError (chunk count, unknown dtype/hash),
    CorruptPayloadError (zstd failure, bad body), HashMismatchError. On any
    of them target is left bit-identical to before (see module docstring).
    Version bookkeeping is the caller's (`WeightReceiver`).
    """
    return _apply(message, target, threads=threads, fresh=False, changes=changes)


def _apply(
    message: WeightMessage, target: Mapping[str, torch.Tensor], *, threads: int, fresh: bool, changes: bool = False
) -> Changes | None:
    """fresh: target is all zeros and may be left garbage on error, so a
    keyframe is applied in one pass like a delta against zeros. With `changes`,
    returns a delta's `Changes` (word positions are element positions: every
    dtype a snapshot holds has an item size of 1, 2, 4 or 8 bytes)."""
    meta = message.meta
    words, chunks = _plan(message.meta, target)
    if meta.chunk_bytes < _PARALLEL_APPLY_CHUNK and not meta.is_keyframe:
        threads = 1
    hasher = HASHERS[meta.hash_algo]
    frames = message.frames
    name = [t.name for t in meta.tensors]

    keyframe = meta.is_keyframe  # a keyframe's chunks overwrite (see decode_xor_into)

    found: list[np.ndarray | None] = [NO_CHANGE] * len(chunks)  # changed positions by chunk; None: dense

    def xor_job(c: _Chunk, *, digest: bool, k: int = -1) -> Callable[[Workspace], bytes]:
        def job(ws: Workspace) -> bytes:
            view = words[c.tensor][c.start : c.stop]
            pos = decode_xor_into(
                frames[c.frame], view, ws, tensor=name[c.tensor], chunk=c.index, overwrite=keyframe, positions=k >= 0
            )
            if k >= 0:  # each job writes its own slot only
                found[k] = chunk_positions(pos, view.size, c.start, words[c.tensor].size)
            return hasher(view) if digest else b""

        return job

    def scratch_job(c: _Chunk) -> Callable[[Workspace], bytes]:
        def job(ws: Workspace) -> bytes:
            w = words[c.tensor]
            view = ws.buf("verify", (c.stop - c.start) * w.dtype.itemsize, w.dtype)
            decode_xor_into(frames[c.frame], view, ws, tensor=name[c.tensor], chunk=c.index, overwrite=True)
            return hasher(view)

        return job

    if keyframe and not fresh:
        error = _verify(meta, chunks, _run([scratch_job(c) for c in chunks], threads))
        if error is not None:
            raise error
        _raise_first(_run([xor_job(c, digest=False) for c in chunks], threads))
        return
    track = changes and not keyframe
    results = _run([xor_job(c, digest=True, k=k if track else -1) for k, c in enumerate(chunks)], threads)
    error = _verify(meta, chunks, results)
    if error is not None and not fresh:
        applied = [c for c, r in zip(chunks, results, strict=True) if not isinstance(r, DeltaError)]
        _raise_first(_run([xor_job(c, digest=False) for c in applied], threads))
    if error is not None:
        raise error
    if not track:
        return None
    return gather_changes(name, [w.size for w in words], [c.tensor for c in chunks], found)


def _raise_first(results: list[bytes | DeltaError]) -> None:
    for r in results:
        if isinstance(r, DeltaError):  # cannot happen: these frames decoded once already
            raise RuntimeError(f"weightsync: a chunk that decoded before failed on re-decode: {r}") from r


def decode_keyframe(message: WeightMessage, *, threads: int = 2) -> Snapshot:
    """A new snapshot from a keyframe (allocates it; nothing else is touched).

    Raises MalformedMessageError for a delta or an unknown dtype,
    CorruptPayloadError, HashMismatchError; nothing is returned then.
    """
    if not message.is_keyframe:
        raise MalformedMessageError(f"decode_keyframe needs a keyframe, got a delta from {message.base_version}")
    snapshot: Snapshot = {
        tm.name: torch.zeros(tm.shape, dtype=_dtype(tm.dtype, tm.name)) for tm in message.meta.tensors
    }
    _apply(message, snapshot, threads=threads, fresh=True)
    return snapshot
