"""How a checkpoint maps onto the torch engine's compute form: which HF tensors each
fused block of a layer concatenates, the RoPE frequencies the HF model uses, one
wire-snapshot tensor as a dense compute tensor (FP8 blocks dequantised), and the
in-place update of a compute tensor from the elements a delta changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from orchestrator.weightsync import dequantize_fp8

__all__ = ["LINEAR_BLOCKS", "layer_parts", "patch_in_place", "rope_frequencies", "wire_to_compute"]

LINEAR_BLOCKS = ("qkv", "o", "gate_up", "down")
"""The fused blocks that can multiply in FP8."""

_ROPE_TYPES = ("default", "linear", "llama3")


def layer_parts(*, qk_norm: bool, qkv_bias: bool, o_bias: bool, mlp_bias: bool) -> dict[str, tuple[str, ...]]:
    """Fused compute blocks of one layer -> the HF tensors they concatenate."""
    parts = {
        "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "o": ("self_attn.o_proj.weight",),
        "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "down": ("mlp.down_proj.weight",),
        "ln1": ("input_layernorm.weight",),
        "ln2": ("post_attention_layernorm.weight",),
    }
    if qk_norm:
        parts["q_norm"] = ("self_attn.q_norm.weight",)
        parts["k_norm"] = ("self_attn.k_norm.weight",)
    if qkv_bias:
        parts["qkv_b"] = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
    if o_bias:
        parts["o_b"] = ("self_attn.o_proj.bias",)
    if mlp_bias:
        parts["gate_up_b"] = ("mlp.gate_proj.bias", "mlp.up_proj.bias")
        parts["down_b"] = ("mlp.down_proj.bias",)
    return parts


def rope_frequencies(cfg: Any) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling) as the HF model computes them; refuses dynamic kinds."""
    rope = dict(cfg.rope_parameters or {})
    kind = rope.get("rope_type", "default")
    if kind not in _ROPE_TYPES:
        raise ValueError(
            f"model config: rope_type {kind!r} is not supported by the torch engine "
            f"(supported: {', '.join(_ROPE_TYPES)})"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("model config: partial_rotary_factor != 1 is not supported")
    if kind == "default":
        d = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scaling = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"))
    return inv.float(), float(scaling)


def wire_to_compute(
    snapshot: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One tensor of a wire snapshot as a dense compute tensor (dequantising FP8 blocks)."""
    try:
        t = snapshot[name]
    except KeyError:
        raise KeyError(f"weight snapshot has no tensor {name!r}") from None
    scale = snapshot.get(name + "_scale_inv")
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        if scale is None:
            raise ValueError(f"FP8 tensor {name!r} arrived without {name}_scale_inv")
        return dequantize_fp8(t.to(device), scale.to(device), dtype)
    # Always a copy: the weight receiver updates snapshot tensors in place (in a worker
    # thread, while decoding goes on), so compute weights must never alias them.
    return t.to(device=device, dtype=dtype, copy=True)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_DENSE_SHARE = 4
"""A part with more than 1/_DENSE_SHARE of its elements changed is copied whole (one
strided pass beats gathering and scattering most of it)."""


def patch_in_place(
    dest: torch.Tensor, snapshot: Mapping[str, torch.Tensor], names: Sequence[str], changed: Mapping[str, Any]
) -> bool:
    """Update ``dest``, the compute form of the snapshot tensors ``names`` concatenated
    along dim 0, in place where they changed; returns False, writing nothing, where it
    cannot and the caller must rebuild ``dest`` whole.

    Part ``names[j]`` fills a contiguous flat range of ``dest`` (a cat along dim 0 puts
    its rows after those of the parts before it). ``changed`` maps the parts that changed
    to the ascending flat element indices they changed (``weightsync.Changes`` arrays,
    or int64 tensors), or to None for "all of it"; parts it does not name are left as
    they are. Only those elements are converted to ``dest``'s dtype and device, exactly
    as ``wire_to_compute`` converts them. Refused (False): a part that is FP8 on the
    wire or has a ``<name>_scale_inv`` (block scales dequantise whole tiles), is missing,
    or whose shape does not fit ``dest``. Raises ValueError, writing nothing, for an index
    outside its part (indices are taken as ascending: only the first and last are checked).
    """
    if dest.dim() == 0 or not dest.is_contiguous():
        return False
    parts: list[torch.Tensor] = []
    for n in names:
        t = snapshot.get(n)
        if t is None or t.dtype in _FP8 or n + "_scale_inv" in snapshot or t.dim() != dest.dim():
            return False
        if tuple(t.shape[1:]) != tuple(dest.shape[1:]):
            return False
        idx = changed.get(n)
        if idx is not None and len(idx) and (int(idx[0]) < 0 or int(idx[-1]) >= t.numel()):
            raise ValueError(f"changed elements of {n!r} run outside its {t.numel()} elements")
        parts.append(t)
    if sum(t.shape[0] for t in parts) != dest.shape[0]:
        return False
    flat = dest.view(-1)
    offset = 0
    for n, t in zip(names, parts, strict=True):
        size = t.numel()
        if n in changed:
            seg, src = flat[offset : offset + size], t.reshape(-1)
            idx = changed[n]
            if idx is None or len(idx) * _DENSE_SHARE > size:
                seg.copy_(src)
            elif len(idx):
                idx = torch.as_tensor(idx, dtype=torch.int64)
                vals = src.index_select(0, idx).to(device=dest.device, dtype=dest.dtype)
                seg.index_copy_(0, idx.to(dest.device), vals)
        offset += size
    return True
