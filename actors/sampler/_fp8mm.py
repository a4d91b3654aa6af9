"""Real FP8 matmuls for FP8 pools: ``torch._scaled_mm`` on the e4m3 weights and their 128x128
block scales, instead of dequantising the weights once per update.

A weight arrives as e4m3 values ``w8`` [N, K] with ``scale_inv`` [ceil(N/128), ceil(K/128)]
(value = w8 * scale). ``Fp8Weight`` keeps ``w8`` split into 128-column blocks and, per block,
one scale per output row; fused weights (q|k|v, gate|up) concatenate along the rows. A
linear layer quantises each 128-column block of the activations to e4m3 with one scale per
row, runs one row-wise scaled FP8 matmul per block, and sums the blocks in float32: the
block scales of both sides are exact, only the activations' rounding to e4m3 is added.

Where: ``fp8_matmul_available(device)`` -- CUDA GPUs of compute capability 8.9 or newer
(Ada, Hopper, Blackwell) with ``torch._scaled_mm``. Elsewhere the engine dequantises. The
tests run this path on CPU (torch's CPU ``_scaled_mm``) against the dequantised one; on a GPU
it has NEVER RUN here (no GPU): ``scripts/gpu_check.sh`` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Fp8Weight", "fp8_linear", "fp8_matmul_available", "linear"]

_BLOCK = 128
_E4M3_MAX = 448.0


def fp8_matmul_available(device: torch.device) -> bool:
    """True on CUDA devices with FP8 tensor cores (capability >= 8.9) and ``torch._scaled_mm``."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass
class Fp8Weight:
    """An FP8 linear weight: e4m3 column blocks and per-row scales of each block."""

    blocks: list[torch.Tensor]
    """w8[:, j*128:(j+1)*128] for each column block j, contiguous, [N, <=128] e4m3."""
    scales: torch.Tensor
    """[KB, 1, N] float32: the scale of row n in column block j."""

    @classmethod
    def from_wire(cls, w8: torch.Tensor, scale_inv: torch.Tensor, device: torch.device) -> Fp8Weight:
        n, k = w8.shape
        kb = -(-k // _BLOCK)
        if tuple(scale_inv.shape) != (-(-n // _BLOCK), kb):
            raise ValueError(f"FP8 scales of shape {tuple(scale_inv.shape)} do not fit a {n}x{k} weight")
        w8 = w8.to(device)
        rows = scale_inv.to(device, torch.float32).repeat_interleave(_BLOCK, dim=0)[:n]  # [N, KB]
        return cls(
            [w8[:, j * _BLOCK : (j + 1) * _BLOCK].contiguous() for j in range(kb)], rows.t().unsqueeze(1).contiguous()
        )

    @classmethod
    def cat(cls, parts: list[Fp8Weight]) -> Fp8Weight:
        """Stack along the output rows (fused q|k|v, gate|up)."""
        return cls(
            [torch.cat(bs, dim=0) for bs in zip(*(p.blocks for p in parts), strict=True)],
            torch.cat([p.scales for p in parts], dim=2),
        )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks[0].shape[0], sum(b.shape[1] for b in self.blocks))


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """``x @ W.T`` for x [..., K] (any float dtype) with W in FP8 blocks; result in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    n = w.blocks[0].shape[0]
    out = torch.zeros(x2.shape[0], n, dtype=torch.float32, device=x.device)
    col = 0
    for j, wb in enumerate(w.blocks):
        xs = x2[:, col : col + wb.shape[1]].float()
        col += wb.shape[1]
        amax = xs.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        sa = amax / _E4M3_MAX
        xq = (xs / sa).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
        out += torch._scaled_mm(xq, wb.t(), scale_a=sa, scale_b=w.scales[j], out_dtype=torch.float32)
    return out.to(x.dtype).reshape(*lead, n)


def linear(x: torch.Tensor, w: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """``F.linear`` for dense weights, ``fp8_linear`` for FP8 ones."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w)
    return torch.nn.functional.linear(x, w)
