"""Mask replay (trainer side): log-probabilities over each recorded support.

docs/architecture.md, The recipe, 2.

For row t with support S_t, trainer logits z_t and temperature T:

    log p^S_t(v) = z_tv/T − logsumexp_{u ∈ S_t} z_tu/T,   v ∈ S_t.

The sampled token y_t must lie in S_t; otherwise `ValueError` names the position (the
set is never silently widened: rebuilding it on the trainer is the known failure mode).

Two paths with identical results:

* `replay_logprobs(logits[T, V], ...)` gathers from full-vocabulary logits.
* `replay_logprobs_from_hidden(hidden[T, H], W[V, H], ...)` never forms [T, V]: with
  U = unique(ids of the micro-batch) it computes z_U = hidden @ W[U]ᵀ (+ b[U]) tile by
  tile (row blocks × chunks of U), keeps only each row's support columns, and in
  backward rebuilds each tile's sparse gradient G to form ∂hidden += G @ W[U_c] and
  ∂W[U_c] += Gᵀ @ hidden. Besides the [V, H] gradient of W (which any path produces),
  peak extra memory is a few tiles, whatever |U| is; no [|U|, H] copy of W is held.

All softmax math is float32 (bf16/fp16 inputs are upcast; float64 stays float64).
Temperature 0 (greedy) records single-id supports, whose log p^S is 0 at any
temperature; it is replayed with T = 1 and any wider row is an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .support import SupportRecord

__all__ = [
    "ReplayResult",
    "full_vocab_logprobs",
    "replay_logprobs",
    "replay_logprobs_from_hidden",
    "segment_logsumexp",
]

# One tile of the union path: [rows, cols] with rows·cols <= _TILE_ELEMENTS (16 MiB in
# float32) and cols <= _COL_CHUNK ids of U; big enough for efficient matmuls, small next
# to the [V, H] gradient of the LM head.
_TILE_ELEMENTS = 1 << 22
_COL_CHUNK = 8192


@dataclass(frozen=True)
class ReplayResult:
    """Replayed log-probabilities; `logp_support` and `logp_token` carry gradients."""

    logp_support: Tensor
    """float32 [nnz]: log p^S_t(v) for every support entry, CSR order of the record."""
    logp_token: Tensor
    """float32 [T]: log p^S_t(y_t), equal to logp_support[token_index]."""
    token_index: Tensor
    """int64 [T]: flat entry index of y_t in the record."""
    row: Tensor
    """int64 [nnz]: the row of each entry."""


def segment_logsumexp(values: Tensor, row: Tensor, n_rows: int) -> Tensor:
    """logsumexp of `values` [nnz] within each row id of `row` [nnz] -> [n_rows].

    Max-shifted (shift detached: the identity lse = m + log Σ exp(x − m) holds for any m,
    so the gradient is exact); empty rows give −inf.
    """
    m = torch.full((n_rows,), float("-inf"), dtype=values.dtype, device=values.device)
    m = m.scatter_reduce(0, row, values.detach(), reduce="amax", include_self=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.zeros(n_rows, dtype=values.dtype, device=values.device)
    s = s.index_add(0, row, torch.exp(values - m[row]))
    return m + torch.log(s)


def _compute_dtype(*ts: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _scale(support: SupportRecord, temperature: float) -> float:
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0.0:
        widest = int(support.counts().max()) if support.n_rows else 1
        if widest > 1:
            raise ValueError(f"temperature 0 (greedy) needs single-id supports, got a row with {widest} ids")
        return 1.0
    return 1.0 / temperature


def _finish(z_support: Tensor, support: SupportRecord, tokens: Tensor, row: Tensor) -> ReplayResult:
    token_index = support.token_index(tokens)
    lse = segment_logsumexp(z_support, row, support.n_rows)
    logp_support = z_support - lse[row]
    return ReplayResult(logp_support, logp_support[token_index], token_index, row)


def replay_logprobs(logits: Tensor, support: SupportRecord, tokens: Tensor, temperature: float) -> ReplayResult:
    """Full path: log p^S from full-vocabulary logits [T, V] (any float dtype).

    Raises ValueError on shape mismatch, a malformed record, or a token outside its row.
    """
    if logits.dim() != 2 or logits.shape[0] != support.n_rows:
        raise ValueError(f"logits must have shape [T={support.n_rows}, V], got {tuple(logits.shape)}")
    support.check()
    if support.nnz and int(support.ids.max()) >= logits.shape[1]:
        raise ValueError(f"support id {int(support.ids.max())} >= vocabulary size {logits.shape[1]}")
    scale = _scale(support, temperature)
    row = support.row_index()
    z = logits[row, support.ids.long()].to(_compute_dtype(logits)) * scale
    return _finish(z, support, tokens, row)


@dataclass(frozen=True)
class _Tile:
    """Rows [t0, t1) × union columns [c0, c1); entries order[e0:e1] fall in it."""

    t0: int
    t1: int
    c0: int
    c1: int
    e0: int
    e1: int


def _plan(
    row: Tensor, col: Tensor, n_rows: int, n_union: int, tile_elements: int, col_chunk: int
) -> tuple[Tensor, Tensor, list[_Tile]]:
    """Entry permutation grouped by (column chunk, row), each entry's flat index inside
    its tile, and the non-empty tiles, chunk-major (so each chunk of W is gathered once)."""
    cols = max(1, min(n_union, col_chunk))
    rows = max(1, tile_elements // cols)
    chunk = torch.div(col, cols, rounding_mode="floor")
    skey, order = torch.sort(chunk * n_rows + row, stable=True)
    r, c = row[order], col[order]
    t0 = torch.div(r, rows, rounding_mode="floor") * rows
    c0 = torch.div(c, cols, rounding_mode="floor") * cols
    width = torch.clamp(n_union - c0, max=cols)
    local = (r - t0) * width + (c - c0)
    starts = [(c0_, t0_) for c0_ in range(0, n_union, cols) for t0_ in range(0, n_rows, rows)]
    probes = torch.tensor(
        [(c0_ // cols) * n_rows + t0_ for c0_, t0_ in starts] + [((n_union - 1) // cols + 1) * n_rows],
        dtype=skey.dtype,
        device=skey.device,
    )
    bounds = torch.searchsorted(skey, probes).tolist()
    tiles = [
        _Tile(t0_, min(t0_ + rows, n_rows), c0_, min(c0_ + cols, n_union), bounds[i], bounds[i + 1])
        for i, (c0_, t0_) in enumerate(starts)
        if bounds[i + 1] > bounds[i]
    ]
    return order, local, tiles


class _SupportLogits(torch.autograd.Function):
    """z_s[e] = hidden[row[e]] · W[U[col[e]]] (+ b[U[col[e]]]) for every support entry e,
    computed tile by tile of the dense [T, |U|] product; backward recomputes the W chunks
    and never keeps anything of size [T, |U|] or [|U|, H]."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        union: Tensor,
        order: Tensor,
        local: Tensor,
        tiles: list[_Tile],
    ) -> Tensor:
        dt = _compute_dtype(hidden, weight)
        out_sorted = torch.empty(order.numel(), dtype=dt, device=hidden.device)
        chunk = (-1, -1)
        for tl in tiles:
            if (tl.c0, tl.c1) != chunk:
                chunk = (tl.c0, tl.c1)
                ids = union[tl.c0 : tl.c1]
                w_c = weight.index_select(0, ids).to(dt)
                b_c = bias.index_select(0, ids).to(dt) if bias is not None else None
            zb = hidden[tl.t0 : tl.t1].to(dt) @ w_c.T
            if b_c is not None:
                zb += b_c
            out_sorted[tl.e0 : tl.e1] = zb.view(-1).index_select(0, local[tl.e0 : tl.e1])
        out = torch.empty_like(out_sorted)
        out[order] = out_sorted
        ctx.save_for_backward(hidden, weight, union, order, local)
        ctx.tiles = tiles
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor):  # type: ignore[override]
        hidden, weight, union, order, local = ctx.saved_tensors
        dt = grad.dtype
        grad_sorted = grad[order]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        g_h = torch.zeros(hidden.shape, dtype=dt, device=hidden.device) if need_h else None
        g_w = torch.zeros(weight.shape, dtype=dt, device=weight.device) if need_w else None
        g_b = torch.zeros(weight.shape[0], dtype=dt, device=weight.device) if need_b else None
        tiles: list[_Tile] = ctx.tiles
        i = 0
        while i < len(tiles):
            c0, c1 = tiles[i].c0, tiles[i].c1
            ids = union[c0:c1]
            w_c = weight.index_select(0, ids).to(dt)
            acc_w = torch.zeros(c1 - c0, weight.shape[1], dtype=dt, device=weight.device) if need_w else None
            acc_b = torch.zeros(c1 - c0, dtype=dt, device=weight.device) if need_b else None
            while i < len(tiles) and (tiles[i].c0, tiles[i].c1) == (c0, c1):
                tl = tiles[i]
                gb = torch.zeros(tl.t1 - tl.t0, c1 - c0, dtype=dt, device=grad.device)
                # (row, id) pairs are unique (SupportRecord.check), so a plain copy suffices.
                gb.view(-1).index_copy_(0, local[tl.e0 : tl.e1], grad_sorted[tl.e0 : tl.e1])
                if g_h is not None:
                    g_h[tl.t0 : tl.t1].addmm_(gb, w_c)
                if acc_w is not None:
                    acc_w.addmm_(gb.T, hidden[tl.t0 : tl.t1].to(dt))
                if acc_b is not None:
                    acc_b += gb.sum(0)
                i += 1
            # U is unique, so each chunk owns its rows of the gradient outright.
            if g_w is not None:
                g_w.index_copy_(0, ids, acc_w)
            if g_b is not None:
                g_b.index_copy_(0, ids, acc_b)
        return (
            g_h.to(hidden.dtype) if g_h is not None else None,
            g_w.to(weight.dtype) if g_w is not None else None,
            g_b.to(weight.dtype) if g_b is not None else None,
            None, None, None, None,
        )  # fmt: skip


def replay_logprobs_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    support: SupportRecord,
    tokens: Tensor,
    temperature: float,
    lm_head_bias: Tensor | None = None,
    *,
    tile_elements: int = _TILE_ELEMENTS,
    col_chunk: int = _COL_CHUNK,
) -> ReplayResult:
    """Union path: log p^S from final hidden states [T, H] and the LM head W [V, H]
    (+ optional bias [V]) without materialising [T, V]; equal to
    `replay_logprobs(hidden @ W.T + b, ...)`, gradients included (to hidden, W and b).

    tile_elements / col_chunk bound one tile of the [T, |U|] product (memory vs matmul
    efficiency); results do not depend on them beyond float rounding.

    Raises ValueError on shape mismatch, a malformed record, or a token outside its row.
    """
    if hidden.dim() != 2 or hidden.shape[0] != support.n_rows:
        raise ValueError(f"hidden must have shape [T={support.n_rows}, H], got {tuple(hidden.shape)}")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"lm_head_weight must have shape [V, H={hidden.shape[1]}], got {tuple(lm_head_weight.shape)}")
    if lm_head_bias is not None and tuple(lm_head_bias.shape) != (lm_head_weight.shape[0],):
        raise ValueError(f"lm_head_bias must have shape [V={lm_head_weight.shape[0]}], got {tuple(lm_head_bias.shape)}")
    support.check()
    if support.nnz and int(support.ids.max()) >= lm_head_weight.shape[0]:
        raise ValueError(f"support id {int(support.ids.max())} >= vocabulary size {lm_head_weight.shape[0]}")
    scale = _scale(support, temperature)
    row = support.row_index()
    union, col = torch.unique(support.ids.long(), return_inverse=True)
    order, local, tiles = _plan(row, col, support.n_rows, union.numel(), tile_elements, col_chunk)
    z = _SupportLogits.apply(hidden, lm_head_weight, lm_head_bias, union, order, local, tiles)
    z = z * scale
    return _finish(z, support, tokens, row)


def full_vocab_logprobs(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """log softmax(z/T)[y] over the whole vocabulary, float32 [T] (the no-replay ablation;
    temperature 0 is treated as 1)."""
    if logits.dim() != 2 or tokens.shape != (logits.shape[0],):
        raise ValueError(
            f"logits [T, V] and tokens [T] must agree, got {tuple(logits.shape)} and {tuple(tokens.shape)}"
        )
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    scale = 1.0 / temperature if temperature > 0 else 1.0
    z = logits.to(_compute_dtype(logits)) * scale
    return torch.log_softmax(z, dim=-1).gather(1, tokens.long()[:, None]).squeeze(1)
