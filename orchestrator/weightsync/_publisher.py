"""The publisher, next to the trainer: versions in, update paths out.

It turns each new master state dict into a wire snapshot per precision, keeps a delta per
version and a keyframe every `keyframe_interval` versions, and answers "I hold version v,
what do I need?" with the cheaper of two paths: the delta chain from v, or the newest
keyframe plus the deltas after it. It keeps the newest keyframe and the chain since the
oldest acknowledged version among registered receivers, nothing more (`_receiver.py` is
the other end).

Moving messages (ZeroMQ frames, actor calls, object storage) is the caller's job: this is
a plain synchronous object, not thread-safe, whose methods run CPU-bound work to
completion (no cancellation points). Call it from one thread at a time, e.g. via
`trio.to_thread.run_sync`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ._codec import DEFAULT_CHUNK_BYTES, Snapshot, encode_delta, encode_keyframe
from ._device import DeviceDeltas
from ._errors import StructureMismatchError, UnknownReceiverError, VersionError
from ._fp8 import DEFAULT_FP8_SKIP, wire_snapshot
from ._message import Precision, WeightMessage

__all__ = ["WeightPublisher"]


@dataclass(slots=True)
class _Peer:
    precision: Precision
    acked: int | None


def _on_one_device(snapshot: Snapshot, device: torch.device) -> bool:
    return all(t.device == device for t in snapshot.values())


def _same_structure(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and a[n].shape == b[n].shape for n in a)


class _Track:
    """One precision's current snapshot and stored messages."""

    def __init__(self) -> None:
        self.snapshot: Snapshot | None = None
        self.deltas: dict[int, WeightMessage] = {}  # keyed by base_version
        self.keyframe: WeightMessage | None = None  # only the newest is kept
        self.on_device: DeviceDeltas | None = None  # with device_deltas: the snapshot where the weights are

    def chain(self, start: int, latest: int) -> list[WeightMessage] | None:
        """Deltas from `start` to `latest`, or None where the chain is broken."""
        out: list[WeightMessage] = []
        cur = start
        while cur != latest:
            d = self.deltas.get(cur)
            if d is None:
                return None
            out.append(d)
            cur = d.version
        return out


class WeightPublisher:
    """Builds and stores weight messages; tells each receiver what it needs.

    `publish` raises VersionError for a version that does not increase, and
    ValueError as `wire_snapshot` does; nothing is stored then. `ack` and
    `updates_for` raise VersionError for a version never published,
    `ack` raises UnknownReceiverError for an unregistered receiver, and
    StructureMismatchError flags a precision that is not published or a
    receiver asking in another precision than it registered with.

    Every message is sealed (`weightsync.seal`): with `auth_key` (1..64 bytes, shared
    with the receivers) its digest is a MAC, without one a plain hash.

    With `helper_processes` (and `threads` > 1) the wire snapshots live in shared memory,
    and those cut into small chunks are encoded by the calling thread and `threads - 1`
    helper processes instead of threads, which share one GIL (see `_shared`; the helpers
    start on the first encode and take over once ready, ~0.1 s later).

    With `device_deltas` (None, the default: when the master weights lie on a GPU; True:
    wherever they lie, the CPU included; False: never), each precision's wire snapshot is
    built and kept on the master weights' own device, and deltas are found there
    (`DeviceDeltas`): only the changed words travel to the host, whose mirror of the
    snapshot is what `snapshot` returns and what keyframes encode. The messages are
    bit-identical either way.
    """

    def __init__(
        self,
        *,
        keyframe_interval: int = 20,
        precisions: Sequence[Precision] = ("bf16",),
        fp8_skip: Sequence[str] = DEFAULT_FP8_SKIP,
        threads: int = 2,
        level: int = 1,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        auth_key: bytes | None = None,
        helper_processes: bool = True,
        device_deltas: bool | None = None,
    ) -> None:
        if keyframe_interval < 1:
            raise ValueError(f"keyframe_interval must be >= 1, got {keyframe_interval}")
        if not precisions or len(set(precisions)) != len(precisions):
            raise ValueError(f"precisions must be non-empty and distinct, got {list(precisions)}")
        self.keyframe_interval = keyframe_interval
        self.precisions = tuple(precisions)
        self._fp8_skip = tuple(fp8_skip)
        self._device_deltas = device_deltas
        self._shared = helper_processes and threads > 1
        self._codec = {"threads": threads, "level": level, "chunk_bytes": chunk_bytes, "auth_key": auth_key}
        self._tracks = {p: _Track() for p in self.precisions}
        self._peers: dict[str, _Peer] = {}
        self._latest: int | None = None
        self._keyframe_version: int | None = None

    @property
    def latest_version(self) -> int | None:
        """Newest published version (None before the first publish)."""
        return self._latest

    def snapshot(self, precision: Precision) -> Snapshot:
        """The current wire snapshot of `precision` (read it, do not modify it). With device
        deltas it is the host mirror, which the next `publish` updates in place."""
        snap = self._track(precision).snapshot
        if snap is None:
            raise VersionError("nothing published yet")
        return snap

    def keyframe(self, precision: Precision) -> WeightMessage:
        """The newest keyframe of `precision`, e.g. as a new sampler's initial weights."""
        kf = self._track(precision).keyframe
        if kf is None:
            raise VersionError("nothing published yet")
        return kf

    def held(self, precision: Precision) -> list[WeightMessage]:
        """Every message stored for `precision`: the keyframe, then deltas by version."""
        t = self._track(precision)
        return ([t.keyframe] if t.keyframe else []) + sorted(t.deltas.values(), key=lambda m: m.version)

    def publish(self, version: int, master: Mapping[str, torch.Tensor]) -> list[WeightMessage]:
        """Publish master weights (any dtype/device; copied) as `version`.

        Per precision: a delta from the previous version, plus a keyframe on
        the first publish, every `keyframe_interval` versions, and whenever the
        set/dtypes/shapes of tensors change (then no delta). Returns the new
        messages, deltas first.
        """
        if version < 0 or (self._latest is not None and version <= self._latest):
            raise VersionError(f"published version {version} must exceed the latest, {self._latest}")
        on_device = self._device_deltas
        if on_device is None:
            on_device = any(t.device.type != "cpu" for t in master.values())
        shared = self._shared and not on_device
        snaps = {
            p: wire_snapshot(master, p, fp8_skip=self._fp8_skip, shared=shared, keep_device=on_device)
            for p in self.precisions
        }
        due = self._keyframe_version is None or version - self._keyframe_version >= self.keyframe_interval
        out: list[WeightMessage] = []
        keyframes: list[tuple[_Track, WeightMessage]] = []
        for p, new in snaps.items():
            track = self._tracks[p]
            prev = track.snapshot
            if prev is not None and _same_structure(prev, new):
                assert self._latest is not None
                if track.on_device is not None and _on_one_device(new, track.on_device.device):
                    key = self._codec["auth_key"]
                    out.append(track.on_device.delta(new, version, p, auth_key=key))
                    snaps[p] = track.on_device.host
                    continue
                host = {n: t.to("cpu") for n, t in new.items()}  # no copy for CPU tensors
                out.append(encode_delta(prev, host, version, self._latest, p, **self._codec))
            else:
                due = True
        for p, new in snaps.items():
            track = self._tracks[p]
            if not on_device:
                track.on_device = None
            elif track.on_device is None or track.on_device.host is not new:
                # first publish, changed structure or device: keep the new snapshot where it lies
                c = self._codec
                track.on_device = DeviceDeltas(
                    new, version, threads=c["threads"], level=c["level"], chunk_bytes=c["chunk_bytes"]
                )
                snaps[p] = track.on_device.host
        for p, new in snaps.items():
            if due:
                kf = encode_keyframe(new, version, p, **self._codec)
                keyframes.append((self._tracks[p], kf))
                out.append(kf)
        for msg in out:
            if not msg.is_keyframe:
                self._tracks[msg.precision].deltas[msg.base_version] = msg
        for track, kf in keyframes:
            track.keyframe = kf
        for p, new in snaps.items():
            self._tracks[p].snapshot = new
        if due:
            self._keyframe_version = version
        self._latest = version
        self._collect()
        return out

    def register(self, receiver_id: str, precision: Precision, version: int | None = None) -> None:
        """Start tracking a receiver (replacing any earlier registration) that
        holds `version` (None: no verified weights yet)."""
        self._track(precision)
        self._check_published(version)
        self._peers[receiver_id] = _Peer(precision, version)
        self._collect()

    def forget(self, receiver_id: str) -> None:
        """Stop tracking a receiver (it died or left); a no-op if unknown."""
        if self._peers.pop(receiver_id, None) is not None:
            self._collect()

    def ack(self, receiver_id: str, version: int) -> None:
        """Receiver confirms it holds `version`; history it no longer needs is dropped."""
        peer = self._peers.get(receiver_id)
        if peer is None:
            raise UnknownReceiverError(f"receiver {receiver_id!r} is not registered")
        self._check_published(version)
        peer.acked = version
        self._collect()

    def acknowledge(self, held: Mapping[str, int], precision: Precision) -> None:
        """`ack` for many receivers of `precision` at once (one collection), registering
        those it does not know: a receiver may have applied a path another one asked for.
        Raises VersionError naming every version never published (after recording the rest),
        StructureMismatchError for a receiver registered for another precision."""
        self._track(precision)
        bad = {r: v for r, v in held.items() if not self._published(v)}
        for receiver_id, version in held.items():
            if receiver_id not in bad:
                self._peer(receiver_id, precision, "acknowledges").acked = version
        self._collect()
        if bad:
            raise VersionError(f"versions never published (latest: {self._latest}): {bad}")

    def updates_for(self, receiver_id: str, have_version: int | None, precision: Precision) -> list[WeightMessage]:
        """Messages that take a receiver holding `have_version` (None: nothing
        trustworthy, e.g. `WeightReceiver.have_version` after a failure) to the
        latest version: the delta chain or the newest keyframe plus the deltas
        after it, whichever has fewer bytes (ties: the chain). Empty when it is
        current or nothing is published. Registers an unknown receiver."""
        track = self._track(precision)
        self._peer(receiver_id, precision, "asks for")
        if self._latest is None:
            return []
        self._check_published(have_version)
        if have_version == self._latest:
            return []
        assert track.keyframe is not None
        after = track.chain(track.keyframe.version, self._latest)
        assert after is not None, "deltas after the newest keyframe are never collected"
        via_keyframe = [track.keyframe, *after]
        direct = None if have_version is None else track.chain(have_version, self._latest)
        if direct is not None and sum(m.nbytes for m in direct) <= sum(m.nbytes for m in via_keyframe):
            return direct
        return via_keyframe

    def _peer(self, receiver_id: str, precision: Precision, doing: str) -> _Peer:
        """The receiver's registration, made (holding nothing acknowledged) if it has none;
        StructureMismatchError if it is registered for another precision."""
        peer = self._peers.get(receiver_id)
        if peer is None:
            peer = self._peers[receiver_id] = _Peer(precision, None)
        elif peer.precision != precision:
            raise StructureMismatchError(
                f"receiver {receiver_id!r} registered for {peer.precision}, {doing} {precision}"
            )
        return peer

    def _track(self, precision: Precision) -> _Track:
        track = self._tracks.get(precision)
        if track is None:
            raise StructureMismatchError(f"precision {precision!r} is not published (have {list(self.precisions)})")
        return track

    def _published(self, version: int) -> bool:
        return self._latest is not None and 0 <= version <= self._latest

    def _check_published(self, version: int | None) -> None:
        if version is not None and not self._published(version):
            raise VersionError(f"version {version} was never published (latest: {self._latest})")

    def _collect(self) -> None:
        """Keep per precision the newest keyframe and deltas from the oldest
        acknowledged version (or the keyframe, if older) onward."""
        for p, track in self._tracks.items():
            if track.keyframe is None:
                continue
            floor = min(
                [
                    track.keyframe.version,
                    *(r.acked for r in self._peers.values() if r.precision == p and r.acked is not None),
                ]
            )
            for base in [b for b in track.deltas if b < floor]:
                del track.deltas[base]
