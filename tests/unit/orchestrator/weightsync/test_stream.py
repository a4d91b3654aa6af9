"""Keyframes streamed in parts: bit-exact, same hashes as a one-message keyframe, bounded parts,
and every way a part can be wrong is refused."""

from __future__ import annotations

import pytest
import torch

from orchestrator.weightsync import (
    CorruptPayloadError,
    HashMismatchError,
    KeyframeAssembler,
    MalformedMessageError,
    encode_keyframe,
    stream_keyframe,
    wire_snapshot,
)


def _master() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(300, 64, generator=g) * 0.02,
        "layers.0.mlp.weight": torch.randn(256, 200, generator=g) * 0.02,
        "norm.weight": torch.ones(64),
        "empty": torch.zeros(0, 3),
    }


@pytest.mark.parametrize(("precision", "compress"), [("bf16", True), ("fp8", True), ("fp32", True), ("bf16", False)])
def test_streamed_keyframe_is_bit_exact_with_the_one_message_hashes(precision, compress) -> None:
    snap = wire_snapshot(_master(), precision)
    parts = list(stream_keyframe(snap, 7, precision, part_bytes=20_000, chunk_bytes=8192, compress=compress))
    assert all(h["raw"] is not compress for h, _ in parts)
    assert len(parts) > 3 and [h["seq"] for h, _ in parts] == list(range(len(parts)))
    names = list(snap)
    nbytes = [snap[n].numel() * snap[n].element_size() for n in names]
    total = 0
    asm = KeyframeAssembler()
    for header, frames in parts:
        cb = header["chunk_bytes"]
        raw = sum(min(cb, nbytes[i] - c * cb) for i, c, _, _ in header["chunks"])
        assert raw <= 20_000 or len(frames) == 1  # a part holds at most part_bytes of raw snapshot
        total += raw
        done = asm.feed(header, frames)
    assert total == sum(nbytes)
    assert done and asm.version == 7 and asm.precision == precision
    assert asm.snapshot.keys() == snap.keys()
    for name, t in snap.items():
        assert asm.snapshot[name].dtype == t.dtype and asm.snapshot[name].shape == t.shape
        assert torch.equal(asm.snapshot[name].view(torch.uint8), t.view(torch.uint8)), name
    one = encode_keyframe(snap, 7, precision, chunk_bytes=8192)
    assert asm.hashes == {t.name: t.hash for t in one.meta.tensors}


def test_wrong_parts_are_refused() -> None:
    snap = wire_snapshot(_master(), "bf16")
    parts = list(stream_keyframe(snap, 1, "bf16", part_bytes=20_000, chunk_bytes=8192))
    with pytest.raises(MalformedMessageError, match="expected 0"):
        KeyframeAssembler().feed(*parts[1])
    asm = KeyframeAssembler()
    asm.feed(*parts[0])
    with pytest.raises(MalformedMessageError, match="expected 1"):
        asm.feed(*parts[2])
    header, frames = parts[1]
    bad = [bytes(f) for f in frames]
    bad[0] = bad[0][:-3] + b"\x00\x00\x00"
    with pytest.raises(CorruptPayloadError):
        KeyframeAssembler().feed(*parts[0]) or asm.feed(header, bad)
    asm2 = KeyframeAssembler()
    asm2.feed(*parts[0])
    wrong = dict(header, chunks=[[*c[:3], "00" * 16] for c in header["chunks"]])
    with pytest.raises(HashMismatchError):
        asm2.feed(wrong, frames)
    raw = list(stream_keyframe(snap, 1, "bf16", part_bytes=20_000, chunk_bytes=8192, compress=False))
    asm4 = KeyframeAssembler()
    asm4.feed(*raw[0])
    with pytest.raises(CorruptPayloadError, match="raw bytes"):
        asm4.feed(raw[1][0], [bytes(f)[:-2] for f in raw[1][1]])
    asm3 = KeyframeAssembler()
    for h, f in parts[:-1]:
        asm3.feed(h, f)
    last_h, last_f = parts[-1]
    with pytest.raises(HashMismatchError):
        asm3.feed(dict(last_h, hashes={k: "0" * 32 for k in last_h["hashes"]}), last_f)
