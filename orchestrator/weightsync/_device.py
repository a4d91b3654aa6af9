"""Deltas found where the weights are: on their own device, moving only the changes.

`DeviceDeltas` keeps the previous wire snapshot on the snapshot's device (a GPU, or the
CPU) and a host mirror of it. Each `delta` XORs the new snapshot against the kept one on
that device, and moves to the host only the positions (int32) and XOR words of the
changed words, with one count per chunk. The host then builds each chunk's frame from
the changes alone (`_chunks.encode_changes`), applies them to the mirror, and hashes the
chunks that changed (an unchanged chunk's digest is kept from the step before). The
message is bit-identical to `encode_delta(mirror_before, new_on_host)` with the same
`threads`, `level`, `chunk_bytes` and `hash_algo`: same chunking, frames and hashes.

Host bytes per step: (4 + w) per changed w-byte word plus 8 per chunk, against the whole
snapshot for `encode_delta` (which needs both snapshots on the host). Device memory: one
more copy of the snapshot, and scratch of about 3 bytes per word of the largest tensor.

Errors: `StructureMismatchError` when the new snapshot's names, dtypes or shapes differ
from the kept one, or a tensor is not contiguous or lies on another device; nothing is
changed then. Past those checks the kept snapshot and the mirror are updated before the
frames are encoded, so an error while encoding (a device or memory failure) leaves the
encoder at `new` without a message: start a new one from a keyframe. Not thread-safe:
one caller at a time.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ._auth import seal
from ._chunks import HASHERS, Workspace, default_hash_algo, encode_changes, tree_hash, word_dtype
from ._codec import DEFAULT_CHUNK_BYTES, _check_same, _chunk_size, _run, _split
from ._errors import StructureMismatchError
from ._message import MessageMeta, Precision, TensorMeta, WeightMessage

__all__ = ["DeviceDeltas"]

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _dev_words(t: torch.Tensor, name: str) -> torch.Tensor:
    """The tensor's storage as a flat integer word tensor on its device (shares memory)."""
    if not t.is_contiguous():
        raise StructureMismatchError("must be contiguous", tensor=name)
    w = word_dtype(t.element_size()).itemsize
    return t.detach().reshape(-1).view(torch.uint8).view(_INT[w])


class DeviceDeltas:
    """Encodes deltas between successive snapshots on one device.  See the module docstring.

    Args:
        snapshot: the wire snapshot at `version` (contiguous tensors, all on one device);
            copied, not kept.
        version: its version.
        threads, level, chunk_bytes, hash_algo: as `encode_delta`.
    """

    def __init__(
        self,
        snapshot: Mapping[str, torch.Tensor],
        version: int,
        *,
        threads: int = 2,
        level: int = 1,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        hash_algo: str | None = None,
    ) -> None:
        self.algo = hash_algo or default_hash_algo()
        if self.algo not in HASHERS:
            raise ValueError(f"hash_algo {self.algo!r} unavailable here; have {sorted(HASHERS)}")
        devices = {t.device for t in snapshot.values()}
        if len(devices) > 1:
            raise StructureMismatchError(f"tensors lie on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.threads, self.level = threads, level
        self.version = version
        names = list(snapshot)
        for n in names:
            _dev_words(snapshot[n], n)
        self._kept = {n: snapshot[n].detach().clone() for n in names}
        self.host: dict[str, torch.Tensor] = {n: snapshot[n].detach().to("cpu", copy=True) for n in names}
        """The snapshot at `version` on the host (updated in place by each `delta`)."""
        largest = max((t.numel() * t.element_size() for t in snapshot.values()), default=0)
        self.chunk_bytes = _chunk_size(chunk_bytes, largest, threads)
        hasher = HASHERS[self.algo]
        self._digests: dict[str, list[bytes]] = {}
        for n in names:
            words = self._host_words(n)
            spans = _split(words.size, words.dtype.itemsize, self.chunk_bytes)
            self._digests[n] = [hasher(words[s:e]) for s, e in spans]
        self.last_host_bytes = 0
        """Bytes moved from the device to the host by the last `delta`."""
        self.last_changed_chunk_bytes = 0
        """Raw bytes of the chunks the last `delta` found changed."""

    def _host_words(self, name: str) -> np.ndarray:
        t = self.host[name]
        return t.reshape(-1).view(torch.uint8).numpy().view(word_dtype(t.element_size()))

    @torch.no_grad()
    def delta(
        self, new: Mapping[str, torch.Tensor], version: int, precision: Precision, *, auth_key: bytes | None = None
    ) -> WeightMessage:
        """Delta from the kept snapshot (at `self.version`) to `new` (at `version`), sealed
        with `auth_key`; then `new` is the kept snapshot and `self.host` equals it."""
        _check_same(self._kept, new)
        for n, t in new.items():
            if t.device != self.device:
                raise StructureMismatchError(f"on {t.device}, the kept snapshot is on {self.device}", tensor=n)
            _dev_words(t, n)
        cb = self.chunk_bytes
        hasher = HASHERS[self.algo]
        moved = changed_bytes = 0
        changes: list[tuple[str, np.ndarray, np.ndarray, np.ndarray, int]] = []
        for n, t in new.items():
            old_w, new_w = _dev_words(self._kept[n], n), _dev_words(t, n)
            w = old_w.element_size()
            per = cb // w
            nchunks = -(-old_w.numel() // per)
            pos = torch.bitwise_xor(old_w, new_w).nonzero().squeeze(1)
            vals = torch.bitwise_xor(old_w[pos], new_w[pos])
            counts = torch.bincount(pos // per, minlength=nchunks) if nchunks else pos
            old_w[pos] = new_w[pos]  # the kept snapshot is now `new`
            pos_h = pos.to(torch.int32 if old_w.numel() < 2**31 else torch.int64).cpu().numpy()
            vals_h = vals.cpu().numpy().view(word_dtype(w))
            counts_h = counts.cpu().numpy()
            moved += pos_h.nbytes + vals_h.nbytes + counts_h.nbytes
            hw = self._host_words(n)
            hw[pos_h] ^= vals_h
            changed_bytes += int(sum(min(per, old_w.numel() - k * per) for k in np.flatnonzero(counts_h))) * w
            changes.append((n, pos_h, vals_h, counts_h, per))

        jobs, slots = [], []
        for ti, (n, pos_h, vals_h, counts_h, _per) in enumerate(changes):
            hw = self._host_words(n)
            ends = np.cumsum(counts_h)
            for k, (s, e) in enumerate(_split(hw.size, hw.dtype.itemsize, cb)):
                lo = int(ends[k - 1]) if k else 0
                p, v = pos_h[lo : int(ends[k])] - s, vals_h[lo : int(ends[k])]
                slots.append((ti, k, p.size > 0))

                def job(
                    ws: Workspace, p=p, v=v, m=e - s, chunk=hw[s:e], changed=p.size > 0
                ) -> tuple[bytes, bytes | None]:
                    return encode_changes(p, v, m, ws), hasher(chunk) if changed else None

                jobs.append(job)
        results = _run(jobs, self.threads, self.level)
        lens: list[list[int]] = [[] for _ in changes]
        frames: list[bytes] = []
        for (ti, k, changed), res in zip(slots, results, strict=True):
            if isinstance(res, Exception):
                raise res
            frame, digest = res
            frames.append(frame)
            lens[ti].append(len(frame))
            if changed:
                self._digests[changes[ti][0]][k] = digest  # type: ignore[assignment]
        metas = tuple(
            TensorMeta.model_construct(
                name=n,
                dtype=str(new[n].dtype).removeprefix("torch."),
                shape=tuple(new[n].shape),
                hash=tree_hash(self.algo, self._digests[n]),
                chunks=tuple(lens[ti]),
            )
            for ti, (n, *_rest) in enumerate(changes)
        )
        meta = MessageMeta(
            version=version,
            base_version=self.version,
            encoding="xor-zstd",
            precision=precision,
            hash_algo=self.algo,  # type: ignore[arg-type]
            chunk_bytes=cb,
            tensors=metas,
        )
        self.version = version
        self.last_host_bytes, self.last_changed_chunk_bytes = moved, changed_bytes
        return seal(WeightMessage(meta, frames), auth_key)
