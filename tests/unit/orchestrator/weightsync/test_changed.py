"""`WeightReceiver.last_changed`: after a delta, per tensor exactly the flat elements it
changed (None for a tensor sent dense); None after keyframes, staged messages and failures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orchestrator.weightsync import DeltaError, WeightMessage, WeightPublisher, WeightReceiver

from ._util import clone, flip, master_state, sparse_step


def _differ(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    wa = a.reshape(-1).view(torch.uint8).view(-1, a.element_size())
    wb = b.reshape(-1).view(torch.uint8).view(-1, b.element_size())
    return (wa != wb).any(dim=1).nonzero().view(-1).numpy()


@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp32"])
def test_last_changed_lists_exactly_the_changed_elements(precision: str) -> None:
    master = master_state(0)
    pub = WeightPublisher(keyframe_interval=100, precisions=(precision,), chunk_bytes=4096, helper_processes=False)
    rx = WeightReceiver(precision)  # type: ignore[arg-type]
    (kf,) = pub.publish(0, master)
    rx.apply(kf)
    assert rx.last_changed is None
    gen = torch.Generator().manual_seed(1)
    for version in range(1, 6):
        sparse_step(master, gen)
        if version == 3:
            master["model.norm.weight"] *= 1.5  # every element: sent dense
        before = clone(rx.snapshot)  # type: ignore[arg-type]
        (delta,) = pub.publish(version, master)
        rx.apply(WeightMessage.from_frames(delta.to_frames()))
        changed = rx.last_changed
        assert changed is not None
        for name, t in rx.snapshot.items():  # type: ignore[union-attr]
            if version == 3 and name == "model.norm.weight":
                assert changed[name] is None  # every element changed: not listed
                continue
            got = changed.get(name, np.empty(0, np.int32))
            assert got is not None and got.dtype == np.int32 and np.all(np.diff(got) > 0), name
            assert np.array_equal(got, _differ(before[name], t)), name


def test_last_changed_with_parallel_apply_and_many_chunks() -> None:
    g = torch.Generator().manual_seed(2)
    master = {"big": torch.randn(6_500_000, generator=g) * 0.02, "small": torch.randn(300, generator=g)}
    pub = WeightPublisher(keyframe_interval=100, chunk_bytes=1 << 20, threads=2, helper_processes=False)
    rx = WeightReceiver("bf16", threads=2)
    (kf,) = pub.publish(0, master)
    rx.apply(kf)
    sparse_step(master, g, frac=0.01)
    before = clone(rx.snapshot)  # type: ignore[arg-type]
    (delta,) = pub.publish(1, master)
    assert delta.meta.chunk_bytes >= 1 << 20 and len(delta.meta.tensors[0].chunks) > 4
    rx.apply(delta)
    changed = rx.last_changed
    assert changed is not None
    assert len(changed["big"]) > 1000
    for name in master:
        got = changed.get(name, np.empty(0, np.int32))
        assert got is not None and np.array_equal(got, _differ(before[name], rx.snapshot[name])), name  # type: ignore[index]


def test_last_changed_is_none_after_failures_staging_and_keyframes() -> None:
    master = master_state(0)
    pub = WeightPublisher(keyframe_interval=2, chunk_bytes=4096, helper_processes=False)
    rx = WeightReceiver("bf16")
    assert rx.last_changed is None
    gen = torch.Generator().manual_seed(3)
    msgs = {}
    for version in range(4):
        if version:
            sparse_step(master, gen)
        msgs[version] = pub.publish(version, master)
    rx.apply(msgs[0][0])
    (d1,) = msgs[1]
    rx.apply(d1)
    assert rx.last_changed
    d2 = msgs[2][0]
    bad = d2.to_frames()
    big = max(range(1, len(bad)), key=lambda i: len(bad[i]))
    bad[big] = flip(bytes(bad[big]), len(bad[big]) // 2)
    with pytest.raises(DeltaError):
        rx.apply_frames(bad)
    assert rx.last_changed is None and rx.needs_keyframe
    # The keyframe path: keyframe 2 (above the held version 1), then delta 2->3.
    kf2 = next(m for m in msgs[2] if m.is_keyframe)
    rx.apply(kf2)
    assert rx.last_changed is None
    rx.apply(msgs[3][0])
    assert rx.last_changed
    # A replayed old keyframe while a keyframe is needed is staged: nothing known changed.
    rx.needs_keyframe = True
    rx.apply(kf2)
    assert rx.staged_version == 2 and rx.last_changed is None
