"""Sparse weight-delta sync: exact, compressed, versioned, FP8-aware.

The trainer side keeps a `WeightPublisher`; each sampler a `WeightReceiver`.
Messages (`WeightMessage`) are XOR deltas between consecutive wire snapshots
or keyframes, zstd-compressed per chunk on a thread pool, each tensor
verified by a hash of its new bytes. They travel as ZeroMQ frames
(`to_frames` / `from_frames`) or as a safetensors file (`to_bytes` /
`from_bytes`); never pickled. Transport-agnostic: moving messages and acks is
the caller's job. Imports torch; `orchestrator/__init__` does not import it.

Every failure is a `DeltaError` subclass naming the tensor or problem, and
applying never leaves a target half-updated.
"""

from ._codec import Snapshot, apply, decode_keyframe, encode_delta, encode_keyframe, snapshot_bytes
from ._errors import (
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
from ._protocol import WeightPublisher, WeightReceiver

__all__ = [
    "DEFAULT_FP8_SKIP",
    "FP8_BLOCK",
    "FP8_MAX",
    "CorruptPayloadError",
    "DeltaError",
    "HashMismatchError",
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
    "quantize_fp8",
    "snapshot_bytes",
    "wire_snapshot",
]
