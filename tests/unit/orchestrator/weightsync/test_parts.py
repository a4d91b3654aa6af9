"""A publisher's stored keyframe sent in parts: decoded in place into the receiver's own
snapshot, sealed like a whole message, and every broken part refused with the last good
version kept."""

from __future__ import annotations

import pytest
import torch

from orchestrator.weightsync import (
    AuthenticationError,
    CorruptPayloadError,
    DeltaError,
    HashMismatchError,
    MalformedMessageError,
    StructureMismatchError,
    VersionError,
    WeightPublisher,
    WeightReceiver,
    message_part,
    message_parts,
    part_plan,
)

from ._util import master_state, same_bytes, sparse_step


def _publisher(versions: int, *, key: bytes | None = None, interval: int = 100) -> WeightPublisher:
    pub = WeightPublisher(keyframe_interval=interval, chunk_bytes=4096, auth_key=key)
    state, g = master_state(), torch.Generator().manual_seed(1)
    for v in range(versions):
        if v:
            sparse_step(state, g)
        pub.publish(v, state)
    return pub


def _stream(rx: WeightReceiver, pub: WeightPublisher, part_bytes: int = 6000):
    parts = list(message_parts(pub.keyframe("bf16"), part_bytes))
    assert len(parts) > 2
    for header, frames in parts[:-1]:
        assert rx.apply_part(header, frames) is None
        assert rx.snapshot is None  # its memory is the stream's until the last part
    return rx.apply_part(*parts[-1])


def test_part_plan_covers_every_frame_within_the_budget() -> None:
    msg = _publisher(1).keyframe("bf16")
    sizes = [len(f) for f in msg.frames]
    for budget in (1, 3000, 6000, 10**9):
        plan = part_plan(msg.meta, budget)
        assert [f for first, n in plan for f in range(first, first + n)] == list(range(len(sizes)))
        assert all(n == 1 or sum(sizes[first : first + n]) <= budget for first, n in plan)
    assert len(part_plan(msg.meta, 10**9)) == 1


def test_stream_into_the_held_snapshot_in_place_and_bit_exact() -> None:
    pub = _publisher(6, interval=5)  # keyframe at 5
    old = _publisher(1)
    rx = WeightReceiver("bf16", {n: t.clone() for n, t in old.snapshot("bf16").items()}, 0)
    ptrs = {n: t.data_ptr() for n, t in rx.snapshot.items()}
    meta = _stream(rx, pub)
    assert meta is not None and meta.version == 5
    assert rx.version == 5 and not rx.needs_keyframe
    assert {n: t.data_ptr() for n, t in rx.snapshot.items()} == ptrs  # no second snapshot
    assert same_bytes(rx.snapshot, pub.snapshot("bf16"))


def test_stream_into_a_receiver_with_nothing() -> None:
    pub = _publisher(3)
    rx = WeightReceiver("bf16")
    assert _stream(rx, pub, part_bytes=1).version == 0  # one frame a part
    rx.apply_all(pub.updates_for("r", rx.have_version, "bf16"))  # the deltas after it
    assert rx.version == 2 and same_bytes(rx.snapshot, pub.snapshot("bf16"))


@pytest.mark.parametrize("damage", ["corrupt", "short", "order", "no start", "other version"])
def test_a_broken_part_ends_the_stream_and_keeps_the_last_good_version(damage: str) -> None:
    pub = _publisher(4, interval=3)  # keyframe at 3
    rx = WeightReceiver("bf16", {n: t.clone() for n, t in _publisher(1).snapshot("bf16").items()}, 0)
    parts = list(message_parts(pub.keyframe("bf16"), 6000))
    rx.apply_part(*parts[0])
    header, frames = parts[1]
    frames = [bytes(f) for f in frames]
    error: type[DeltaError] = MalformedMessageError
    if damage == "corrupt":
        frames[0] = frames[0][:8] + bytes(len(frames[0]) - 8)
        error = CorruptPayloadError
    elif damage == "short":
        frames[0] = frames[0][:-1]
    elif damage == "order":
        header, frames = parts[2]
    elif damage == "no start":
        rx = WeightReceiver("bf16", {n: t.clone() for n, t in _publisher(1).snapshot("bf16").items()}, 0)
    else:
        header = dict(header, version=9)
    with pytest.raises(error):
        rx.apply_part(header, frames)
    assert rx.version == 0 and rx.needs_keyframe and rx.have_version is None
    with pytest.raises(MalformedMessageError, match="no stream"):
        rx.apply_part(*parts[2])  # the stream is over
    assert _stream(rx, pub).version == 3  # a fresh stream succeeds
    assert same_bytes(rx.snapshot, pub.snapshot("bf16"))


def test_frames_that_decode_to_other_bytes_fail_the_tensor_hash() -> None:
    w = torch.cat([torch.full((2048,), 1.0), torch.full((2048,), 2.0)]).bfloat16()
    pub = WeightPublisher(chunk_bytes=4096)
    pub.publish(0, {"w": w, "b": torch.ones(8)})
    header, frames = message_part(pub.keyframe("bf16"), 0, 10**6)
    assert len(frames) == 3 and len(frames[0]) == len(frames[1]) and bytes(frames[0]) != bytes(frames[1])
    rx = WeightReceiver("bf16")
    with pytest.raises(HashMismatchError) as err:  # the chunks are swapped: each decodes cleanly
        rx.apply_part(header, [frames[1], frames[0], frames[2]])
    assert err.value.tensor == "w" and rx.version is None and rx.needs_keyframe


def test_refused_first_parts_leave_the_held_snapshot_untouched() -> None:
    pub = _publisher(2, key=b"k" * 32)
    rx = WeightReceiver(
        "bf16", {n: t.clone() for n, t in _publisher(1).snapshot("bf16").items()}, 0, auth_key=b"x" * 32
    )
    before = {n: t.clone() for n, t in rx.snapshot.items()}
    first = message_part(pub.keyframe("bf16"), 0, 6000)
    with pytest.raises(AuthenticationError):
        rx.apply_part(*first)
    assert rx.snapshot is not None and same_bytes(rx.snapshot, before) and rx.version == 0
    edited = dict(first[0], meta=first[0]["meta"].replace('"version":0', '"version":7'))
    with pytest.raises(AuthenticationError):
        WeightReceiver("bf16", auth_key=b"k" * 32).apply_part(edited, first[1])
    ok = WeightReceiver("bf16", auth_key=b"k" * 32)
    assert ok.apply_part(*first) is None
    fp8 = WeightReceiver("fp8")
    with pytest.raises(StructureMismatchError):
        fp8.apply_part(*message_part(_publisher(1).keyframe("bf16"), 0, 6000))
    current = WeightReceiver("bf16", {n: t.clone() for n, t in pub.snapshot("bf16").items()}, 1, auth_key=b"k" * 32)
    with pytest.raises(VersionError, match="stale"):
        current.apply_part(*first)  # keyframe 0 to a receiver at 1 that needs nothing
    assert current.snapshot is not None and current.version == 1


def test_a_keyframe_below_the_held_version_is_staged_until_deltas_catch_up() -> None:
    pub = _publisher(6, interval=2)  # keyframes at 0, 2, 4; latest 5
    rx = WeightReceiver("bf16", {n: t.clone() for n, t in pub.snapshot("bf16").items()}, 5)
    rx.needs_keyframe = True  # as after a refused update
    path = pub.updates_for("r", None, "bf16")
    assert [m.version for m in path] == [4, 5] and path[0].is_keyframe
    assert _stream(rx, pub).version == 4
    assert rx.snapshot is None and rx.version == 5 and rx.staged_version == 4  # never back to 4
    assert rx.apply(path[1]) == 5
    assert rx.staged_version is None and not rx.needs_keyframe
    assert same_bytes(rx.snapshot, pub.snapshot("bf16"))
    with pytest.raises(VersionError, match="stale"):  # at 5 and needing nothing: keyframe 4 is refused
        rx.apply_part(*message_part(pub.keyframe("bf16"), 0, 6000))
    assert rx.snapshot is not None and rx.version == 5


def test_a_whole_message_ends_an_unfinished_stream() -> None:
    pub = _publisher(2)
    rx = WeightReceiver("bf16")
    rx.apply_part(*message_part(pub.keyframe("bf16"), 0, 6000))
    rx.apply(pub.keyframe("bf16"))
    assert rx.version == 0 and same_bytes(rx.snapshot, _publisher(1).snapshot("bf16"))
    with pytest.raises(MalformedMessageError, match="no stream"):
        rx.apply_part(*message_part(pub.keyframe("bf16"), 1, 6000))


def test_sparse_keyframe_chunks_overwrite_what_the_snapshot_held() -> None:
    """A mostly-zero tensor's keyframe chunks carry positions, not planes: streamed in
    place, every other word of the old bytes must still end up zero."""
    g = torch.Generator().manual_seed(3)
    sparse = torch.zeros(4096)
    sparse[torch.randint(0, 4096, (40,), generator=g)] = 1.0
    pub = WeightPublisher(keyframe_interval=1, chunk_bytes=4096)
    pub.publish(0, {"sparse": torch.randn(4096, generator=g), "dense": torch.randn(300, generator=g)})
    rx = WeightReceiver("bf16", {n: t.clone() for n, t in pub.snapshot("bf16").items()}, 0)
    pub.publish(1, {"sparse": sparse, "dense": torch.randn(300, generator=g)})
    assert not same_bytes(rx.snapshot, pub.snapshot("bf16"))
    rx.apply_part(*message_part(pub.keyframe("bf16"), 0, 10))
    for header, frames in list(message_parts(pub.keyframe("bf16"), 10))[1:]:
        rx.apply_part(header, frames)
    assert rx.version == 1 and same_bytes(rx.snapshot, pub.snapshot("bf16"))
