"""Publisher/receiver: bit-exact chains, failure detection and recovery, path choice, GC."""

from __future__ import annotations

import pytest
import torch

from orchestrator.weightsync import (
    CorruptPayloadError,
    DeltaError,
    HashMismatchError,
    MalformedMessageError,
    StructureMismatchError,
    UnknownReceiverError,
    VersionError,
    WeightMessage,
    WeightPublisher,
    WeightReceiver,
)

from ._util import clone, flip, master_state, same_bytes, sparse_step

PRECISIONS = ("bf16", "fp8", "fp32")


def sync(pub: WeightPublisher, rid: str, rx: WeightReceiver) -> list[WeightMessage]:
    """One round of the protocol as an actor would run it: ask, apply, ack."""
    msgs = pub.updates_for(rid, rx.have_version, rx.precision)
    for m in msgs:
        pub.ack(rid, rx.apply(WeightMessage.from_frames(m.to_frames())))
    return msgs


def test_fifty_random_sparse_steps_stay_bit_exact_in_every_precision() -> None:
    master = master_state(0)
    gen = torch.Generator().manual_seed(1)
    pub = WeightPublisher(keyframe_interval=10, precisions=PRECISIONS, chunk_bytes=4096)
    rxs = {p: WeightReceiver(p) for p in PRECISIONS}
    pub.publish(0, master)
    dtypes = {t.dtype for t in pub.snapshot("fp8").values()}
    assert {torch.bfloat16, torch.float32, torch.float8_e4m3fn} <= dtypes  # the mix under test
    kinds: dict[str, list[str]] = {p: [] for p in PRECISIONS}
    for version in range(1, 51):
        frac = 0.3 if version % 7 == 0 else 0.02  # now and then a dense step
        sparse_step(master, gen, frac=frac, lr=1e-3 if version % 5 else 1e-2)
        pub.publish(version, master)
        for p, rx in rxs.items():
            kinds[p] += ["K" if m.is_keyframe else "d" for m in sync(pub, p, rx)]
            assert rx.version == version and not rx.needs_keyframe
            assert same_bytes(rx.snapshot, pub.snapshot(p)), (p, version)  # type: ignore[arg-type]
    for p in PRECISIONS:  # first contact: keyframe 0 + delta 1; then one delta per step
        assert kinds[p] == ["K"] + ["d"] * 50, p


def failure_setup() -> tuple[WeightPublisher, WeightReceiver, dict[str, torch.Tensor], torch.Generator]:
    master = master_state(2)
    gen = torch.Generator().manual_seed(3)
    pub = WeightPublisher(keyframe_interval=4, precisions=("bf16",))
    rx = WeightReceiver("bf16")
    for v in range(6):
        pub.publish(v, master)
        sync(pub, "r", rx)
        sparse_step(master, gen, frac=0.05)
    pub.publish(6, master)
    return pub, rx, master, gen


def assert_refused_then_recovers(pub: WeightPublisher, rx: WeightReceiver, bad, error: type[DeltaError]) -> None:
    before = clone(rx.snapshot)  # type: ignore[arg-type]
    held = rx.version
    with pytest.raises(error):
        bad()
    assert same_bytes(rx.snapshot, before) and rx.version == held  # type: ignore[arg-type]
    assert rx.needs_keyframe and rx.have_version is None
    msgs = sync(pub, "r", rx)
    assert msgs[0].is_keyframe  # the receiver's request turned into a keyframe path
    assert rx.version == pub.latest_version and not rx.needs_keyframe
    assert same_bytes(rx.snapshot, pub.snapshot("bf16"))  # type: ignore[arg-type]


def test_flipped_byte_is_refused_weights_stay_and_a_keyframe_recovers() -> None:
    pub, rx, _, _ = failure_setup()
    (delta,) = pub.updates_for("r", rx.have_version, "bf16")
    frames = delta.to_frames()
    big = max(range(1, len(frames)), key=lambda i: len(frames[i]))
    frames[big] = flip(bytes(frames[big]), len(frames[big]) // 2)
    corrupted = WeightMessage.from_frames(frames)
    assert_refused_then_recovers(pub, rx, lambda: rx.apply(corrupted), (HashMismatchError, CorruptPayloadError))  # type: ignore[arg-type]


@pytest.mark.parametrize("cut", ["drop a frame", "cut a frame", "cut the file"])
def test_truncated_message_is_refused_weights_stay_and_a_keyframe_recovers(cut: str) -> None:
    pub, rx, _, _ = failure_setup()
    (delta,) = pub.updates_for("r", rx.have_version, "bf16")
    frames = delta.to_frames()
    feed = {
        "drop a frame": lambda: rx.apply_frames(frames[:-1]),
        "cut a frame": lambda: rx.apply_frames([*frames[:-1], bytes(frames[-1])[:-3]]),
        "cut the file": lambda: rx.apply_bytes(delta.to_bytes()[:-100]),
    }[cut]
    assert_refused_then_recovers(pub, rx, feed, MalformedMessageError)


def test_delta_for_the_wrong_base_is_refused_weights_stay_and_a_keyframe_recovers() -> None:
    pub, rx, master, gen = failure_setup()
    sync(pub, "r", rx)
    stale = pub.held("bf16")[-1]  # the delta that brought it to 6, replayed
    assert rx.version == 6 and stale.base_version == 5
    assert_refused_then_recovers(pub, rx, lambda: rx.apply(stale), VersionError)
    sparse_step(master, gen)
    for v in (7, 8):
        pub.publish(v, master)
    gap = pub.held("bf16")[-1]  # 7 -> 8 while the receiver is at 6
    assert gap.base_version == 7
    assert_refused_then_recovers(pub, rx, lambda: rx.apply(gap), VersionError)


def test_joiner_and_lagger_each_get_the_smaller_path_and_end_bit_exact() -> None:
    master = master_state(4)
    gen = torch.Generator().manual_seed(5)
    pub = WeightPublisher(keyframe_interval=20, precisions=("bf16",))
    pub.publish(0, master)
    joiner = WeightReceiver("bf16")
    joiner.apply(pub.keyframe("bf16"))
    pub.register("joiner", "bf16", version=0)  # holds 0, then goes quiet
    lagger = WeightReceiver("bf16")
    for v in range(1, 41):
        sparse_step(master, gen, frac=0.1)
        pub.publish(v, master)
        if v <= 37:
            sync(pub, "lagger", lagger)
    assert lagger.version == 37 and pub.latest_version == 40
    deltas = {m.version: m for m in pub.held("bf16") if not m.is_keyframe}
    keyframe = pub.keyframe("bf16")
    assert keyframe.version == 40 and set(deltas) == set(range(1, 41))  # the joiner pins the chain

    def cost(msgs: list[WeightMessage]) -> int:
        return sum(m.nbytes for m in msgs)

    for rid, rx, have in (("joiner", joiner, 0), ("lagger", lagger, 37)):
        chain = [deltas[v] for v in range(have + 1, 41)]
        path = pub.updates_for(rid, rx.have_version, "bf16")
        assert cost(path) == min(cost(chain), cost([keyframe])), rid
        assert path == ([keyframe] if rid == "joiner" else chain)  # far behind: keyframe; close: deltas
        for m in path:
            pub.ack(rid, rx.apply(m))
        assert rx.version == 40 and same_bytes(rx.snapshot, pub.snapshot("bf16")), rid  # type: ignore[arg-type]
    assert [m.version for m in pub.held("bf16")] == [40]  # everyone is current: only the keyframe stays


def test_keyframe_plus_tail_when_the_keyframe_is_older_than_latest() -> None:
    master = master_state(6)
    gen = torch.Generator().manual_seed(7)
    pub = WeightPublisher(keyframe_interval=5, precisions=("fp8",))
    for v in range(13):
        pub.publish(v, master)
        sparse_step(master, gen, frac=0.5, lr=1e-1)
    path = pub.updates_for("new", None, "fp8")
    assert [(m.is_keyframe, m.version) for m in path] == [(True, 10), (False, 11), (False, 12)]
    rx = WeightReceiver("fp8")
    assert rx.apply_all(path) == 12 and same_bytes(rx.snapshot, pub.snapshot("fp8"))  # type: ignore[arg-type]


def test_history_is_collected_down_to_what_receivers_may_need() -> None:
    master = master_state(8)
    gen = torch.Generator().manual_seed(9)
    pub = WeightPublisher(keyframe_interval=10, precisions=("bf16",))

    def held() -> list[str]:
        return [f"K{m.version}" if m.is_keyframe else f"d{m.version}" for m in pub.held("bf16")]

    for v in range(16):
        pub.publish(v, master)
        sparse_step(master, gen)
        if v == 5:
            pub.register("a", "bf16", 5)
        if v == 12:
            pub.register("b", "bf16", 12)
    assert held() == ["K10"] + [f"d{v}" for v in range(6, 16)]  # chain since a's 5
    pub.ack("a", 15)
    assert held() == ["K10"] + [f"d{v}" for v in range(11, 16)]  # keyframe path for joiners
    pub.forget("b")
    pub.forget("b")  # idempotent
    for v in range(16, 21):
        pub.publish(v, master)
    assert held() == ["K20"] + [f"d{v}" for v in range(16, 21)]  # a still needs 15 -> 20
    pub.ack("a", 20)
    assert held() == ["K20"]


def test_acknowledging_many_registers_the_unknown_and_collects_once() -> None:
    master = master_state(8)
    gen = torch.Generator().manual_seed(3)
    pub = WeightPublisher(keyframe_interval=10, precisions=("bf16", "fp8"))

    def publish(versions: range) -> None:
        for v in versions:
            pub.publish(v, master)
            sparse_step(master, gen)

    publish(range(6))
    # "b" never asked for a path (it applied one "a" asked for): it is registered at its ack,
    # and its version holds history back like any receiver's.
    pub.acknowledge({"a": 5, "b": 3}, "bf16")
    publish(range(6, 14))
    assert [m.version for m in pub.held("bf16")] == [10, *range(4, 14)]  # K10, the chain from b's 3
    pub.acknowledge({"a": 13, "b": 13}, "bf16")
    assert [m.version for m in pub.held("bf16")] == [10, 11, 12, 13]  # the keyframe path alone
    assert pub.updates_for("b", 13, "bf16") == []  # known, current
    # versions never published are named; the rest are recorded first
    with pytest.raises(VersionError, match="'c': 99"):
        pub.acknowledge({"c": 99, "d": 12}, "bf16")
    pub.ack("d", 13)  # registered
    with pytest.raises(UnknownReceiverError):
        pub.ack("c", 13)
    with pytest.raises(StructureMismatchError, match="registered for bf16"):
        pub.acknowledge({"a": 13}, "fp8")
    with pytest.raises(StructureMismatchError):
        pub.acknowledge({"a": 13}, "fp32")  # a precision not published


def test_protocol_errors_are_specific() -> None:
    pub = WeightPublisher(keyframe_interval=3, precisions=("bf16",))
    assert pub.updates_for("x", None, "bf16") == []  # nothing published yet
    pub.publish(0, master_state(0))
    with pytest.raises(VersionError):
        pub.publish(0, master_state(0))
    with pytest.raises(UnknownReceiverError):
        pub.ack("ghost", 0)
    with pytest.raises(VersionError):
        pub.ack("x", 5)
    with pytest.raises(VersionError):
        pub.updates_for("x", 7, "bf16")
    with pytest.raises(StructureMismatchError):
        pub.updates_for("y", None, "fp8")
    with pytest.raises(StructureMismatchError):
        pub.updates_for("x", None, "fp32")  # registered for bf16 by its first request
    rx = WeightReceiver("fp8")
    with pytest.raises(StructureMismatchError):
        rx.apply(pub.keyframe("bf16"))
    rx16 = WeightReceiver("bf16")
    pub.publish(1, master_state(1))
    with pytest.raises(VersionError, match="no weights"):
        rx16.apply(pub.held("bf16")[-1])
    with pytest.raises(ValueError):
        WeightPublisher(keyframe_interval=0)
    with pytest.raises(ValueError):
        WeightReceiver("bf16", snapshot={})


def test_layout_change_forces_a_keyframe_and_receivers_follow() -> None:
    pub = WeightPublisher(keyframe_interval=100, precisions=("bf16",))
    master = master_state(0)
    pub.publish(0, master)
    rx = WeightReceiver("bf16")
    sync(pub, "r", rx)
    grown = {**master, "extra.weight": torch.ones(3, 3)}
    new = pub.publish(1, grown)
    assert [m.is_keyframe for m in new] == [True]
    msgs = sync(pub, "r", rx)
    assert [m.is_keyframe for m in msgs] == [True] and same_bytes(rx.snapshot, pub.snapshot("bf16"))  # type: ignore[arg-type]
