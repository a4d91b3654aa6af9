"""Codec: exact round trips, wire forms, every malformed input, atomicity, memory."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
import torch
import zstandard
from safetensors.numpy import load as st_load

from orchestrator.weightsync import (
    CorruptPayloadError,
    DeltaError,
    HashMismatchError,
    MalformedMessageError,
    StructureMismatchError,
    WeightMessage,
    apply,
    decode_keyframe,
    encode_delta,
    encode_keyframe,
)
from orchestrator.weightsync._chunks import HASHERS

from ._util import clone, flip, same_bytes, with_frame


def mixed_snapshot(seed: int) -> dict[str, torch.Tensor]:
    """Every dtype family and awkward shape: 0-d, empty, odd lengths, fp8, ints, bool."""
    g = torch.Generator().manual_seed(seed)
    return {
        "bf16": (torch.randn(300, 37, generator=g) * 0.02).bfloat16(),
        "fp32": torch.randn(1001, generator=g),
        "fp16": torch.randn(7, 3, generator=g).half(),
        "fp8": (torch.randn(65, 129, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn),
        "f64": torch.randn(5, generator=g).double(),
        "i64": torch.randint(-(2**40), 2**40, (33,), generator=g),
        "bool": torch.rand(17, generator=g) < 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }


def nudge(snap: dict[str, torch.Tensor], seed: int, frac: float = 0.05) -> dict[str, torch.Tensor]:
    """A copy with a random `frac` of each tensor's bytes changed."""
    g = torch.Generator().manual_seed(seed)
    out = clone(snap)
    for t in out.values():
        if t.dtype == torch.bool:  # only 0/1 bytes are valid bools (copies normalise others)
            t ^= torch.rand(t.shape, generator=g) < frac
            continue
        raw = t.view(-1).view(torch.uint8) if t.dim() else t.view(1).view(torch.uint8)
        mask = torch.rand(raw.shape, generator=g) < frac
        raw[mask] ^= torch.randint(1, 256, raw.shape, generator=g, dtype=torch.uint8)[mask]
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.2, 0.6, 1.0])
def test_delta_and_keyframe_round_trip_exactly(threads: int, frac: float) -> None:
    prev = mixed_snapshot(0)
    new = nudge(prev, 1, frac)
    prev_copy, new_copy = clone(prev), clone(new)
    delta = encode_delta(prev, new, 5, 4, "bf16", threads=threads, chunk_bytes=1024)
    assert same_bytes(prev, prev_copy) and same_bytes(new, new_copy)  # inputs untouched
    target = clone(prev)
    apply(delta, target, threads=threads)
    assert same_bytes(target, new)
    key = encode_keyframe(new, 5, "bf16", threads=threads, chunk_bytes=1024)
    assert same_bytes(decode_keyframe(key, threads=threads), new)
    other = mixed_snapshot(7)
    apply(key, other, threads=threads)  # a keyframe overwrites whatever was there
    assert same_bytes(other, new)


def test_encoding_is_deterministic_and_thread_independent() -> None:
    prev, new = mixed_snapshot(0), nudge(mixed_snapshot(0), 3)
    a = encode_delta(prev, new, 1, 0, "bf16", threads=1, chunk_bytes=512)
    b = encode_delta(prev, new, 1, 0, "bf16", threads=2, chunk_bytes=512)
    assert a.to_frames() == b.to_frames()


def test_sparse_bf16_delta_is_small() -> None:
    g = torch.Generator().manual_seed(0)
    master = torch.randn(512, 512, generator=g) * 0.02
    prev = {"w": master.bfloat16()}
    new = {"w": (master + 1e-6 * torch.sign(torch.randn(512, 512, generator=g))).bfloat16()}
    k = int((prev["w"].view(torch.int16) != new["w"].view(torch.int16)).sum())
    assert 0 < k < 0.1 * master.numel()
    delta = encode_delta(prev, new, 1, 0, "bf16")
    assert delta.nbytes < 3 * k  # under 24 bits per changed weight, metadata included


@pytest.mark.parametrize("algo", sorted(HASHERS))
def test_each_hash_algorithm_round_trips_and_detects(algo: str) -> None:
    prev, new = mixed_snapshot(0), nudge(mixed_snapshot(0), 2)
    delta = encode_delta(prev, new, 1, 0, "bf16", hash_algo=algo)
    assert delta.meta.hash_algo == algo
    target = clone(prev)
    apply(delta, target)
    assert same_bytes(target, new)
    wrong_base = nudge(prev, 9, 0.001)
    before = clone(wrong_base)
    with pytest.raises(HashMismatchError):
        apply(delta, wrong_base)
    assert same_bytes(wrong_base, before)


def test_frames_and_safetensors_round_trip() -> None:
    prev, new = mixed_snapshot(0), nudge(mixed_snapshot(0), 4)
    delta = encode_delta(prev, new, 9, 8, "fp8", chunk_bytes=256)
    frames = delta.to_frames()
    assert json.loads(bytes(frames[0]))["version"] == 9 and len(frames) == 1 + len(delta.frames)
    for copy in (
        WeightMessage.from_frames([memoryview(bytearray(f)) for f in frames]),
        WeightMessage.from_bytes(delta.to_bytes()),
    ):
        assert copy.meta == delta.meta and copy.nbytes == delta.nbytes
        target = clone(prev)
        apply(copy, target)
        assert same_bytes(target, new)
    # Any safetensors reader sees one uint8 payload per tensor and the metadata.
    arrays = st_load(delta.to_bytes())
    assert set(arrays) == set(new) and all(a.dtype == np.uint8 for a in arrays.values())


def test_malformed_containers_are_rejected() -> None:
    delta = encode_delta(mixed_snapshot(0), nudge(mixed_snapshot(0), 4), 1, 0, "bf16", chunk_bytes=256)
    frames = delta.to_frames()
    cases = {
        "no frames": lambda: WeightMessage.from_frames([]),
        "bad json": lambda: WeightMessage.from_frames([b"{not json", *frames[1:]]),
        "bad meta": lambda: WeightMessage.from_frames(
            [frames[0].replace(b'"version":1', b'"version":-1'), *frames[1:]]
        ),
        "missing frame": lambda: WeightMessage.from_frames(frames[:-1]),
        "extra frame": lambda: WeightMessage.from_frames([*frames, b"x"]),
        "short frame": lambda: WeightMessage.from_frames([*frames[:2], bytes(frames[2])[:-1], *frames[3:]]),
        "truncated file": lambda: WeightMessage.from_bytes(delta.to_bytes()[:-10]),
        "tiny file": lambda: WeightMessage.from_bytes(b"abc"),
        "not safetensors": lambda: WeightMessage.from_bytes(b"\xff" * 64),
    }
    for what, call in cases.items():
        with pytest.raises(MalformedMessageError):
            call()
            pytest.fail(f"accepted: {what}")
    with pytest.raises(MalformedMessageError, match="keyframe has no base_version"):
        WeightMessage.from_frames([frames[0].replace(b'"xor-zstd"', b'"keyframe-zstd"'), *frames[1:]])


def test_structure_mismatches_name_the_tensor_and_change_nothing() -> None:
    prev, new = mixed_snapshot(0), nudge(mixed_snapshot(0), 4)
    delta = encode_delta(prev, new, 1, 0, "bf16")
    variants = {
        "fp32": lambda t: {**t, "fp32": t["fp32"].double()},  # dtype
        "bf16": lambda t: {**t, "bf16": t["bf16"].reshape(37, 300)},  # shape
        "i64": lambda t: {k: v for k, v in t.items() if k != "i64"},  # missing
        "stray": lambda t: {**t, "stray": torch.zeros(3)},  # unknown to the message
    }
    for name, make in variants.items():
        target = make(clone(prev))
        before = clone(target)
        with pytest.raises(StructureMismatchError) as err:
            apply(delta, target)
        assert err.value.tensor == name and name in str(err.value)
        assert same_bytes(target, before)
    with pytest.raises(StructureMismatchError, match="contiguous"):
        apply(delta, {**clone(prev), "bf16": prev["bf16"].t().contiguous().t()})
    with pytest.raises(StructureMismatchError):
        encode_delta(prev, {**new, "fp32": new["fp32"][:-1].clone()}, 1, 0, "bf16")


def test_corrupt_payloads_are_caught_and_target_is_restored() -> None:
    prev, new = mixed_snapshot(0), nudge(mixed_snapshot(0), 5, 0.1)
    delta = encode_delta(prev, new, 1, 0, "bf16", chunk_bytes=512)
    last = len(delta.frames) - 1
    body = np.frombuffer(zstandard.ZstdDecompressor().decompress(delta.frames[0]), np.uint8)
    cctx = zstandard.ZstdCompressor()
    cases = {
        "truncated chunk": with_frame(delta, last, bytes(delta.frames[last])[:-4]),
        "garbage chunk": with_frame(delta, 0, b"\x00" * 20),
        "wrong body size": with_frame(delta, 0, cctx.compress(body[:-1].tobytes())),
        "unknown layout": with_frame(delta, 0, cctx.compress(b"\x07" + body[1:].tobytes())),
        "huge declared size": with_frame(delta, 0, cctx.compress(bytes(10**6))),
    }
    for what, bad in cases.items():
        target = clone(prev)
        with pytest.raises(CorruptPayloadError) as err:
            apply(bad, target)
        assert err.value.tensor is not None and "chunk" in str(err.value), what
        assert same_bytes(target, prev), what  # earlier tensors' chunks were applied, then undone


def test_every_single_byte_flip_is_detected_or_harmless() -> None:
    prev = {"w": (torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()}
    new = nudge(prev, 1, 0.02)
    delta = encode_delta(prev, new, 1, 0, "bf16")
    frame = bytes(delta.frames[0])
    detected = 0
    for pos in range(len(frame)):
        target = clone(prev)
        try:
            apply(with_frame(delta, 0, flip(frame, pos)), target, threads=1)
        except DeltaError:
            detected += 1
            assert same_bytes(target, prev)
        else:  # a flip zstd ignores (e.g. the window size) must still give the exact bytes
            assert same_bytes(target, new)
    assert detected >= len(frame) - 4


def test_flipped_byte_in_a_later_tensor_rolls_back_earlier_ones() -> None:
    prev, new = mixed_snapshot(0), nudge(mixed_snapshot(0), 6, 0.2)
    delta = encode_delta(prev, new, 1, 0, "bf16", chunk_bytes=256)
    names = [t.name for t in delta.meta.tensors]
    last_of_bf16 = len(delta.meta.tensors[0].chunks) - 1  # corrupt only tensor 0's last chunk
    frame = bytes(delta.frames[last_of_bf16])
    target = clone(prev)
    with pytest.raises(DeltaError) as err:
        apply(with_frame(delta, last_of_bf16, flip(frame, len(frame) // 2)), target)
    assert err.value.tensor == names[0]
    assert same_bytes(target, prev)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("step", [1e-6, 2e-5, 1e-4, 1.0, "worst"])  # gaps, bitmap, mixed, dense layouts
def test_memory_stays_under_one_copy_of_the_largest_tensor(threads: int, step: float | str) -> None:
    g = torch.Generator().manual_seed(0)
    master = {f"w{i}": torch.randn(256, 1024 if i == 0 else 256, generator=g) * 0.02 for i in range(6)}
    prev = {n: t.bfloat16() for n, t in master.items()}
    if step == "worst":  # every word of every other 8-byte group changes: the gaps scan's largest case
        new = clone(prev)
        for t in new.values():
            t.view(-1, 8)[:, :4] += 1.0
    else:
        new = {n: (t + step * torch.randn(t.shape, generator=g)).bfloat16() for n, t in master.items()}
    largest = max(t.numel() * t.element_size() for t in prev.values())
    key = encode_keyframe(new, 1, "bf16", threads=threads)

    def extra(fn, output_bytes=lambda r: 0):  # peak traced bytes beyond inputs and the output
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            result = fn()
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        return peak - output_bytes(result)

    msg_bytes = lambda m: sum(len(f) for f in m.frames)  # noqa: E731
    delta = encode_delta(prev, new, 1, 0, "bf16", threads=threads)
    target = clone(prev)
    figures = {
        "encode delta": extra(lambda: encode_delta(prev, new, 1, 0, "bf16", threads=threads), msg_bytes),
        "encode keyframe": extra(lambda: encode_keyframe(new, 1, "bf16", threads=threads), msg_bytes),
        "apply delta": extra(lambda: apply(delta, target, threads=threads)),
        "apply keyframe": extra(lambda: apply(key, target, threads=threads)),
    }
    print({k: round(v / largest, 3) for k, v in figures.items()})
    assert all(v <= largest for v in figures.values()), figures
    assert same_bytes(target, new)
