"""Snapshots in shared memory, encoded by helper processes: the same bytes as threads,
arenas reused, and a helper that dies or misbehaves costs nothing but time."""

from __future__ import annotations

import gc
import json
import socket
import struct
import time

import pytest
import torch

from orchestrator.weightsync import (
    WeightPublisher,
    WeightReceiver,
    _shared,
    apply,
    decode_keyframe,
    encode_delta,
    encode_keyframe,
    wire_snapshot,
)

from ._util import clone, master_state, same_bytes, sparse_step
from .test_codec import mixed_snapshot, nudge


def helpers_ready(n: int = 1, timeout: float = 20.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with _shared._helpers_lock:
            procs = _shared.shared_helpers(n)
        if procs is not None:
            return procs
        time.sleep(0.02)
    raise AssertionError("helper processes did not start")


@pytest.mark.parametrize("frac", [0.0, 0.01, 0.2, 1.0])
def test_helpers_encode_the_same_bytes_as_threads(frac: float) -> None:
    prev = mixed_snapshot(0)
    new = nudge(prev, 1, frac)
    sprev, snew = _shared.share(prev), _shared.share(new)
    assert _shared.locate(snew["bf16"]) is not None and _shared.locate(new["bf16"]) is None
    helpers_ready()
    before = _shared.stats["helper_encodes"]
    delta = encode_delta(sprev, snew, 5, 4, "bf16", chunk_bytes=1024)
    key = encode_keyframe(snew, 5, "bf16", chunk_bytes=1024)
    assert _shared.stats["helper_encodes"] == before + 2
    assert _shared.helper_stats()["helper_cpu_s"] > 0  # the helper did work, and it is counted
    want_delta = encode_delta(prev, new, 5, 4, "bf16", chunk_bytes=1024)
    want_key = encode_keyframe(new, 5, "bf16", chunk_bytes=1024)
    assert delta.meta == want_delta.meta and key.meta == want_key.meta
    assert [bytes(f) for f in delta.frames] == [bytes(f) for f in want_delta.frames]
    assert [bytes(f) for f in key.frames] == [bytes(f) for f in want_key.frames]
    target = clone(prev)
    apply(delta, target)
    assert same_bytes(target, new) and same_bytes(decode_keyframe(key), new)


def test_one_snapshot_outside_shared_memory_encodes_on_threads() -> None:
    prev = mixed_snapshot(0)
    new = nudge(prev, 1, 0.1)
    helpers_ready()
    before = _shared.stats["helper_encodes"]
    delta = encode_delta(_shared.share(prev), new, 1, 0, "bf16", chunk_bytes=1024)
    assert _shared.stats["helper_encodes"] == before
    target = clone(prev)
    apply(delta, target)
    assert same_bytes(target, new)


def test_a_freed_arena_is_reused_and_the_idle_ones_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = [("a", torch.bfloat16, (1000, 3)), ("b", torch.float32, (17,))]
    snap = _shared.allocate(spec)
    assert snap is not None and snap["a"].shape == (1000, 3) and snap["b"].dtype == torch.float32
    aid = _shared.locate(snap["a"])[0]
    assert _shared.locate(snap["b"])[0] == aid
    del snap
    gc.collect()
    again = _shared.allocate(spec)
    assert _shared.locate(again["a"])[0] == aid  # the same memory, already mapped
    monkeypatch.setattr(_shared, "IDLE_BYTES", 0)
    del again
    gc.collect()
    assert aid not in _shared._arenas  # closed: nothing kept past the cap
    fresh = _shared.allocate(spec)
    assert _shared.locate(fresh["a"])[0] != aid


def test_a_killed_helper_costs_only_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_shared.stats, "helper_failures", 0)  # restored after the test
    prev = mixed_snapshot(0)
    new = nudge(prev, 1, 0.1)
    sprev, snew = _shared.share(prev), _shared.share(new)
    (helper,) = helpers_ready()
    helper.proc.kill()
    helper.proc.wait()
    failures = _shared.stats["helper_failures"]
    delta = encode_delta(sprev, snew, 1, 0, "bf16", chunk_bytes=1024)
    assert _shared.stats["helper_failures"] == failures + 1
    target = clone(prev)
    apply(delta, target)
    assert same_bytes(target, new)
    (other,) = helpers_ready()  # the next call started another
    assert other is not helper and other.proc.poll() is None


def test_a_helper_refuses_a_bad_request_and_keeps_serving() -> None:
    snap = _shared.share(mixed_snapshot(0))
    (helper,) = helpers_ready()
    head = json.dumps(
        {"level": 1, "algo": "xxh3-128", "chunk_bytes": 1024, "arenas": [], "sizes": [], "drop": []}
    ).encode()
    row = struct.pack("<6q", 424242, 0, 424242, 0, 8, 2)  # an arena it was never given
    helper.sock.sendall(struct.pack("<III", len(head), 1, 0) + head + row)
    with pytest.raises(_shared.HelperError, match="unknown arena 424242"):
        helper.collect(1, 16)
    assert helper.proc.poll() is None
    prev = _shared.share(snap)
    delta = encode_delta(prev, snap, 1, 0, "bf16", chunk_bytes=1024)  # still served, still exact
    target = clone(snap)
    apply(delta, target)
    assert same_bytes(target, snap)


def test_helper_exits_when_its_parent_socket_closes() -> None:
    h = _shared._Helper()
    assert h.sock.recv(1) == b"R"
    h.sock.shutdown(socket.SHUT_RDWR)
    assert h.proc.wait(timeout=10) == 0
    h.close()


def test_publisher_with_shared_snapshots_keeps_receivers_exact() -> None:
    state = master_state(1)
    pub = WeightPublisher(keyframe_interval=3, precisions=("bf16", "fp8"), chunk_bytes=2048)
    assert _shared.locate(wire_snapshot(state, "bf16", shared=True)["lm_head.weight"]) is not None
    helpers_ready()
    receivers = {p: WeightReceiver(p) for p in ("bf16", "fp8")}  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    before = _shared.stats["helper_encodes"]
    for version in range(6):
        sparse_step(state, gen)
        pub.publish(version, state)
        for p, r in receivers.items():
            for msg in pub.updates_for(p, r.version, p):  # type: ignore[arg-type]
                r.apply(msg)
            assert same_bytes(r.snapshot, wire_snapshot(state, p))  # type: ignore[arg-type]
    assert _shared.stats["helper_encodes"] > before


def test_helpers_that_cannot_start_are_given_up(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    broken = tmp_path / "helper.py"
    broken.write_text("import sys; sys.exit('no numpy here')\n")
    monkeypatch.setattr(_shared, "_HELPER", broken)
    monkeypatch.setitem(_shared.stats, "helper_failures", 0)
    _shared._close_all()
    prev = mixed_snapshot(0)
    new = nudge(prev, 1, 0.1)
    sprev, snew = _shared.share(prev), _shared.share(new)
    spawned = []
    real = _shared._Helper.__init__
    monkeypatch.setattr(_shared._Helper, "__init__", lambda self: (spawned.append(1), real(self))[1])
    deadline = time.monotonic() + 30
    while _shared.stats["helper_failures"] < _shared.MAX_FAILURES and time.monotonic() < deadline:
        delta = encode_delta(sprev, snew, 1, 0, "bf16", chunk_bytes=1024)  # threads meanwhile
        target = clone(prev)
        apply(delta, target)
        assert same_bytes(target, new)
        time.sleep(0.02)
    assert _shared.stats["helper_failures"] == _shared.MAX_FAILURES
    count = len(spawned)
    for _ in range(3):
        encode_delta(sprev, snew, 1, 0, "bf16", chunk_bytes=1024)
    assert len(spawned) == count == _shared.MAX_FAILURES  # no more are started
    monkeypatch.undo()
    _shared._close_all()


def test_an_encode_that_raises_midway_leaves_no_helper_out_of_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_shared.stats, "helper_failures", 0)
    prev = mixed_snapshot(0)
    new = nudge(prev, 1, 0.1)
    sprev, snew = _shared.share(prev), _shared.share(new)
    (helper,) = helpers_ready()
    rows = [(-1, 0, _shared.locate(snew["bf16"])[0], _shared.locate(snew["bf16"])[1], 8, 2)]

    def boom(indices: list[int]) -> list:
        raise RuntimeError("the caller's share failed")

    with pytest.raises(RuntimeError, match="caller's share"):
        _shared.encode_on_helpers(
            rows * 4, 1, level=1, algo="xxh3-128", chunk_bytes=1024, digest_size=16, run_here=boom
        )
    assert helper.proc.poll() is not None  # stopped: its unread reply cannot confuse the next encode
    delta = encode_delta(sprev, snew, 1, 0, "bf16", chunk_bytes=1024)
    target = clone(prev)
    apply(delta, target)
    assert same_bytes(target, new)


def test_helpers_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_shared, "ENABLED", False)  # as FLOTILLA_CODEC_HELPERS=0 does
    prev = mixed_snapshot(0)
    new = nudge(prev, 1, 0.1)
    before = _shared.stats["helper_encodes"]
    delta = encode_delta(_shared.share(prev), _shared.share(new), 1, 0, "bf16", chunk_bytes=1024)
    assert _shared.stats["helper_encodes"] == before
    assert not _shared.start_helpers(1)
    target = clone(prev)
    apply(delta, target)
    assert same_bytes(target, new)
