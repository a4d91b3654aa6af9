"""Sampling with a support record (docs/architecture.md, The recipe, 1; sampler side).

For each row of logits z ∈ R^V:

    x      = z / T                         (float32; T = temperature)
    rank   = ids sorted by (−x, id)         (deterministic: equal x -> lower id first)
    K      = first k ids of rank            (top-k cap; k <= 0 means no cap, K = all ids)
    p_K    = softmax(x restricted to K)     (renormalised over the capped set)
    S      = shortest prefix of K (in rank order) whose cumulative p_K mass >= top_p,
             i.e. entry j (0-based) is kept iff  sum_{i<j} p_K(i) < top_p  or  j < min_keep
             (so |S| >= min(min_keep, |K|)), dropping entries whose probability
             underflows to 0
    q      = p_K restricted to S, renormalised:  log q(v) = x_v − logsumexp_{u∈S} x_u
    y      ~ q   (inverse CDF with one uniform per row from the torch generator)

top_p = 1 keeps every id of K with non-zero probability. temperature = 0 is greedy:
y = argmax z (lowest id among equal maxima), S = {y}, log q = 0.

min_keep (as `min_tokens_to_keep` of transformers' TopPLogitsWarper): with min_keep = 1,
a state whose top token alone passes top_p gets the one-token support S = {y}; it is
sampled deterministically and its replayed log p^S(y) is exactly 0 whatever the
weights, so no policy gradient reaches it again (an absorbing state: a wrong choice
there is never corrected). min_keep = 2 keeps the runner-up in S with its renormalised
probability q = p_K(2nd) / (p_K(1st) + p_K(2nd)): it is still sampled now and then and
both entries get a gradient. The price is a slightly less greedy sampler (at most the
runner-up's share of mass is added) and one more id per row in the record.

Ties are resolved by the total order (−x, id) everywhere: in the top-k cap and at the
top-p cutoff, an id with a lower index ranks first among equal processed logits, so the
record is a pure function of the logits (it does not depend on the sort kernel).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .support import SupportRecord

__all__ = ["SupportRecord", "sample_with_support"]

# Without a top-k cap, try these many candidates (fast topk) before a full sort: real
# nucleus sets are usually far smaller than the vocabulary.
_UNCAPPED_TRIES = (256, 4096)


def _top_ranked(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The first k ids per row in the total order (−x, id), and their x values.

    torch.topk leaves the choice among values tied at the k-th place unspecified, so it
    asks for k+1 values: a row whose (k+1)-th value equals its k-th has a tie straddling
    the cut, and for those rows the set is rebuilt as {x > kth} plus the lowest ids of
    {x == kth}. The kept set is then put in (−x, id) order by two sorts on [B, k] only.
    """
    v = x.shape[-1]
    if k >= v:
        vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
        return ids, vals
    top_vals, ids = torch.topk(x, k + 1, dim=-1, largest=True, sorted=True)
    kth = top_vals[:, k - 1]
    tie = top_vals[:, k] == kth
    ids = ids[:, :k].clone()
    if bool(tie.any()):
        rows = torch.nonzero(tie).flatten()
        xr = x[rows]
        kr = kth[rows, None]
        gt = xr > kr
        eq = xr == kr
        need = k - gt.sum(-1, keepdim=True)
        sel = gt | (eq & (torch.cumsum(eq, dim=-1) <= need))
        ids[rows] = torch.nonzero(sel)[:, 1].view(-1, k)
    ids = torch.sort(ids, dim=-1).values
    vals = x.gather(-1, ids)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return ids.gather(-1, order), vals.gather(-1, order)


def _check_args(logits: Tensor, temperature: float, top_k: int, top_p: float, min_keep: int) -> None:
    if logits.dim() != 2 or logits.shape[0] == 0 or logits.shape[1] == 0:
        raise ValueError(f"logits must have shape [B, V] with B, V >= 1, got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if logits.shape[1] >= 1 << 31:
        raise ValueError(f"vocabulary of {logits.shape[1]} ids does not fit int32 support ids")
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not isinstance(top_k, int):
        raise ValueError(f"top_k must be an int (<= 0 for no cap), got {top_k!r}")
    if not (isinstance(min_keep, int) and min_keep >= 1):
        raise ValueError(f"min_keep must be an int >= 1, got {min_keep!r}")


def _greedy(logits: Tensor) -> tuple[Tensor, SupportRecord]:
    b = logits.shape[0]
    dev = logits.device
    tokens = torch.argmax(logits.float(), dim=-1)  # first maximum = lowest id
    support = SupportRecord(
        tokens.to(torch.int32),
        torch.arange(b + 1, dtype=torch.int32, device=dev),
        torch.zeros(b, dtype=torch.float32, device=dev),
    )
    return tokens, support


@torch.no_grad()
def sample_with_support(
    logits: Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    min_keep: int = 1,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, SupportRecord]:
    """Sample one token per row and record the kept support (see the module docstring).

    Args:
        logits: [B, V] logits of any floating dtype (computed in float32).
        temperature: T >= 0; 0 means greedy.
        top_k: cap on the candidate set; <= 0 means no cap.
        top_p: nucleus mass in (0, 1].
        min_keep: top-p never cuts below this many ids (capped by top-k and by ids whose
            probability underflows to 0); 1 is the plain nucleus.
        generator: torch generator on the logits' device (None: torch's default).

    Returns:
        tokens: int64 [B], tokens[b] ∈ S_b.
        support: `SupportRecord` on the logits' device, rows in rank order.

    Raises:
        ValueError: bad shape/dtype/argument, or a row whose processed logits are NaN,
            +inf, or all −inf (no distribution to sample from).
    """
    _check_args(logits, temperature, top_k, top_p, min_keep)
    if temperature == 0.0:
        return _greedy(logits)
    b, v = logits.shape
    x = logits.float() / temperature
    bad = torch.isnan(x) | (x == float("inf"))
    bad_rows = bad.any(dim=-1) | (x == float("-inf")).all(dim=-1)
    if bool(bad_rows.any()):
        r = int(torch.nonzero(bad_rows).flatten()[0])
        raise ValueError(f"logits row {r} has NaN, +inf or only -inf values after temperature")

    if top_k > 0:
        ids, vals = _top_ranked(x, min(top_k, v))
        logp = torch.log_softmax(vals, dim=-1)  # p_K: renormalised over the capped set
    else:
        # Uncapped: p over the full vocabulary; widen the candidate window until every
        # row's nucleus fits (top_p = 1 needs every id).
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        for k in (*_UNCAPPED_TRIES, v):
            if k < v and (top_p >= 1.0 or k < min_keep):
                continue
            ids, vals = _top_ranked(x, min(k, v))
            logp = vals - lse
            if k >= v or bool((torch.cumsum(torch.exp(logp), dim=-1)[:, -1] >= top_p).all()):
                break

    p = torch.exp(logp)
    if top_p >= 1.0:
        keep = p > 0
    else:
        cum = torch.cumsum(p, dim=-1)
        exclusive = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
        keep = exclusive < top_p
        if min_keep > 1:
            keep[:, :min_keep] = True
        keep &= p > 0
    keep[:, 0] = True  # the top-ranked id always stays (its p can only underflow if all do)

    masked = vals.masked_fill(~keep, float("-inf"))
    logq = torch.log_softmax(masked, dim=-1)  # renormalised over S; -inf outside S

    # Inverse-CDF sampling: one uniform per row, exact given the generator's stream.
    q = torch.exp(logq)
    cdf = torch.cumsum(q, dim=-1)
    u = torch.rand(b, 1, generator=generator, device=x.device, dtype=torch.float32)
    pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    n_keep = keep.sum(dim=-1)
    pick = torch.minimum(pick, n_keep - 1)
    tokens = ids.gather(1, pick[:, None]).squeeze(1)

    offsets = torch.zeros(b + 1, dtype=torch.int32, device=x.device)
    offsets[1:] = torch.cumsum(n_keep, dim=0).to(torch.int32)
    support = SupportRecord(ids[keep].to(torch.int32), offsets, logq[keep].contiguous())
    return tokens, support
