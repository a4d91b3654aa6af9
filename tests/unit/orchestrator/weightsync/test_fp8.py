"""Block-FP8 wire: determinism, the derived error bound, the quantise-or-not rule."""

from __future__ import annotations

import pytest
import torch

from orchestrator.weightsync import (
    FP8_BLOCK,
    FP8_MAX,
    dequantize_fp8,
    fp8_should_quantize,
    fp8_wire_snapshot,
    quantize_fp8,
    wire_snapshot,
)

from ._util import master_state, same_bytes


def awkward_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Blocks of very different magnitudes, an outlier, an all-zero block,
    and values down in e4m3's subnormal range after scaling."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w *= torch.logspace(-6, 2, rows)[:, None]  # row blocks from 1e-6 to 1e2
    w[0, 0] = 1e4  # one outlier sets its block's scale
    if rows > FP8_BLOCK:
        w[-(rows % FP8_BLOCK or FP8_BLOCK) :, :] = 0.0  # all-zero (partial) blocks
    return w


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (1, 5), (129, 128), (300, 1)])
def test_dequantised_error_is_within_the_e4m3_bound(shape: tuple[int, int]) -> None:
    w = awkward_weight(*shape, seed=sum(shape))
    q, scale = quantize_fp8(w)
    rows, cols = shape
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    s = scale.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    err = (dequantize_fp8(q, scale) - w).abs()
    # Derived in orchestrator/weightsync/_fp8.py: half an ulp of a 3-bit
    # mantissa relative to |w| for normals, half the subnormal spacing
    # (2^-10 in scaled units) below, plus two fp32 roundings.
    bound = (2**-4 + 2**-21) * w.abs() + 2**-10 * s
    assert bool((err <= bound).all()), float((err / bound).max())
    if w.numel() >= 1000:  # the bound is tight, not vacuous: some element gets close to it
        assert float((err / bound).max()) > 0.8
    # Each block's largest magnitude maps to +-448 exactly, so it comes back nearly exact.
    assert float(q.float().abs().max()) == FP8_MAX
    amax_rel = (err[w.abs() == w.abs().max()] / w.abs().max()).max()
    assert float(amax_rel) <= 2**-22


def test_quantisation_is_deterministic() -> None:
    w = awkward_weight(384, 260, seed=3)
    q1, s1 = quantize_fp8(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        q2, s2 = quantize_fp8(w.clone())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(s1.view(torch.int32), s2.view(torch.int32))
    a, b = fp8_wire_snapshot(master_state(1)), fp8_wire_snapshot(master_state(1))
    assert same_bytes(a, b)


def test_fp8_snapshot_follows_the_rule() -> None:
    master = master_state(0)
    snap = fp8_wire_snapshot(master)
    for name, t in master.items():
        if name.endswith(("embed_tokens.weight", "lm_head.weight")) or t.dim() != 2:
            assert snap[name].dtype == torch.bfloat16 and f"{name}_scale_inv" not in snap, name
            assert not fp8_should_quantize(name, t)
        else:
            assert snap[name].dtype == torch.float8_e4m3fn, name
            assert snap[f"{name}_scale_inv"].dtype == torch.float32
    assert set(snap) == set(master) | {f"{n}_scale_inv" for n in master if snap[n].dtype == torch.float8_e4m3fn}
    everything = fp8_wire_snapshot(master, skip=())
    assert everything["lm_head.weight"].dtype == torch.float8_e4m3fn


def test_wire_snapshots_are_fresh_copies() -> None:
    master = {"w": torch.randn(4, 4, dtype=torch.bfloat16), "steps": torch.arange(3)}
    for precision in ("bf16", "fp32", "fp8"):
        snap = wire_snapshot(master, precision)
        assert snap["steps"].dtype == torch.int64 and snap["w"].data_ptr() != master["w"].data_ptr()
        assert all(t.is_contiguous() for t in snap.values())
    with pytest.raises(ValueError, match="unknown precision"):
        wire_snapshot(master, "int4")  # type: ignore[arg-type]


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match=r"'x'.*2-D"):
        quantize_fp8(torch.ones(3), name="x")
    with pytest.raises(ValueError, match=r"'y'.*non-finite"):
        quantize_fp8(torch.tensor([[1.0, float("nan")]]), name="y")
    q, s = quantize_fp8(torch.ones(130, 10))
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize_fp8(q, s[:1])
    with pytest.raises(ValueError, match="already a tensor"):
        fp8_wire_snapshot({"a": torch.ones(2, 2), "a_scale_inv": torch.ones(1)})
