"""1,000 corrupted, forged and replayed weight messages against real receivers.

Messages are built by a real publisher, then altered on the wire form (the JSON
metadata frame and the chunk frames a sampler receives). Not one may change what a
receiver holds: no version goes back or jumps, no byte changes, whatever raised.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from orchestrator.weightsync import (
    AuthenticationError,
    DeltaError,
    VersionError,
    WeightMessage,
    WeightPublisher,
    WeightReceiver,
    seal,
)

from ._util import clone, flip, master_state, same_bytes, sparse_step

HELD = 6


def _history() -> tuple[WeightPublisher, dict[int, WeightMessage], dict[int, WeightMessage], dict]:
    """Versions 0..8 published (keyframes every 4); every message kept, and the v6 snapshot."""
    master = master_state(7)
    gen = torch.Generator().manual_seed(8)
    pub = WeightPublisher(keyframe_interval=4, precisions=("bf16",))
    keyframes: dict[int, WeightMessage] = {}
    deltas: dict[int, WeightMessage] = {}  # by version
    snap6 = None
    for v in range(9):
        for m in pub.publish(v, master):
            (keyframes if m.is_keyframe else deltas)[m.version] = m
        if v == HELD:
            snap6 = clone(pub.snapshot("bf16"))
        sparse_step(master, gen, frac=0.05)
    assert sorted(keyframes) == [0, 4, 8] and sorted(deltas) == list(range(1, 9))
    return pub, keyframes, deltas, snap6


def _edit_meta(msg: WeightMessage, edit) -> list[bytes]:
    frames = [bytes(f) for f in msg.to_frames()]
    meta = json.loads(frames[0])
    edit(meta)
    return [json.dumps(meta).encode(), *frames[1:]]


def _forgeries(keyframes, deltas, rng: random.Random):
    """(kind, frames) of bad messages for a receiver holding HELD."""
    d7, d8, kf8 = deltas[7], deltas[8], keyframes[8]

    def tensor_edit(meta, what):
        t = rng.choice(meta["tensors"])
        if what == "rename":
            t["name"] = t["name"] + ".x"
        elif what == "hash":
            other = rng.choice(meta["tensors"])
            t["hash"], other["hash"] = other["hash"], t["hash"]
            if t is other:
                t["hash"] = t["hash"][::-1]
        elif what == "drop":
            meta["tensors"].remove(t)
        elif what == "shape":
            t["shape"] = list(reversed(t["shape"])) + [1]
        elif what == "dtype":
            t["dtype"] = "float16" if t["dtype"] != "float16" else "bfloat16"

    kinds = {
        "forged version": lambda: _edit_meta(
            rng.choice([d7, kf8]), lambda m: m.update(version=m["version"] + rng.randint(1, 50))
        ),
        "forged base": lambda: _edit_meta(d8, lambda m: m.update(base_version=HELD)),
        "forged delta->keyframe": lambda: _edit_meta(
            d7, lambda m: m.update(base_version=None, encoding="keyframe-zstd")
        ),
        "forged precision": lambda: _edit_meta(d7, lambda m: m.update(precision="fp32")),
        "forged chunk size": lambda: _edit_meta(d7, lambda m: m.update(chunk_bytes=m["chunk_bytes"] * 2)),
        "forged tensor list": lambda: _edit_meta(
            rng.choice([d7, kf8]), lambda m: tensor_edit(m, rng.choice(["rename", "hash", "drop", "shape", "dtype"]))
        ),
        "digest removed": lambda: _edit_meta(d7, lambda m: m.update(digest="")),
        "flipped payload byte": lambda: _flip_payload(rng.choice([d7, kf8]), rng),
        "truncated": lambda: _truncate(rng.choice([d7, kf8]), rng),
        "garbage metadata": lambda: [
            bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64))),
            *[bytes(f) for f in d7.frames],
        ],
        "replayed old keyframe": lambda: rng.choice([keyframes[0], keyframes[4]]).to_frames(),
        "replayed old delta": lambda: deltas[rng.randint(1, HELD)].to_frames(),
        "delta with a gap": lambda: d8.to_frames(),
    }
    names = sorted(kinds)
    for i in range(1000):
        kind = names[i % len(names)]
        yield kind, kinds[kind]()


def _flip_payload(msg: WeightMessage, rng: random.Random) -> list[bytes]:
    frames = [bytes(f) for f in msg.to_frames()]
    i = rng.randrange(1, len(frames))
    frames[i] = flip(frames[i], rng.randrange(len(frames[i])), 1 << rng.randrange(8))
    return frames


def _truncate(msg: WeightMessage, rng: random.Random) -> list[bytes]:
    frames = [bytes(f) for f in msg.to_frames()]
    i = rng.randrange(len(frames))
    if rng.random() < 0.5:
        return frames[:i] + frames[i + 1 :]
    frames[i] = frames[i][: rng.randrange(len(frames[i]))]
    return frames


def test_a_thousand_bad_messages_none_accepted_no_snapshot_changed() -> None:
    pub, keyframes, deltas, snap6 = _history()
    rng = random.Random(0)
    refused: Counter[str] = Counter()
    staged: Counter[str] = Counter()
    accepted = changed = 0
    for i, (kind, frames) in enumerate(_forgeries(keyframes, deltas, rng)):
        rx = WeightReceiver("bf16", clone(snap6), HELD)
        if i % 2:  # half of them wait for a keyframe (a refused update came first)
            with pytest.raises(VersionError):
                rx.apply(deltas[8])
            assert rx.needs_keyframe
        try:
            rx.apply_frames(frames)
        except DeltaError:
            refused[kind] += 1
        else:
            if rx.staged_version is not None:
                staged[kind] += 1  # built aside, below the held version; not swapped in
            else:
                accepted += 1
        if rx.version != HELD or not same_bytes(rx.snapshot, snap6):  # type: ignore[arg-type]
            changed += 1
        # Whatever came before, the honest path still brings it to the latest, bit-exact.
        if i % 50 == 0:
            rx.apply_all(
                WeightMessage.from_frames(m.to_frames()) for m in pub.updates_for(f"r{i}", rx.have_version, "bf16")
            )
            assert rx.version == 8 and same_bytes(rx.snapshot, pub.snapshot("bf16"))  # type: ignore[arg-type]
    assert accepted == 0 and changed == 0
    assert sum(refused.values()) + sum(staged.values()) == 1000
    # Only an old keyframe, offered while a keyframe is needed, is staged; everything else raises.
    assert set(staged) <= {"replayed old keyframe"} and staged["replayed old keyframe"] > 0
    for kind in ("forged version", "forged base", "forged tensor list", "replayed old delta"):
        assert refused[kind] >= 1000 // 13, kind  # every one of each kind refused
    print(f"refused {sum(refused.values())}, staged {sum(staged.values())}, accepted {accepted}, changed {changed}")


def test_a_replayed_keyframe_path_never_rolls_back() -> None:
    """The issue's case: v5 receiver waiting for a keyframe, offered keyframe v0."""
    _pub, keyframes, deltas, snap6 = _history()
    rx = WeightReceiver("bf16", clone(snap6), HELD)
    with pytest.raises(VersionError):
        rx.apply(deltas[8])  # a gap: now it needs a keyframe
    for _ in range(3):
        assert rx.apply(keyframes[0]) == HELD and rx.staged_version == 0
        assert rx.apply(deltas[1]) == HELD and rx.staged_version == 1
    assert same_bytes(rx.snapshot, snap6)  # type: ignore[arg-type]
    # The honest keyframe path (keyframe 4, deltas 5, 6) catches up: swapped in at 6, bit-exact.
    for m in (keyframes[4], deltas[5], deltas[6]):
        rx.apply(m)
    assert rx.version == HELD and rx.staged_version is None and not rx.needs_keyframe
    assert same_bytes(rx.snapshot, snap6)  # type: ignore[arg-type]
    with pytest.raises(VersionError, match="stale keyframe"):
        rx.apply(keyframes[4])  # not waiting any more: an old keyframe is refused outright
    assert rx.apply(deltas[7]) == 7 and rx.apply(deltas[8]) == 8


def test_keyed_messages_refuse_a_forger_who_recomputes_the_plain_digest() -> None:
    key = b"k" * 32
    master = master_state(9)
    gen = torch.Generator().manual_seed(10)
    pub = WeightPublisher(keyframe_interval=4, precisions=("bf16",), auth_key=key)
    rx = WeightReceiver("bf16", auth_key=key)
    for v in range(3):
        for m in pub.updates_for("r", rx.have_version, "bf16") if v else []:
            rx.apply(m)
        pub.publish(v, master)
        sparse_step(master, gen)
    (d2,) = pub.updates_for("r", rx.have_version, "bf16")
    held, before = rx.version, clone(rx.snapshot)  # type: ignore[arg-type]
    forged = WeightMessage(d2.meta.model_copy(update={"version": 9}), d2.frames)
    for bad in (seal(forged), seal(forged, b"x" * 32), seal(d2)):  # plain digest, wrong key, plain
        with pytest.raises(AuthenticationError):
            rx.apply(WeightMessage.from_frames(bad.to_frames()))
        assert rx.version == held and same_bytes(rx.snapshot, before)  # type: ignore[arg-type]
    rx.apply_all(pub.updates_for("r", rx.have_version, "bf16"))
    assert rx.version == 2 and same_bytes(rx.snapshot, pub.snapshot("bf16"))  # type: ignore[arg-type]
    # An unkeyed receiver does not take keyed messages either (the digests differ).
    with pytest.raises(AuthenticationError):
        WeightReceiver("bf16").apply(pub.keyframe("bf16"))
