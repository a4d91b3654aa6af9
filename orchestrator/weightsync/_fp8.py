"""Wire snapshots per precision, and deterministic block-FP8 quantisation.

FP8 rule (matches block-FP8 checkpoints that SGLang loads, e.g. Qwen3-FP8 /
DeepSeek-V3): a floating tensor is quantised iff it is 2-D and its name
contains none of `skip` (default: `embed_tokens`, `lm_head`, which such
checkpoints keep in bf16). A quantised `name` becomes

* `name`: float8_e4m3fn, same shape;
* `name_scale_inv`: float32 [ceil(rows/128), ceil(cols/128)], one per
  128x128 block (edge blocks are partial), so that weight ~= fp8 * scale_inv.

Everything else that is floating (norms, biases, 1-D, 3-D+, embeddings) is
sent as bf16; non-floating tensors as they are.

Per block: s = amax(|w|) / 448 (448 = e4m3fn's largest finite value; s = 1
for an all-zero block), q = e4m3(clamp(w / s, -448, 448)) with round to
nearest even. Every step is a correctly rounded IEEE operation or an exact
max, so the same fp32 input gives the same bytes on any machine and any
thread count, and every FP8 sampler holds identical weights.

Error bound (tested): with v = w/s, e4m3 keeps 3 mantissa bits, so for
normal |v| >= 2^-6 rounding moves v by at most half an ulp, 2^-4 * 2^floor(log2|v|)
<= 2^-4 |v|; below that (subnormals, spacing 2^-9) by at most 2^-10. Scaling
back by s and allowing two fp32 roundings (w/s and q*s, 2^-24 each):

    |dequant(q) - w| <= (2^-4 + 2^-21) * |w| + 2^-10 * s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from ._message import Precision
from ._shared import allocate, share

__all__ = [
    "DEFAULT_FP8_SKIP",
    "FP8_BLOCK",
    "FP8_MAX",
    "dequantize_fp8",
    "fp8_should_quantize",
    "fp8_wire_snapshot",
    "quantize_fp8",
    "wire_snapshot",
]

FP8_BLOCK = 128
FP8_MAX = 448.0
DEFAULT_FP8_SKIP: tuple[str, ...] = ("embed_tokens", "lm_head")
SCALE_SUFFIX = "_scale_inv"


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Zero-pad a 2-D tensor to whole blocks; view as [br, B, bc, B]."""
    rows, cols = x.shape
    br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = F.pad(x, (0, bc * FP8_BLOCK - cols, 0, br * FP8_BLOCK - rows))
    return padded.view(br, FP8_BLOCK, bc, FP8_BLOCK), rows, cols


def quantize_fp8(
    weight: torch.Tensor, *, name: str = "weight", device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [ceil(r/128), ceil(c/128)]), computed and
    returned on `device`.

    Raises ValueError naming the tensor when it is not 2-D or holds NaN/inf
    (a non-finite weight has no meaningful block scale).
    """
    if weight.dim() != 2:
        raise ValueError(f"tensor {name!r}: FP8 block quantisation needs a 2-D tensor, got shape {tuple(weight.shape)}")
    w = weight.detach().to(device=device, dtype=torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"tensor {name!r}: cannot quantise non-finite values to FP8")
    blocks, rows, cols = _blocks(w)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = amax / FP8_MAX
    # s = 1 for all-zero blocks (and blocks so tiny that amax/448 underflows):
    # q is then 0 or subnormal-rounded, within the bound above.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(blocks.shape[0] * FP8_BLOCK, blocks.shape[2] * FP8_BLOCK)[:rows, :cols].contiguous()
    return q, scale.contiguous()


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight ~= q * scale_inv per 128x128 block, as `dtype`. Raises ValueError
    when scale_inv's shape does not match q's block grid."""
    blocks, rows, cols = _blocks(q.to(torch.float32))
    if tuple(scale_inv.shape) != (blocks.shape[0], blocks.shape[2]):
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not fit weight {tuple(q.shape)}")
    w = blocks * scale_inv.to(torch.float32)[:, None, :, None]
    return w.view(blocks.shape[0] * FP8_BLOCK, -1)[:rows, :cols].to(dtype).contiguous()


def fp8_should_quantize(name: str, tensor: torch.Tensor, skip: Sequence[str] = DEFAULT_FP8_SKIP) -> bool:
    """The FP8 rule: floating, 2-D, and no `skip` substring in the name."""
    return tensor.is_floating_point() and tensor.dim() == 2 and not any(s in name for s in skip)


def _copy(t: torch.Tensor, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    # Always a fresh contiguous copy: a wire snapshot must never alias the
    # trainer's live tensors, or the next delta would be computed against
    # bytes that have already moved.
    src = t.detach()
    out = torch.empty(src.shape, dtype=dtype or src.dtype, device=device)
    out.copy_(src)
    return out


def fp8_wire_snapshot(
    master: Mapping[str, torch.Tensor], *, skip: Sequence[str] = DEFAULT_FP8_SKIP, keep_device: bool = False
) -> dict[str, torch.Tensor]:
    """FP8 wire snapshot of a state dict (see module docstring for the rule), on the CPU,
    or with `keep_device` each tensor on its master's device.
    Raises ValueError if a produced `<name>_scale_inv` collides with an
    existing tensor name, or as `quantize_fp8` does."""
    out: dict[str, torch.Tensor] = {}
    for name, t in master.items():
        dev = t.device if keep_device else "cpu"
        if fp8_should_quantize(name, t, skip):
            scale_name = name + SCALE_SUFFIX
            if scale_name in master:
                raise ValueError(f"tensor {name!r}: its scale name {scale_name!r} is already a tensor")
            out[name], out[scale_name] = quantize_fp8(t, name=name, device=dev)
        else:
            out[name] = _copy(t, torch.bfloat16 if t.is_floating_point() else None, dev)
    return out


def wire_snapshot(
    master: Mapping[str, torch.Tensor],
    precision: Precision,
    *,
    fp8_skip: Sequence[str] = DEFAULT_FP8_SKIP,
    shared: bool = False,
    keep_device: bool = False,
) -> dict[str, torch.Tensor]:
    """The snapshot samplers of `precision` hold, built from master weights:
    bf16 / fp32 cast every floating tensor (fresh copies), fp8 follows
    `fp8_wire_snapshot`. The copies lie on the CPU, or with `keep_device` on each master
    tensor's own device (a GPU: where `DeviceDeltas` finds deltas); `shared` is then
    ignored. With `shared`, the tensors lie in one shared-memory arena
    (`_shared`), so that encoding them runs on helper processes, not threads (where
    no shared memory can be had, they are ordinary tensors). Raises ValueError for an
    unknown precision."""
    shared = shared and not keep_device
    if precision == "fp8":
        snap = fp8_wire_snapshot(master, skip=fp8_skip, keep_device=keep_device)
        return share(snap) if shared else snap
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"unknown precision {precision!r}; expected bf16, fp8 or fp32")
    dt = torch.bfloat16 if precision == "bf16" else torch.float32
    out = None
    if shared:  # cast straight into the arena: one pass, as for a fresh copy
        out = allocate([(n, dt if t.is_floating_point() else t.dtype, tuple(t.shape)) for n, t in master.items()])
    if out is None:
        return {
            n: _copy(t, dt if t.is_floating_point() else None, t.device if keep_device else "cpu")
            for n, t in master.items()
        }
    for n, t in master.items():
        out[n].copy_(t.detach())
    return out
