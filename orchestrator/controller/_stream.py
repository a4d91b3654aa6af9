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

from typing import Any

from orchestrator.controller.links import PoolLink, TrainerLink
from orchestrator.runtime import ActorError

__all__ = ["PART_BYTES", "KeyframeGone", "send_path"]

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
