"""The weight message: JSON metadata plus one compressed frame per chunk.

Two wire forms, both without pickle:

* ZeroMQ multipart: `to_frames()` gives `[metadata JSON, chunk frame, ...]`
  (chunk frames in metadata order: tensor by tensor, chunk by chunk);
  `from_frames()` takes any buffers (bytes, memoryview, zmq.Frame).
* A safetensors file (`to_bytes()` / `from_bytes()`) for disk or object
  storage: one uint8 tensor per weight tensor holding its chunk frames back
  to back, and the metadata JSON under the `__metadata__` key
  `"flotilla.weightsync"`. Any safetensors reader can open it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from typing_extensions import Buffer

from ._errors import MalformedMessageError

__all__ = ["FORMAT", "MessageMeta", "Precision", "TensorMeta", "WeightMessage"]

FORMAT = "flotilla.weightsync/2"
_ST_KEY = "flotilla.weightsync"

Precision = Literal["bf16", "fp8", "fp32"]
"""Wire precision of a snapshot. bf16: every floating tensor in bfloat16.
fp8: 2-D weights as float8_e4m3fn with `<name>_scale_inv` float32 block
scales, the rest bf16 (see `fp8_wire_snapshot`). fp32: floats as float32."""


class TensorMeta(BaseModel):
    """How one tensor travels in a message."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    """Tensor name, unique in the message."""
    dtype: str
    """torch dtype name without the `torch.` prefix, e.g. `bfloat16`."""
    shape: tuple[int, ...]
    """Tensor shape; every dimension >= 0."""
    hash: str = Field(pattern=r"^[0-9a-f]{16,128}$")
    """Hex digest of the tensor's bytes after the message is applied
    (a tree hash: `hash_algo` of the concatenated per-chunk digests)."""
    chunks: tuple[int, ...]
    """Byte length of each compressed chunk frame of this tensor, in order.
    The tensor's raw bytes are split every `chunk_bytes` bytes."""

    @model_validator(mode="after")
    def _check(self) -> TensorMeta:
        if any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: negative dimension in shape {self.shape}")
        if any(c <= 0 for c in self.chunks):
            raise ValueError(f"tensor {self.name!r}: chunk lengths must be positive")
        return self


class MessageMeta(BaseModel):
    """Metadata of one weight message (sent as JSON in the first frame)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["flotilla.weightsync/2"] = FORMAT
    """Format tag; bumped on any incompatible change."""
    version: int = Field(ge=0)
    """Policy version the message brings the receiver to."""
    base_version: int | None = Field(default=None, ge=0)
    """Version the delta must be applied to; None for a keyframe."""
    encoding: Literal["xor-zstd", "keyframe-zstd"]
    """xor-zstd: per chunk, XOR of old and new bytes; keyframe-zstd: the new
    bytes themselves (equivalently XOR against zeros). Both zstd-compressed,
    sparse chunks as positions + values, dense ones as byte planes."""
    precision: Precision
    """Wire precision of the snapshot this message belongs to."""
    hash_algo: Literal["xxh3-128", "sha256"]
    """Hash used for the per-tensor tree hashes."""
    chunk_bytes: int = Field(gt=0, multiple_of=8)
    """Raw bytes per chunk (the last chunk of a tensor may be shorter)."""
    tensors: tuple[TensorMeta, ...]
    """Every tensor of the snapshot, in payload order."""
    digest: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    """blake2b-256 of every other field (`weightsync.meta_digest`), keyed with the
    publisher's key when it has one. It binds version, base version, encoding,
    precision and the tensor list (names, dtypes, shapes, hashes of the new bytes,
    chunk lengths) together, so a receiver refuses a message whose metadata was
    altered. Empty only on a message that was never sealed (receivers refuse it)."""

    @model_validator(mode="after")
    def _check(self) -> MessageMeta:
        keyframe = self.encoding == "keyframe-zstd"
        if keyframe and self.base_version is not None:
            raise ValueError("a keyframe has no base_version")
        if not keyframe and self.base_version is None:
            raise ValueError("a delta needs a base_version")
        if not keyframe and self.base_version >= self.version:  # type: ignore[operator]
            raise ValueError(f"base_version {self.base_version} must be below version {self.version}")
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise ValueError(f"tensor {t.name!r} appears twice")
            seen.add(t.name)
        return self

    @property
    def is_keyframe(self) -> bool:
        return self.encoding == "keyframe-zstd"


class WeightMessage:
    """A delta or keyframe: `meta` plus `frames`, one compressed frame per chunk.

    Immutable by convention; `nbytes` is what it costs on the wire (metadata
    JSON plus frames). Build one with `encode_delta` / `encode_keyframe`, or
    parse one with `from_frames` / `from_bytes`; both parsers raise
    `MalformedMessageError` naming the problem and never return a message
    whose frame count or lengths disagree with its metadata.
    """

    __slots__ = ("_json", "frames", "meta")

    def __init__(self, meta: MessageMeta, frames: Sequence[Buffer]) -> None:
        self.meta = meta
        self.frames: list[Buffer] = list(frames)
        self._json: bytes | None = None
        _check_frames(meta, self.frames)

    @property
    def version(self) -> int:
        """Version this message brings a receiver to."""
        return self.meta.version

    @property
    def base_version(self) -> int | None:
        """Version a delta must be applied to; None for a keyframe."""
        return self.meta.base_version

    @property
    def precision(self) -> Precision:
        return self.meta.precision

    @property
    def is_keyframe(self) -> bool:
        return self.meta.is_keyframe

    @property
    def meta_json(self) -> bytes:
        if self._json is None:
            self._json = self.meta.model_dump_json().encode()
        return self._json

    @property
    def nbytes(self) -> int:
        """Wire size: metadata JSON plus every frame."""
        return len(self.meta_json) + sum(memoryview(f).nbytes for f in self.frames)

    def __repr__(self) -> str:
        kind = "keyframe" if self.is_keyframe else f"delta from {self.base_version}"
        return f"<WeightMessage v{self.version} {kind} {self.precision} {self.nbytes} B>"

    # -- ZeroMQ multipart ------------------------------------------------
    def to_frames(self) -> list[bytes | memoryview]:
        """`[metadata JSON, *chunk frames]`, ready for `send_multipart(copy=False)`."""
        return [self.meta_json, *(f if isinstance(f, bytes) else memoryview(f) for f in self.frames)]

    @classmethod
    def from_frames(cls, frames: Sequence[Buffer]) -> WeightMessage:
        """Parse the output of `to_frames` (frames may be any buffers).

        Raises MalformedMessageError on no frames, bad JSON, invalid metadata,
        or a frame count / frame length that disagrees with the metadata.
        """
        if len(frames) == 0:
            raise MalformedMessageError("no frames: the metadata frame is missing")
        meta = _parse_meta(bytes(memoryview(frames[0])))
        return cls(meta, [memoryview(f).cast("B") for f in frames[1:]])

    # -- safetensors container -------------------------------------------
    def to_bytes(self) -> bytes:
        """A safetensors file: one uint8 tensor per weight tensor, metadata JSON
        under `__metadata__["flotilla.weightsync"]`."""
        import numpy as np
        from safetensors.numpy import save

        arrays: dict[str, np.ndarray] = {}
        i = 0
        for t in self.meta.tensors:
            parts = self.frames[i : i + len(t.chunks)]
            i += len(t.chunks)
            arrays[t.name] = np.frombuffer(b"".join(parts), dtype=np.uint8)
        return save(arrays, metadata={_ST_KEY: self.meta_json.decode()})

    @classmethod
    def from_bytes(cls, data: Buffer) -> WeightMessage:
        """Parse a `to_bytes` file. Raises MalformedMessageError on a truncated or
        invalid file, missing metadata, or payloads that disagree with it."""
        from safetensors import SafetensorError
        from safetensors.numpy import load

        raw = bytes(data)
        if len(raw) < 8:
            raise MalformedMessageError(f"safetensors file truncated: {len(raw)} bytes")
        (hlen,) = struct.unpack("<Q", raw[:8])
        if hlen > len(raw) - 8:
            raise MalformedMessageError(f"safetensors header length {hlen} exceeds file size {len(raw)}")
        try:
            header = json.loads(raw[8 : 8 + hlen])
            meta_json = header["__metadata__"][_ST_KEY]
        except (ValueError, KeyError, TypeError) as e:
            raise MalformedMessageError(f"safetensors header lacks weightsync metadata: {e!r}") from None
        meta = _parse_meta(meta_json.encode() if isinstance(meta_json, str) else b"")
        try:
            arrays = load(raw)
        except (SafetensorError, ValueError) as e:
            raise MalformedMessageError(f"invalid safetensors payload: {e}") from None
        frames: list[Buffer] = []
        for t in meta.tensors:
            arr = arrays.pop(t.name, None)
            if arr is None:
                raise MalformedMessageError("payload missing from container", tensor=t.name)
            buf = memoryview(arr.reshape(-1)).cast("B")
            if buf.nbytes != sum(t.chunks):
                raise MalformedMessageError(
                    f"payload is {buf.nbytes} bytes, metadata says {sum(t.chunks)}", tensor=t.name
                )
            off = 0
            for n in t.chunks:
                frames.append(buf[off : off + n])
                off += n
        if arrays:
            raise MalformedMessageError(f"container holds payloads not in metadata: {sorted(arrays)[:5]}")
        return cls(meta, frames)


def _parse_meta(raw: bytes) -> MessageMeta:
    try:
        return MessageMeta.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise MalformedMessageError(f"bad metadata at {where}: {first['msg']} ({e.error_count()} error(s))") from None


def _check_frames(meta: MessageMeta, frames: list[Buffer]) -> None:
    want = sum(len(t.chunks) for t in meta.tensors)
    if len(frames) != want:
        raise MalformedMessageError(f"message has {len(frames)} chunk frames, metadata lists {want}")
    i = 0
    for t in meta.tensors:
        for j, n in enumerate(t.chunks):
            got = memoryview(frames[i]).nbytes
            if got != n:
                raise MalformedMessageError(f"chunk {j} is {got} bytes, metadata says {n}", tensor=t.name)
            i += 1
