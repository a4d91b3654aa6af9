"""A stored keyframe sent in parts and decoded part by part into the receiver's snapshot.

`stream_keyframe` (see `_stream`) encodes a snapshot on the fly; a `WeightPublisher`
already holds its newest keyframe encoded and sealed, so a run sends *that* message in
parts instead: no second encode per receiver, and the metadata keeps its seal (digest or,
with an auth key, MAC), which the receiver checks before it writes anything.

A part is a plain wire value, ``(header, frames)``: the frames are consecutive chunk
frames of the message (whole frames, as many as fit in ``part_bytes`` of wire bytes, at
least one), the header a JSON-able dict ``{"seq", "parts", "version", "first"}`` where
``first`` is the index of the part's first frame; part 0 also carries ``"meta"``, the
message's sealed metadata JSON. `part_plan` cuts a message the same way every time, so a
sender can answer "part k of keyframe v" without keeping any state between calls.

The receiving side (`PartAssembler`, driven by `WeightReceiver.apply_part`) decodes each
part's chunks straight into a target snapshot (overwriting it, so it needs no zeroing
first), hashes each chunk's new bytes as it goes, and checks a tensor's hash as soon as
its last chunk is in. Extra memory: the part in flight and the workers' scratch.

Errors (all `DeltaError`): a part out of order, of another version, with frames that
disagree with the metadata (`MalformedMessageError`); a chunk that does not decode
(`CorruptPayloadError`); a tensor whose bytes do not match its hash (`HashMismatchError`,
naming it). The target then holds a mix of old and new bytes and must be dropped; the
assembler refuses any further part.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from typing_extensions import Buffer

from ._chunks import HASHERS, Workspace, decode_xor_into, tree_hash
from ._codec import _Chunk, _plan, _run
from ._errors import DeltaError, HashMismatchError, MalformedMessageError
from ._message import MessageMeta, WeightMessage, _parse_meta

__all__ = ["DEFAULT_PART_BYTES", "PartAssembler", "message_part", "message_parts", "parse_first", "part_plan"]

DEFAULT_PART_BYTES = 64 << 20


def part_plan(meta: MessageMeta, part_bytes: int) -> list[tuple[int, int]]:
    """``(first frame, frame count)`` of each part: consecutive frames up to
    ``part_bytes`` wire bytes, at least one frame a part (one empty part for a message
    without frames, so that its metadata still travels)."""
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
    sizes = [n for t in meta.tensors for n in t.chunks]
    plan: list[tuple[int, int]] = []
    first, size = 0, 0
    for i, n in enumerate(sizes):
        if i > first and size + n > part_bytes:
            plan.append((first, i - first))
            first, size = i, 0
        size += n
    plan.append((first, len(sizes) - first))
    return plan


def message_part(
    message: WeightMessage,
    seq: int,
    part_bytes: int = DEFAULT_PART_BYTES,
    plan: Sequence[tuple[int, int]] | None = None,
) -> tuple[dict[str, Any], list[Buffer]]:
    """Part ``seq`` of ``message`` (frames are the message's own buffers, not copies).
    Raises ValueError for a ``seq`` outside the plan."""
    plan = part_plan(message.meta, part_bytes) if plan is None else plan
    if not 0 <= seq < len(plan):
        raise ValueError(f"part {seq} of a {len(plan)}-part message")
    first, count = plan[seq]
    header: dict[str, Any] = {"seq": seq, "parts": len(plan), "version": message.version, "first": first}
    if seq == 0:
        header["meta"] = message.meta_json.decode()
    return header, list(message.frames[first : first + count])


def message_parts(
    message: WeightMessage, part_bytes: int = DEFAULT_PART_BYTES
) -> Iterator[tuple[dict[str, Any], list[Buffer]]]:
    """Every part of ``message``, in order."""
    plan = part_plan(message.meta, part_bytes)
    for seq in range(len(plan)):
        yield message_part(message, seq, plan=plan)


def parse_first(header: Mapping[str, Any]) -> MessageMeta:
    """The metadata carried by part 0 (not yet checked against its seal)."""
    if header.get("seq") != 0 or not isinstance(header.get("meta"), str):
        raise MalformedMessageError(
            f"part {header.get('seq')!r} arrived first; a stream starts with part 0 and its metadata"
        )
    return _parse_meta(header["meta"].encode())


class PartAssembler:
    """Decodes the parts of one keyframe message into ``target`` (see the module docstring).

    ``meta`` must be the (already verified) metadata of part 0; ``target`` a snapshot of
    exactly its tensors, dtypes and shapes (StructureMismatchError otherwise), whose bytes
    are overwritten.
    """

    def __init__(self, meta: MessageMeta, target: Mapping[str, torch.Tensor], *, threads: int = 2) -> None:
        if not meta.is_keyframe:
            raise MalformedMessageError(f"only keyframes are streamed; got a delta from {meta.base_version}")
        if meta.hash_algo not in HASHERS:
            raise MalformedMessageError(f"hash {meta.hash_algo!r} is not available here (install xxhash)")
        self.meta = meta
        self._words, self._chunks = _plan(meta, target)
        self._lengths = [n for t in meta.tensors for n in t.chunks]
        self._digests: list[list[bytes]] = [[] for _ in meta.tensors]
        self._threads = threads
        self._next = 0
        self._cursor = 0
        self._parts: int | None = None
        self._broken = False
        self.done = False

    def feed(self, header: Mapping[str, Any], frames: Sequence[Buffer]) -> bool:
        """Decode one part; True once every chunk is in and every tensor's hash matched."""
        if self._broken or self.done:
            raise MalformedMessageError("keyframe stream already " + ("failed" if self._broken else "complete"))
        try:
            self._feed(header, frames)
        except BaseException:
            self._broken = True
            raise
        return self.done

    def _feed(self, header: Mapping[str, Any], frames: Sequence[Buffer]) -> None:
        meta = self.meta
        seq, parts, first = header.get("seq"), header.get("parts"), header.get("first")
        if seq != self._next:
            raise MalformedMessageError(f"keyframe part {seq!r} arrived, expected {self._next}")
        if header.get("version") != meta.version:
            raise MalformedMessageError(f"part of version {header.get('version')!r} in keyframe v{meta.version}")
        if not isinstance(parts, int) or parts < 1 or (self._parts is not None and parts != self._parts):
            raise MalformedMessageError(f"part count {parts!r} changed or invalid (was {self._parts})")
        if first != self._cursor or len(frames) > len(self._lengths) - self._cursor:
            raise MalformedMessageError(
                f"part {seq} holds frames {first!r}..+{len(frames)}, "
                f"expected from {self._cursor} of {len(self._lengths)}"
            )
        self._parts = parts
        views = [memoryview(f).cast("B") for f in frames]
        for k, v in enumerate(views):
            c = self._chunks[self._cursor + k]
            if v.nbytes != self._lengths[self._cursor + k]:
                raise MalformedMessageError(
                    f"chunk {c.index} is {v.nbytes} bytes, metadata says {self._lengths[self._cursor + k]}",
                    tensor=meta.tensors[c.tensor].name,
                )
        chunks = self._chunks[self._cursor : self._cursor + len(views)]
        results = _run([self._job(c, v) for c, v in zip(chunks, views, strict=True)], self._threads)
        for c, r in zip(chunks, results, strict=True):
            if isinstance(r, DeltaError):
                raise r
            self._digests[c.tensor].append(r)  # type: ignore[arg-type]
            tm = meta.tensors[c.tensor]
            if c.index == len(tm.chunks) - 1:  # the tensor's last chunk: check its hash now
                got = tree_hash(meta.hash_algo, self._digests[c.tensor])
                if got != tm.hash:
                    raise HashMismatchError(
                        f"hash of the streamed bytes is {got}, message says {tm.hash}", tensor=tm.name
                    )
        self._cursor += len(views)
        self._next += 1
        last = self._next == parts
        if last != (self._cursor == len(self._lengths)):
            raise MalformedMessageError(
                f"part {seq} of {parts} leaves {len(self._lengths) - self._cursor} chunk frames unsent"
            )
        if last:
            for tm, ds in zip(meta.tensors, self._digests, strict=True):
                if not tm.chunks and tree_hash(meta.hash_algo, ds) != tm.hash:  # empty tensors
                    raise HashMismatchError("hash of an empty tensor differs", tensor=tm.name)
            self.done = True

    def _job(self, c: _Chunk, frame: memoryview):
        name = self.meta.tensors[c.tensor].name
        hasher = HASHERS[self.meta.hash_algo]
        view: np.ndarray = self._words[c.tensor][c.start : c.stop]

        def run(ws: Workspace) -> bytes:
            decode_xor_into(frame, view, ws, tensor=name, chunk=c.index, overwrite=True)
            return hasher(view)

        return run
