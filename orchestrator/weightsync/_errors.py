"""Errors of the weight-sync codec and protocol.

Every error names what went wrong and, where one is involved, the tensor
(`.tensor`) so a log line is enough to find the problem. All derive from
`DeltaError`, so a receiver can catch one type, keep its last good weights and
ask for a keyframe.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "CorruptPayloadError",
    "DeltaError",
    "HashMismatchError",
    "MalformedMessageError",
    "StructureMismatchError",
    "UnknownReceiverError",
    "VersionError",
]


class DeltaError(Exception):
    """Base class: a weight message could not be built, parsed or applied.

    `tensor` is the name of the tensor involved, or None when the problem is
    message-wide (bad JSON, wrong version).
    """

    def __init__(self, problem: str, *, tensor: str | None = None) -> None:
        self.problem = problem
        self.tensor = tensor
        super().__init__(f"tensor {tensor!r}: {problem}" if tensor is not None else problem)


class MalformedMessageError(DeltaError):
    """The message itself is broken: missing or truncated frames, bad JSON,
    metadata that fails validation, frame lengths that disagree with it."""


class StructureMismatchError(DeltaError):
    """Message and snapshot disagree on which tensors exist or on a tensor's
    dtype, shape or layout (also: a precision the receiver does not hold)."""


class CorruptPayloadError(DeltaError):
    """A compressed chunk does not decompress, or decompresses to a body of
    the wrong size or with impossible contents (positions out of range)."""


class HashMismatchError(DeltaError):
    """The bytes a message would produce differ from the hash it carries:
    the payload was altered, or the receiver's base bytes were not what the
    sender's base was."""


class VersionError(DeltaError):
    """A message does not continue the receiver's version: wrong base
    version (a gap or an out-of-order delta), a stale keyframe, or a version
    the publisher never published."""


class UnknownReceiverError(DeltaError):
    """The publisher was asked about a receiver it has not registered."""


class AuthenticationError(DeltaError):
    """The message's metadata does not match its digest: its version, base,
    precision, encoding or tensor list was altered, or it was sealed with
    another key (or not at all)."""
