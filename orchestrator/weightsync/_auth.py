"""The message digest: metadata bound to the bytes it describes, optionally keyed.

Every tensor's hash covers its new bytes; the digest covers the metadata around
them (version, base version, encoding, precision, hash algorithm, chunk size and
the tensor list with those hashes). A receiver checks it before anything else, so
a message whose version was rewritten, whose tensor list was edited, or whose
delta claims another base is refused before it can touch the weights.

Without a key the digest is a plain hash: it catches corruption and any edit by
something that does not recompute it. With a key shared by the publisher and its
receivers (`WeightPublisher(auth_key=...)`, `WeightReceiver(auth_key=...)`) it is
a MAC (keyed blake2b): forging a message needs the key.
"""

from __future__ import annotations

import hashlib
import hmac

from ._errors import AuthenticationError
from ._message import MessageMeta, WeightMessage

__all__ = ["meta_digest", "seal", "verify", "verify_meta"]

_PERSON = b"flotilla.ws/2"  # domain separation from any other use of the same key


def meta_digest(meta: MessageMeta, key: bytes | None = None) -> str:
    """Hex blake2b-256 of the canonical JSON of `meta` without its `digest` field."""
    if key is not None and not 1 <= len(key) <= 64:
        raise ValueError(f"auth key must be 1..64 bytes, got {len(key)}")
    body = meta.model_dump_json(exclude={"digest"}).encode()
    return hashlib.blake2b(body, digest_size=32, key=key or b"", person=_PERSON).hexdigest()


def seal(message: WeightMessage, key: bytes | None = None) -> WeightMessage:
    """The same message with its digest set for `key` (frames are shared, not copied)."""
    meta = message.meta.model_copy(update={"digest": meta_digest(message.meta, key)})
    return WeightMessage(meta, message.frames)


def verify(message: WeightMessage, key: bytes | None = None) -> None:
    """Raise AuthenticationError unless the message's digest matches its metadata (and key)."""
    verify_meta(message.meta, key)


def verify_meta(meta: MessageMeta, key: bytes | None = None) -> None:
    """`verify` for metadata alone (the first part of a streamed message)."""
    want = meta_digest(meta, key)
    if not meta.digest:
        raise AuthenticationError("message is not sealed (no digest)")
    if not hmac.compare_digest(want, meta.digest):
        raise AuthenticationError(
            f"metadata of v{meta.version} does not match its digest"
            + (" (altered, or sealed with another key)" if key is not None else " (altered)")
        )
