"""Sparse weight-delta sync: exact, compressed, versioned, FP8-aware.

The trainer side keeps a `WeightPublisher`; each sampler a `WeightReceiver`.
Transport-agnostic: moving messages and acks is the caller's job.

A `WeightMessage` is a delta (XOR of consecutive wire snapshots) or a keyframe
(the snapshot itself). Metadata (`MessageMeta`, JSON): format, version,
base_version (None for a keyframe), encoding ("xor-zstd" | "keyframe-zstd"),
precision, hash_algo, chunk_bytes, and per tensor name, dtype, shape, hash of
its new bytes, compressed length of each chunk. Payload: one zstd frame per
chunk of `chunk_bytes` raw bytes, holding the chunk's changes as
positions+values (sparse) or byte planes (dense); see `_chunks`. Wire forms:
ZeroMQ multipart (`to_frames` / `from_frames`: metadata frame, then chunk
frames) or a safetensors file (`to_bytes` / `from_bytes`). Never pickled.

The metadata is sealed by a digest (`_auth`: blake2b over every field, keyed
when publisher and receivers share `auth_key`), checked before anything else;
receivers never go back to an older version (replayed keyframes are staged,
never swapped in below the held version). A stored keyframe can also travel in
parts (`message_part`, `WeightReceiver.apply_part`, see `_parts`), decoded part by
part into the receiver's own snapshot, so that neither side holds two copies. Every failure is a `DeltaError` subclass naming the tensor or problem, and a
failed apply leaves the target bit-identical (undo by XOR, see `_codec`).
Snapshots in shared memory (`wire_snapshot(..., shared=True)`, `share`; the
publisher's by default) are encoded by helper processes rather than threads, which
share one GIL (`_shared`, `start_helpers`, `helper_stats`).
`DeviceDeltas` finds deltas on the snapshot's own device (a GPU), moving to the host
only the changed words; `WeightPublisher` uses it where the master weights lie on a GPU.
Imports torch; `orchestrator/__init__` does not import this package.
"""

from ._auth import meta_digest, seal, verify, verify_meta
from ._changes import Changes
from ._codec import Snapshot, apply, decode_keyframe, encode_delta, encode_keyframe, snapshot_bytes
from ._device import DeviceDeltas
from ._errors import (
    AuthenticationError,
    CorruptPayloadError,
    DeltaError,
    HashMismatchError,
    MalformedMessageError,
    StructureMismatchError,
    UnknownReceiverError,
    VersionError,
)
from ._fp8 import (
    DEFAULT_FP8_SKIP,
    FP8_BLOCK,
    FP8_MAX,
    dequantize_fp8,
    fp8_should_quantize,
    fp8_wire_snapshot,
    quantize_fp8,
    wire_snapshot,
)
from ._message import MessageMeta, Precision, TensorMeta, WeightMessage
from ._parts import DEFAULT_PART_BYTES, message_part, message_parts, part_plan
from ._publisher import WeightPublisher
from ._receiver import WeightReceiver
from ._shared import helper_stats, share, start_helpers
from ._stream import KeyframeAssembler, stream_keyframe

__all__ = [
    "DEFAULT_FP8_SKIP",
    "DEFAULT_PART_BYTES",
    "FP8_BLOCK",
    "FP8_MAX",
    "AuthenticationError",
    "Changes",
    "CorruptPayloadError",
    "DeltaError",
    "DeviceDeltas",
    "HashMismatchError",
    "KeyframeAssembler",
    "MalformedMessageError",
    "MessageMeta",
    "Precision",
    "Snapshot",
    "StructureMismatchError",
    "TensorMeta",
    "UnknownReceiverError",
    "VersionError",
    "WeightMessage",
    "WeightPublisher",
    "WeightReceiver",
    "apply",
    "decode_keyframe",
    "dequantize_fp8",
    "encode_delta",
    "encode_keyframe",
    "fp8_should_quantize",
    "fp8_wire_snapshot",
    "helper_stats",
    "message_part",
    "message_parts",
    "meta_digest",
    "part_plan",
    "quantize_fp8",
    "seal",
    "share",
    "snapshot_bytes",
    "start_helpers",
    "stream_keyframe",
    "verify",
    "verify_meta",
    "wire_snapshot",
]
