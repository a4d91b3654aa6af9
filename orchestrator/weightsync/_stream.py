"""Keyframes streamed in parts, so neither side holds two full copies of a snapshot.

A keyframe sent as one ``WeightMessage`` costs the publisher the whole compressed keyframe
and the receiver the whole message *plus* the decoded snapshot. Streamed, the publisher
encodes the chunks of one part (at most ``part_bytes`` of raw snapshot) at a time, and the
receiver decodes each part straight into a snapshot it allocated from the first part's
table of tensors, then drops it. Extra memory: the parts in flight on each side (plus, on
the receiver, the snapshot it is building, which is the result).

Parts are plain wire values (a JSON-able header dict and a list of frames: zstd chunks,
sent as zero-copy frames by the runtime), so they travel as arguments of ordinary actor
calls, in order (calls from one caller to one actor are processed in order).

Part header: ``seq`` (0, 1, ...), ``version``, ``precision``, ``hash_algo``, ``chunk_bytes``;
part 0 adds ``tensors`` (name, dtype, shape of every tensor); each part lists its chunks as
``[tensor index, chunk index, first word, digest hex]`` (frames in the same order); the last
part has ``last: true`` and ``hashes``, each tensor's hash over its chunk digests -- the
same value ``encode_keyframe`` puts in ``TensorMeta.hash``.

Errors: a part out of order, a malformed header, a chunk that does not decode
(``CorruptPayloadError``) or whose bytes do not match its digest (``HashMismatchError``)
raise at once; the assembler is then unusable and its partial snapshot must be dropped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ._chunks import HASHERS, Workspace, decode_xor_into, default_hash_algo, encode_chunk, tree_hash, word_dtype
from ._codec import DEFAULT_CHUNK_BYTES, Snapshot, _chunk_size, _dtype, _run, _split, _words
from ._errors import CorruptPayloadError, HashMismatchError, MalformedMessageError, StructureMismatchError

__all__ = ["KeyframeAssembler", "stream_keyframe"]

DEFAULT_PART_BYTES = 64 << 20


def stream_keyframe(
    snapshot: Mapping[str, torch.Tensor],
    version: int,
    precision: str,
    *,
    part_bytes: int = DEFAULT_PART_BYTES,
    threads: int = 2,
    level: int = 1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    compress: bool = True,
    hash_algo: str | None = None,
) -> Iterator[tuple[dict[str, Any], list[Any]]]:
    """Yield ``(header, frames)`` parts of a keyframe of ``snapshot``, encoded lazily.

    Each part is encoded (on ``threads`` workers) only when the consumer asks for it, so
    the publisher holds one part at a time. ``compress=False`` sends the chunks' raw bytes
    instead (header ``raw: true``): the frames are views of the snapshot itself (zero-copy,
    no encoding cost, wire = raw size), for links faster than zstd compresses bf16
    weights on the publisher's cores. The snapshot must not change until the last part has been *sent*.
    """
    algo = hash_algo or default_hash_algo()
    if algo not in HASHERS:
        raise ValueError(f"hash_algo {algo!r} unavailable here; have {sorted(HASHERS)}")
    hasher = HASHERS[algo]
    names = list(snapshot)
    largest = max((t.numel() * t.element_size() for t in snapshot.values()), default=0)
    cb = _chunk_size(chunk_bytes, largest, threads)
    plan: list[tuple[int, int, int, int]] = []  # tensor, chunk, start word, stop word
    for i, name in enumerate(names):
        t = snapshot[name]
        for c, (s, e) in enumerate(_split(_words(t, name).size, _word_size(t), cb)):
            plan.append((i, c, s, e))
    digests: list[list[bytes]] = [[] for _ in names]
    head = {"version": version, "precision": precision, "hash_algo": algo, "chunk_bytes": cb}
    seq, k = 0, 0
    while k < len(plan) or seq == 0:
        group, raw = [], 0
        while k < len(plan) and (not group or raw + _nbytes(snapshot, names, plan[k]) <= part_bytes):
            group.append(plan[k])
            raw += _nbytes(snapshot, names, plan[k])
            k += 1
        jobs = []
        for i, _c, s, e in group:
            w = _words(snapshot[names[i]], names[i])[s:e]
            if compress:
                jobs.append(lambda ws, w=w: (encode_chunk(None, w, ws), hasher(w)))
            else:
                jobs.append(lambda ws, w=w: (memoryview(w).cast("B"), hasher(w)))
        results = _run(jobs, threads, level)
        header: dict[str, Any] = {**head, "seq": seq, "chunks": [], "raw": not compress}
        if seq == 0:
            header["tensors"] = [
                [n, str(snapshot[n].dtype).removeprefix("torch."), list(snapshot[n].shape)] for n in names
            ]
        frames = []
        for (i, c, s, _e), (frame, digest) in zip(group, results, strict=True):  # type: ignore[misc]
            header["chunks"].append([i, c, s, digest.hex()])
            digests[i].append(digest)
            frames.append(frame)
        if k == len(plan):
            header["last"] = True
            header["hashes"] = {n: tree_hash(algo, digests[i]) for i, n in enumerate(names)}
        yield header, frames
        seq += 1


def _word_size(t: torch.Tensor) -> int:
    return word_dtype(t.element_size()).itemsize


def _nbytes(snapshot: Mapping[str, torch.Tensor], names: list[str], item: tuple[int, int, int, int]) -> int:
    i, _c, s, e = item
    return (e - s) * _word_size(snapshot[names[i]])


class KeyframeAssembler:
    """Builds a snapshot from streamed keyframe parts (see the module docstring).

    ``feed(header, frames)`` for each part in order; after the last, ``done`` is True and
    ``snapshot``/``version``/``hashes`` hold the result, bit-identical to the publisher's.
    """

    def __init__(self, *, threads: int = 2) -> None:
        self._threads = threads
        self._next = 0
        self._words: list[np.ndarray] = []
        self._names: list[str] = []
        self._digests: list[list[bytes]] = []
        self.snapshot: Snapshot = {}
        self.version: int | None = None
        self.precision: str | None = None
        self.hashes: dict[str, str] = {}
        self.done = False

    def feed(self, header: dict[str, Any], frames: list[Any]) -> bool:
        """Decode one part into the snapshot; True once the keyframe is complete and verified."""
        if self.done:
            raise MalformedMessageError("keyframe already complete")
        if header.get("seq") != self._next:
            raise MalformedMessageError(f"keyframe part {header.get('seq')!r} arrived, expected {self._next}")
        if self._next == 0:
            self._start(header)
        elif header.get("version") != self.version:
            raise MalformedMessageError(f"part of version {header.get('version')!r} in keyframe v{self.version}")
        chunks = header.get("chunks")
        if not isinstance(chunks, list) or len(chunks) != len(frames):
            raise MalformedMessageError("part lists a different number of chunks than it has frames")
        hasher = HASHERS[self._algo]
        per = self._chunk_bytes
        raw = header.get("raw") is True

        def job(item: list[Any], frame: Any):
            i, c, s, digest = item
            target = self._words[i]
            n = max(1, per // target.dtype.itemsize)
            if not (
                isinstance(s, int)
                and isinstance(c, int)
                and 0 <= s < max(1, target.size)
                and s == c * n
                and isinstance(digest, str)
            ):
                raise MalformedMessageError(f"chunk {c!r} starts at word {s!r}", tensor=self._names[i])
            view = target[s : s + n]

            def run(ws: Workspace) -> bytes:
                if raw:
                    data = memoryview(frame).cast("B")
                    if data.nbytes != view.nbytes:
                        raise CorruptPayloadError(
                            f"chunk {c}: {data.nbytes} raw bytes for a {view.nbytes}-byte chunk", tensor=self._names[i]
                        )
                    np.copyto(view, np.frombuffer(data, dtype=view.dtype))
                else:
                    decode_xor_into(frame, view, ws, tensor=self._names[i], chunk=c, overwrite=True)
                got = hasher(view)
                if got.hex() != digest:
                    raise HashMismatchError(f"chunk {c} decodes to other bytes than were sent", tensor=self._names[i])
                return got

            return run

        for item in chunks:
            if not (
                isinstance(item, list)
                and len(item) == 4
                and isinstance(item[0], int)
                and 0 <= item[0] < len(self._words)
            ):
                raise MalformedMessageError(f"bad chunk entry {item!r}")
        results = _run([job(item, f) for item, f in zip(chunks, frames, strict=True)], self._threads)
        for item, r in zip(chunks, results, strict=True):
            if isinstance(r, Exception):
                raise r
            self._digests[item[0]].append(r)  # type: ignore[arg-type]
        self._next += 1
        if header.get("last"):
            self._finish(header)
        return self.done

    def _start(self, header: dict[str, Any]) -> None:
        tensors, algo = header.get("tensors"), header.get("hash_algo")
        if not isinstance(tensors, list) or algo not in HASHERS or not isinstance(header.get("version"), int):
            raise MalformedMessageError("first keyframe part lacks its tensor table, version or hash")
        self.version, self.precision, self._algo = header["version"], header.get("precision"), algo
        cb = header.get("chunk_bytes")
        if not isinstance(cb, int) or cb < 8:
            raise MalformedMessageError(f"bad chunk_bytes {cb!r}")
        self._chunk_bytes = cb
        for entry in tensors:
            name, dtype, shape = entry
            t = torch.zeros(shape, dtype=_dtype(dtype, name))  # zero pages: XOR-decoding writes them once
            self.snapshot[name] = t
            self._names.append(name)
            self._words.append(_words(t, name))
            self._digests.append([])

    def _finish(self, header: dict[str, Any]) -> None:
        hashes = header.get("hashes")
        if not isinstance(hashes, dict) or set(hashes) != set(self._names):
            raise StructureMismatchError("last keyframe part does not hash every tensor")
        for i, name in enumerate(self._names):
            got = tree_hash(self._algo, self._digests[i])
            if got != hashes[name]:
                raise HashMismatchError("tensor hash differs (chunks missing or reordered)", tensor=name)
        self.hashes = dict(hashes)
        self.done = True
