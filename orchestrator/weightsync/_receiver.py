"""The receiver, in each sampler: verified messages in, one precision's weights held.

Transport-agnostic like the publisher (`_publisher.py`): a plain synchronous object, not
thread-safe, whose methods run CPU-bound work to completion. Call it from one thread at a
time, e.g. via `trio.to_thread.run_sync`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from typing_extensions import Buffer

from ._auth import verify, verify_meta
from ._changes import Changes
from ._codec import Snapshot, _dtype, apply, decode_keyframe
from ._errors import MalformedMessageError, StructureMismatchError, VersionError
from ._message import MessageMeta, Precision, WeightMessage
from ._parts import PartAssembler, parse_first

__all__ = ["WeightReceiver"]


class WeightReceiver:
    """Holds one precision's weights and applies messages to them, verified.

    `apply` raises (all DeltaError): AuthenticationError for metadata that does
    not match its digest (with `auth_key`: not sealed with that key); VersionError
    for a delta whose base is not the held version (gap, duplicate, out of order)
    or a stale keyframe; StructureMismatchError for another precision or layout;
    CorruptPayloadError / HashMismatchError / MalformedMessageError from the
    codec. On any of them the weights stay bit-identical at the last good version
    and `needs_keyframe` turns true, so `have_version` is None and the publisher's
    next `updates_for` answers with a keyframe path. A successful apply clears it
    (the held weights are verified, so a delta continuing them is as good as a
    keyframe).

    Versions never go back. A keyframe at or below the held version is refused,
    except while a keyframe is needed: the publisher's keyframe path may start
    below the held version (its newest keyframe plus the deltas after it), so such
    a keyframe is *staged*: decoded aside, continued by the deltas that follow it,
    and swapped in only once it reaches the held version or later. A replayed old
    keyframe therefore never replaces the held weights; it costs one snapshot of
    memory until the next keyframe or a delta continuing the held version.
    """

    def __init__(
        self,
        precision: Precision,
        snapshot: Snapshot | None = None,
        version: int | None = None,
        *,
        threads: int = 2,
        auth_key: bytes | None = None,
    ) -> None:
        if (snapshot is None) != (version is None):
            raise ValueError("give both snapshot and version, or neither")
        self.precision = precision
        self._snapshot = snapshot
        self._version = version
        self._threads = threads
        self._key = auth_key
        self._staged: tuple[Snapshot, int] | None = None
        self._incoming: tuple[PartAssembler, Snapshot] | None = None
        self._changed: Changes | None = None
        self.needs_keyframe = snapshot is None

    @property
    def snapshot(self) -> Snapshot | None:
        """The held weights (tensors are updated in place by deltas; a keyframe
        with a different layout, or a staged path that caught up, replaces the dict).
        None while a streamed keyframe is decoded into their memory, and after such a
        stream failed (see `apply_part`)."""
        return self._snapshot

    @property
    def version(self) -> int | None:
        """Version of the held weights (the last good one)."""
        return self._version

    @property
    def staged_version(self) -> int | None:
        """Version of a keyframe path being built below the held version, if any."""
        return None if self._staged is None else self._staged[1]

    @property
    def last_changed(self) -> Changes | None:
        """What the last apply changed in `snapshot`, when that is known exactly: after a
        delta applied to the held weights (the same snapshot object as before it), per
        tensor it changed the ascending flat indices of the elements whose value changed,
        or None for "any element may have" (see `Changes`; tensors it left alone are
        absent). None after a keyframe, a staged message, a streamed part, a failed
        apply, and before any apply: then a copy of the weights must be refreshed whole."""
        return self._changed

    @property
    def have_version(self) -> int | None:
        """What to tell `updates_for`: the held version, or None when a keyframe is needed."""
        return None if self.needs_keyframe else self._version

    def apply(self, message: WeightMessage) -> int | None:
        """Apply one message; returns the version now held (then acknowledge it).
        A staged message (see the class docstring) leaves the held version as it was."""
        return self._guarded(lambda: message)

    def apply_frames(self, frames: Sequence[Buffer]) -> int | None:
        """Parse ZeroMQ frames (`WeightMessage.to_frames`) and apply them. A
        message that does not parse is refused like any other: MalformedMessageError,
        weights kept, `needs_keyframe` set."""
        return self._guarded(lambda: WeightMessage.from_frames(frames))

    def apply_bytes(self, data: Buffer) -> int | None:
        """Parse a safetensors container (`WeightMessage.to_bytes`) and apply it,
        with the same refusal rules as `apply_frames`."""
        return self._guarded(lambda: WeightMessage.from_bytes(data))

    def _guarded(self, get: Callable[[], WeightMessage]) -> int | None:
        self._incoming = None  # a whole message ends any unfinished stream
        self._changed = None
        try:
            message = get()
            self._apply(message)
        except BaseException:
            # DeltaErrors leave the weights intact; anything else (MemoryError,
            # a bug) might not, and a keyframe is the safe way back either way.
            self.needs_keyframe = True
            self._staged = None
            raise
        self.needs_keyframe = self._staged is not None
        return self._version

    def apply_part(self, header: Mapping[str, Any], frames: Sequence[Buffer]) -> MessageMeta | None:
        """Feed one part of a streamed keyframe (`weightsync.message_part`); returns its
        verified metadata once the last part is in, None before.

        Part 0 starts a stream (ending any unfinished one) after the checks `apply` makes
        of a keyframe: the seal, the precision, not stale. The keyframe is decoded straight
        into the memory of the held snapshot when its layout fits (else of a staged one,
        else of a new one), so the receiver never holds two snapshots: from part 0 until the
        last part is verified `snapshot` is None, while `version` stays the last good
        version. Complete, a keyframe above that version is held; one at or below it is
        staged until deltas bring it there, as with `apply`.

        Errors (DeltaError, see `weightsync._parts`): the stream ends, its partial snapshot
        is dropped, `needs_keyframe` is set and `version` is still the last good one -- the
        version of the weights a sampler's engine, which holds its own copy, goes on using.
        """
        self._changed = None
        try:
            if header.get("seq") == 0:
                self._start_stream(header)
            elif self._incoming is None:
                raise MalformedMessageError(f"keyframe part {header.get('seq')!r} arrived with no stream started")
            assert self._incoming is not None
            assembler, target = self._incoming
            done = assembler.feed(header, frames)
        except BaseException:
            self._incoming = None
            self.needs_keyframe = True
            raise
        if not done:
            return None
        self._incoming = None
        version = assembler.meta.version
        if self._version is None or version > self._version:
            self._snapshot, self._version = target, version
        else:
            self._staged = (target, version)
            if version >= self._version:
                self._snapshot, self._staged = target, None
        self.needs_keyframe = self._staged is not None
        return assembler.meta

    def _start_stream(self, header: Mapping[str, Any]) -> None:
        self._incoming = None
        meta = parse_first(header)
        verify_meta(meta, self._key)
        if meta.precision != self.precision:
            raise StructureMismatchError(f"message is {meta.precision}, receiver holds {self.precision}")
        if not meta.is_keyframe:
            raise MalformedMessageError(f"only keyframes are streamed; got a delta from {meta.base_version}")
        held = self._version
        if held is not None and meta.version <= held and not self.needs_keyframe:
            raise VersionError(f"stale keyframe {meta.version}: already at {held}")
        spare = [self._snapshot, None if self._staged is None else self._staged[0]]
        target = next((s for s in spare if s is not None and _fits(meta, s)), None)
        self._snapshot = self._staged = None  # from here on, its bytes are the stream's
        self.needs_keyframe = True
        del spare
        if target is None:  # every byte is written by the stream: no need to zero it
            target = {tm.name: torch.empty(tm.shape, dtype=_dtype(tm.dtype, tm.name)) for tm in meta.tensors}
        self._incoming = (PartAssembler(meta, target, threads=self._threads), target)

    def apply_all(self, messages: Iterable[WeightMessage]) -> int | None:
        """Apply messages in order; stops at (and raises) the first failure."""
        for m in messages:
            self.apply(m)
        return self._version

    def _apply(self, message: WeightMessage) -> None:
        verify(message, self._key)
        if message.precision != self.precision:
            raise StructureMismatchError(f"message is {message.precision}, receiver holds {self.precision}")
        snap, held = self._snapshot, self._version
        if message.is_keyframe:
            if held is None or message.version > held:
                self._staged = None
                if snap is None or not _fits(message.meta, snap):
                    self._snapshot = decode_keyframe(message, threads=self._threads)
                else:
                    apply(message, snap, threads=self._threads)
                self._version = message.version
                return
            if not self.needs_keyframe:
                raise VersionError(f"stale keyframe {message.version}: already at {held}")
            self._staged = None  # free the previous attempt before decoding the next
            self._staged = (decode_keyframe(message, threads=self._threads), message.version)
        elif self._staged is not None and message.base_version == self._staged[1]:
            staged, _ = self._staged
            apply(message, staged, threads=self._threads)
            self._staged = (staged, message.version)
        else:
            if snap is None:
                raise VersionError(
                    f"delta {message.base_version}->{message.version} but no weights held: need a keyframe"
                )
            if message.base_version != held:
                kind = "gap" if message.base_version > held else "out-of-order delta"  # type: ignore[operator]
                raise VersionError(f"{kind}: delta {message.base_version}->{message.version}, receiver at {held}")
            self._staged = None
            changed = apply(message, snap, threads=self._threads, changes=True)
            self._version = message.version
            self._changed = changed
            return
        staged, version = self._staged
        if held is not None and version >= held:  # the path caught up: verified, not older
            self._snapshot, self._version, self._staged = staged, version, None


def _fits(meta: MessageMeta, snap: Mapping[str, torch.Tensor]) -> bool:
    metas = meta.tensors
    if len(metas) != len(snap):
        return False
    for tm in metas:
        t = snap.get(tm.name)
        if t is None or str(t.dtype).removeprefix("torch.") != tm.dtype or tuple(t.shape) != tm.shape:
            return False
    return True
