"""Mask replay (DESIGN §3.2, trainer side): log-probabilities over each recorded support.

For row t with support S_t, trainer logits z_t and temperature T:

    log p^S_t(v) = z_tv/T − logsumexp_{u ∈ S_t} z_tu/T,   v ∈ S_t.

The sampled token y_t must lie in S_t; otherwise `ValueError` names the position (the
set is never silently widened: rebuilding it on the trainer is the known failure mode).

Two paths with identical results:

* `replay_logprobs(logits[T, V], ...)` gathers from full-vocabulary logits.
* `replay_logprobs_from_hidden(hidden[T, H], W[V, H], ...)` never forms [T, V]: with
  U = unique(ids of the micro-batch) it computes z_U = hidden @ W[U]ᵀ (+ b[U]) block by
  block of rows, keeps only each row's support columns, and in backward rebuilds the
  block's sparse gradient to form ∂hidden = G @ W[U] and ∂W[U] = Gᵀ @ hidden. Peak extra
  memory is one [rows_per_block, |U|] block, whatever |U| is.

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

# Elements of one [rows, |U|] float32 block in the union path (64 MiB).
_BLOCK_ELEMENTS = 1 << 24


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
            raise ValueError(
                f"temperature 0 (greedy) needs single-id supports, got a row with {widest} ids"
            )
        return 1.0
    return 1.0 / temperature


def _finish(z_support: Tensor, support: SupportRecord, tokens: Tensor, row: Tensor) -> ReplayResult:
    token_index = support.token_index(tokens)
    lse = segment_logsumexp(z_support, row, support.n_rows)
    logp_support = z_support - lse[row]
    return ReplayResult(logp_support, logp_support[token_index], token_index, row)


def replay_logprobs(
    logits: Tensor, support: SupportRecord, tokens: Tensor, temperature: float
) -> ReplayResult:
    """Full path: log p^S from full-vocabulary logits [T, V] (any float dtype).

    Raises ValueError on shape mismatch, a malformed record, or a token outside its row.
    """
    if logits.dim() != 2 or logits.shape[0] != support.n_rows:
        raise ValueError(
            f"logits must have shape [T={support.n_rows}, V], got {tuple(logits.shape)}"
        )
    support.check()
    if support.nnz and int(support.ids.max()) >= logits.shape[1]:
        raise ValueError(f"support id {int(support.ids.max())} >= vocabulary size {logits.shape[1]}")
    scale = _scale(support, temperature)
    row = support.row_index()
    z = logits[row, support.ids.long()].to(_compute_dtype(logits)) * scale
    return _finish(z, support, tokens, row)


class _SupportLogits(torch.autograd.Function):
    """z_s[e] = hidden[row[e]] · W_U[col[e]] (+ b_U[col[e]]) for every support entry e,
    computed by row blocks of the dense [rows, |U|] product; nothing of size [T, |U|] is
    kept for backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        w_u: Tensor,
        b_u: Tensor | None,
        row: Tensor,
        col: Tensor,
        blocks: list[tuple[int, int, int, int]],
    ) -> Tensor:
        dt = _compute_dtype(hidden, w_u)
        w = w_u.to(dt)
        b = b_u.to(dt) if b_u is not None else None
        out = torch.empty(row.numel(), dtype=dt, device=hidden.device)
        for t0, t1, e0, e1 in blocks:
            zb = hidden[t0:t1].to(dt) @ w.T
            if b is not None:
                zb += b
            out[e0:e1] = zb[row[e0:e1] - t0, col[e0:e1]]
        ctx.save_for_backward(hidden, w_u, row, col)
        ctx.blocks = blocks
        ctx.has_bias = b_u is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor):  # type: ignore[override]
        hidden, w_u, row, col = ctx.saved_tensors
        dt = grad.dtype
        w = w_u.to(dt)
        n_u = w_u.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_h = torch.zeros(hidden.shape, dtype=dt, device=hidden.device) if need_h else None
        g_w = torch.zeros(w_u.shape, dtype=dt, device=w_u.device) if need_w else None
        g_b = torch.zeros(n_u, dtype=dt, device=w_u.device) if (need_b and ctx.has_bias) else None
        for t0, t1, e0, e1 in ctx.blocks:
            gb = torch.zeros(t1 - t0, n_u, dtype=dt, device=grad.device)
            gb.index_put_((row[e0:e1] - t0, col[e0:e1]), grad[e0:e1], accumulate=True)
            if g_h is not None:
                g_h[t0:t1] = gb @ w
            if g_w is not None:
                g_w.addmm_(gb.T, hidden[t0:t1].to(dt))
            if g_b is not None:
                g_b += gb.sum(0)
        return (
            g_h.to(hidden.dtype) if g_h is not None else None,
            g_w.to(w_u.dtype) if g_w is not None else None,
            g_b.to(w_u.dtype) if g_b is not None else None,
            None,
            None,
            None,
        )


def _blocks(offsets: list[int], n_union: int, block_elements: int) -> list[tuple[int, int, int, int]]:
    n_rows = len(offsets) - 1
    step = max(1, block_elements // max(1, n_union))
    return [
        (t0, min(t0 + step, n_rows), offsets[t0], offsets[min(t0 + step, n_rows)])
        for t0 in range(0, n_rows, step)
    ]


def replay_logprobs_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    support: SupportRecord,
    tokens: Tensor,
    temperature: float,
    lm_head_bias: Tensor | None = None,
    *,
    block_elements: int = _BLOCK_ELEMENTS,
) -> ReplayResult:
    """Union path: log p^S from final hidden states [T, H] and the LM head W [V, H]
    (+ optional bias [V]) without materialising [T, V]; equal to
    `replay_logprobs(hidden @ W.T + b, ...)`, gradients included (to hidden, W and b).

    Raises ValueError on shape mismatch, a malformed record, or a token outside its row.
    """
    if hidden.dim() != 2 or hidden.shape[0] != support.n_rows:
        raise ValueError(
            f"hidden must have shape [T={support.n_rows}, H], got {tuple(hidden.shape)}"
        )
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"lm_head_weight must have shape [V, H={hidden.shape[1]}], got {tuple(lm_head_weight.shape)}"
        )
    if lm_head_bias is not None and tuple(lm_head_bias.shape) != (lm_head_weight.shape[0],):
        raise ValueError(
            f"lm_head_bias must have shape [V={lm_head_weight.shape[0]}], got {tuple(lm_head_bias.shape)}"
        )
    support.check()
    if support.nnz and int(support.ids.max()) >= lm_head_weight.shape[0]:
        raise ValueError(
            f"support id {int(support.ids.max())} >= vocabulary size {lm_head_weight.shape[0]}"
        )
    scale = _scale(support, temperature)
    row = support.row_index()
    union, col = torch.unique(support.ids.long(), return_inverse=True)
    w_u = lm_head_weight.index_select(0, union)
    b_u = lm_head_bias.index_select(0, union) if lm_head_bias is not None else None
    blocks = _blocks(support.offsets.tolist(), union.numel(), block_elements)
    z = _SupportLogits.apply(hidden, w_u, b_u, row, col, blocks) * scale
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
