"""DeviceDeltas: deltas found on the snapshot's own device are the codec's deltas, bit for
bit, and move to the host only the changes."""

from __future__ import annotations

import pytest
import torch

from orchestrator.weightsync import (
    DeviceDeltas,
    StructureMismatchError,
    WeightPublisher,
    WeightReceiver,
    apply,
    encode_delta,
    wire_snapshot,
)
from orchestrator.weightsync._device import DeviceDeltas as _Direct

from ._util import master_state, same_bytes, sparse_step


def _same_message(a, b) -> None:
    assert a.meta == b.meta
    assert [bytes(f) for f in a.frames] == [bytes(f) for f in b.frames]


@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp32"])
@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 20])
@pytest.mark.parametrize("frac", [0.0, 0.002, 0.03, 1.0])
def test_frames_are_the_codecs_bit_for_bit(precision: str, chunk_bytes: int, frac: float) -> None:
    master = master_state(0)
    gen = torch.Generator().manual_seed(1)
    prev = wire_snapshot(master, precision)
    enc = DeviceDeltas(prev, 0, chunk_bytes=chunk_bytes)
    target = {k: v.clone() for k, v in prev.items()}
    for step in range(1, 4):
        sparse_step(master, gen, frac=frac, lr=1e-2)
        new = wire_snapshot(master, precision)
        want = encode_delta(prev, new, step, step - 1, precision, chunk_bytes=chunk_bytes)
        got = enc.delta(new, step, precision)
        _same_message(got, want)
        assert same_bytes(enc.host, new)
        apply(got, target)
        assert same_bytes(target, new)
        prev = new


def test_host_bytes_are_the_changes_not_the_snapshot() -> None:
    master = master_state(0)
    prev = wire_snapshot(master, "bf16")
    enc = DeviceDeltas(prev, 0, chunk_bytes=4096)
    total = sum(t.numel() * t.element_size() for t in prev.values())
    sparse_step(master, torch.Generator().manual_seed(2), frac=0.01, lr=1e-2)
    new = wire_snapshot(master, "bf16")
    msg = enc.delta(new, 1, "bf16")
    changed = sum(
        int((a.view(torch.int16) != b.view(torch.int16)).sum())
        for a, b in zip(prev.values(), new.values(), strict=True)
    )
    assert changed > 0
    assert enc.last_host_bytes <= 6 * changed + 8 * sum(len(t.chunks) for t in msg.meta.tensors)
    assert enc.last_host_bytes < total / 4
    assert enc.last_host_bytes <= 3 * enc.last_changed_chunk_bytes
    enc.delta(new, 2, "bf16")  # nothing changed: a count per chunk, no positions
    assert enc.last_host_bytes == 8 * sum(len(t.chunks) for t in msg.meta.tensors)
    assert enc.last_changed_chunk_bytes == 0


def test_a_receiver_follows_device_deltas_through_the_protocol() -> None:
    master = master_state(3)
    gen = torch.Generator().manual_seed(4)
    snap = wire_snapshot(master, "bf16")
    rx = WeightReceiver("bf16", {k: v.clone() for k, v in snap.items()}, 0)
    enc = DeviceDeltas(snap, 0)
    for step in range(1, 3):
        sparse_step(master, gen, frac=0.05)
        new = wire_snapshot(master, "bf16")
        assert rx.apply(enc.delta(new, step, "bf16")) == step
        assert rx.version == step and same_bytes(rx.snapshot, new)


def test_a_changed_structure_is_refused_and_changes_nothing() -> None:
    snap = wire_snapshot(master_state(0), "bf16")
    enc = _Direct(snap, 0)
    bad = dict(snap)
    bad["lm_head.weight"] = bad["lm_head.weight"].float()
    with pytest.raises(StructureMismatchError, match="lm_head.weight"):
        enc.delta(bad, 1, "bf16")
    bad = dict(snap)
    bad["lm_head.weight"] = bad["lm_head.weight"].t()
    with pytest.raises(StructureMismatchError):
        enc.delta(bad, 1, "bf16")
    assert enc.version == 0 and same_bytes(enc.host, snap)


def test_a_publisher_with_device_deltas_sends_the_same_messages() -> None:
    master = master_state(5)
    gen = torch.Generator().manual_seed(6)
    kw = dict(keyframe_interval=3, precisions=("bf16", "fp8"), chunk_bytes=4096, helper_processes=False)
    plain, on_device = WeightPublisher(**kw), WeightPublisher(**kw, device_deltas=True)
    for version in range(6):
        if version:
            sparse_step(master, gen, frac=0.02, lr=1e-2)
        a, b = plain.publish(version, master), on_device.publish(version, master)
        assert [m.meta for m in a] == [m.meta for m in b]
        assert [[bytes(f) for f in m.frames] for m in a] == [[bytes(f) for f in m.frames] for m in b]
        for p in ("bf16", "fp8"):
            assert same_bytes(plain.snapshot(p), on_device.snapshot(p))
    grown = dict(master, extra=torch.ones(8))  # a changed structure: a keyframe, then deltas again
    a, b = plain.publish(6, grown), on_device.publish(6, grown)
    assert [m.meta for m in a] == [m.meta for m in b] and all(m.is_keyframe for m in b)
    sparse_step(grown, gen)
    a, b = plain.publish(7, grown), on_device.publish(7, grown)
    assert [m.meta for m in a] == [m.meta for m in b] and not any(m.is_keyframe for m in b)
