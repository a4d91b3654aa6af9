"""Sending one sampler its weight path: the keyframe in parts, then the deltas after it.

The trainer answers `update_path` with the deltas themselves and, where the path starts
with a keyframe, only its version and part count. The keyframe is then moved one part
(at most `PART_BYTES` of wire bytes, whole chunk frames) at a time: fetched from the
trainer, which slices its stored, sealed keyframe (`weightsync.message_part`), and
handed to the sampler, which decodes it into the memory of its own snapshot
(`WeightReceiver.apply_part`). The controller holds one part at a time, the trainer
nothing beyond the keyframe it stores anyway, the sampler no second snapshot.

Errors: the trainer refusing a part because a newer keyframe replaced the one being
sent raises `KeyframeGone` (start over); anything the sampler refuses arrives as its
`ActorError` (it keeps the weights in use and needs a keyframe); `ActorDied` passes through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

from orchestrator.controller.links import PoolLink, TrainerLink
from orchestrator.runtime import ActorError

__all__ = ["PART_BYTES", "KeyframeGone", "PendingAcks", "SharedPaths", "send_path"]

PART_BYTES = 64 << 20
"""Wire bytes of keyframe per part: big enough that a part's fixed costs vanish, small
enough that the part in flight is a small fraction of a multi-GB snapshot."""


class KeyframeGone(Exception):
    """The trainer no longer holds the keyframe being streamed (a newer one replaced it)."""


async def send_path(
    trainer: TrainerLink, pool: PoolLink, rank: int, precision: str, path: dict[str, Any], part_bytes: int = PART_BYTES
) -> tuple[int, int]:
    """Apply `path` (from `trainer.update_path(..., part_bytes)`) on sampler `rank` of
    `pool`; returns the version it uses afterwards and the wire bytes moved."""
    wire = 0
    now: int | None = None
    keyframe = path["keyframe"]
    if keyframe is not None:
        for seq in range(keyframe["parts"]):
            try:
                header, frames = await trainer.keyframe_part(precision, keyframe["version"], seq, part_bytes)
            except ActorError as e:
                raise KeyframeGone(
                    f"keyframe v{keyframe['version']} part {seq}: {e.remote_type}: {e.message}"
                ) from None
            wire += sum(len(memoryview(f)) for f in frames)
            now = await pool.apply_weights_part(rank, header, frames)
            del header, frames  # hold one part at a time
    deltas = path["deltas"]
    if deltas or now is None:
        wire += sum(len(memoryview(f)) for d in deltas for f in d)
        now = await pool.apply_weights(rank, deltas)
    return now, wire


@dataclass
class _Fetch:
    done: trio.Event = field(default_factory=trio.Event)
    path: dict[str, Any] | None = None  # None once done: the fetch failed


class SharedPaths:
    """The trainer's `update_path` answers, shared by every sampler rank that needs the same
    one. Ranks that hold the same version of the same precision need the same messages, so
    a fleet asks the trainer once per (precision, held version) and trainer version instead
    of once per rank, and a delta crosses the trainer's link once. Concurrent askers wait
    for the first one's call; if that call fails (or its caller is cancelled) each of them
    asks again. `clear` when the trainer went back to a checkpoint: its versions then
    name other weights."""

    def __init__(self, trainer: TrainerLink) -> None:
        self._trainer = trainer
        self._paths: dict[tuple[str, int, int], _Fetch] = {}

    def clear(self) -> None:
        self._paths.clear()

    async def get(self, receiver: str, have: int, precision: str, version: int) -> dict[str, Any]:
        """The path from `have` (-1: nothing) to the trainer's newest weights, `version` being
        the newest the caller knows of (answers for older ones are let go)."""
        key = (precision, have, version)
        while (fetch := self._paths.get(key)) is not None:
            await fetch.done.wait()
            if fetch.path is not None:
                return fetch.path
        for old in [k for k in self._paths if k[2] != version]:
            del self._paths[old]
        fetch = self._paths[key] = _Fetch()
        try:
            fetch.path = await self._trainer.update_path(receiver, have, precision, PART_BYTES)
        finally:
            if fetch.path is None and self._paths.get(key) is fetch:
                del self._paths[key]
            fetch.done.set()
        return fetch.path


class PendingAcks:
    """Versions samplers have applied that the trainer was not told yet, newest per receiver
    and per precision; `take` waits for some and hands over all there are (one call carries
    every acknowledgement that arrived while the previous one was in flight)."""

    def __init__(self) -> None:
        self._held: dict[str, dict[str, int]] = {}
        self._due = trio.Event()

    def add(self, precision: str, receiver: str, version: int) -> None:
        self._held.setdefault(precision, {})[receiver] = version
        self._due.set()

    def clear(self) -> None:
        self._held.clear()

    async def take(self) -> dict[str, dict[str, int]]:
        while not self._held:
            await self._due.wait()
            self._due = trio.Event()
        held, self._held = self._held, {}
        return held
