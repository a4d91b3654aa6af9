"""Coarse weight formats a sampler can emulate on top of its wire precision.

A pool's `emulate_quant` re-quantises every linear weight the torch engine multiplies
with (each HF tensor on its own, after the wire precision's own rounding) and computes
with the dequantised result. Nothing gets faster: this is a mismatch device, so a run
can see how training copes with a sampler whose numerics are much coarser than the
trainer's (benchmarks/stability.py --sweep). Embeddings, the LM head and norms are left
as the wire precision delivered them.

Formats (x is one weight tensor [rows, cols], in float32):

* ``e5m2_tensor``  float8 e5m2 with one scale per tensor: s = amax|x| / 57344 (e5m2's
  largest finite value), x ~= e5m2(x / s) * s. Two mantissa bits, so a normal value
  moves by up to 2^-3 of itself, twice e4m3's error, and one outlier sets the scale of
  the whole tensor.
* ``int4_group``   symmetric 4-bit integers in groups of 32 consecutive columns of a row
  (GPTQ/AWQ-style group size): s = amax|group| / 7, x ~= clamp(round(x / s), -8, 7) * s;
  an error of up to s/2 = amax/14 per value.
* ``int3_group``, ``int2_group``  the same with 3 and 2 bits: s = amax / 3, levels -4..3
  (error up to amax/6); s = amax, levels -2..1 (error up to amax/2: a weight is rounded
  to -amax, 0 or +amax). Coarser than any format a real pool serves in: they extend the
  mismatch axis past the point where the recipe itself breaks.

Both are deterministic (round to nearest even) and map an all-zero tensor or group to zeros.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["EMULATED_FORMATS", "EmulatedFormat", "emulate_quant"]

EmulatedFormat = Literal["e5m2_tensor", "int4_group", "int3_group", "int2_group"]
EMULATED_FORMATS: tuple[str, ...] = ("e5m2_tensor", "int4_group", "int3_group", "int2_group")

_E5M2_MAX = 57344.0
_INT_GROUP = 32
_INT_BITS = {"int4_group": 4, "int3_group": 3, "int2_group": 2}


def emulate_quant(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """`weight` rounded through `fmt` and back, in weight's dtype and shape.

    Raises ValueError for an unknown format, a weight that is not 2-D, or non-finite values.
    """
    if fmt not in EMULATED_FORMATS:
        raise ValueError(f"emulate_quant must be one of {EMULATED_FORMATS}, got {fmt!r}")
    if weight.dim() != 2:
        raise ValueError(f"emulate_quant {fmt!r} needs a 2-D weight, got shape {tuple(weight.shape)}")
    x = weight.detach().float()
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"emulate_quant {fmt!r}: the weight holds non-finite values")
    if fmt == "e5m2_tensor":
        amax = float(x.abs().max()) if x.numel() else 0.0
        s = amax / _E5M2_MAX if amax > 0 else 1.0
        out = (x / s).clamp(-_E5M2_MAX, _E5M2_MAX).to(torch.float8_e5m2).float() * s
        return out.to(weight.dtype)
    top = 2 ** (_INT_BITS[fmt] - 1)  # levels -top .. top - 1
    rows, cols = x.shape
    pad = (-cols) % _INT_GROUP
    g = torch.nn.functional.pad(x, (0, pad)).view(rows, -1, _INT_GROUP)
    s = g.abs().amax(dim=2, keepdim=True) / (top - 1)
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(g / s).clamp(-top, top - 1) * s
    return q.view(rows, -1)[:, :cols].to(weight.dtype).contiguous()
