"""Per-step recipe metrics (docs/architecture.md, The recipe, 8), overall and per sampler pool.

Over loss tokens t (loss_mask = 1), with r_t = exp(log p(y_t) − log q(y_t)):

    mismatch_kl      = mean_t (r_t − 1 − log r_t)     k3 estimate of KL(q ‖ p) on sampled tokens
    masked_fraction  = mean_t 1[MIS set w_t = 0]
    mean_weight      = mean_t w_t
    entropy          = mean_t −Σ_{v∈S_t} p^S_t(v) log p^S_t(v)   (None without replay)

Micro-batch metrics combine with `LossMetrics.merge` (token-weighted means, summed loss).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import BaseModel
from torch import Tensor

__all__ = ["LossMetrics", "PoolMetrics", "compute_metrics"]

# exp(700) is still a finite float64; larger log-ratios are clamped for the KL estimate only.
_MAX_LOG_RATIO = 700.0


class PoolMetrics(BaseModel):
    """Recipe metrics over one set of loss tokens (all of them, or one pool's)."""

    tokens: int
    """Number of loss tokens these means are over."""
    mismatch_kl: float
    """k3 estimate E[r − 1 − log r] on sampled tokens (0 when sampler and trainer agree)."""
    masked_fraction: float
    """Fraction of loss tokens whose weight MIS set to 0."""
    mean_weight: float
    """Mean importance weight w_y."""
    entropy: float | None
    """Mean entropy of p^S over the recorded support; None when replay is off."""


class LossMetrics(PoolMetrics):
    """Metrics of one `recipe_loss` call, overall and per pool."""

    loss: float
    """The loss value returned (already divided by the global loss-token count)."""
    per_pool: dict[str, PoolMetrics]
    """The same metrics restricted to each pool's tokens (empty when no pool ids)."""

    @classmethod
    def merge(cls, parts: Sequence[LossMetrics]) -> LossMetrics:
        """Combine micro-batch metrics: token-weighted means, summed loss and counts."""
        if not parts:
            raise ValueError("LossMetrics.merge needs at least one part")
        pools: dict[str, list[PoolMetrics]] = {}
        for p in parts:
            for name, m in p.per_pool.items():
                pools.setdefault(name, []).append(m)
        overall = _merge_pool(parts)
        return cls(
            **overall.model_dump(),
            loss=sum(p.loss for p in parts),
            per_pool={k: _merge_pool(v) for k, v in sorted(pools.items())},
        )


def _merge_pool(parts: Sequence[PoolMetrics]) -> PoolMetrics:
    n = sum(p.tokens for p in parts)

    def mean(field: str) -> float:
        return sum(getattr(p, field) * p.tokens for p in parts) / n if n else 0.0

    has_entropy = all(p.entropy is not None for p in parts)
    return PoolMetrics(
        tokens=n,
        mismatch_kl=mean("mismatch_kl"),
        masked_fraction=mean("masked_fraction"),
        mean_weight=mean("mean_weight"),
        entropy=mean("entropy") if has_entropy else None,
    )


@torch.no_grad()
def compute_metrics(
    *,
    loss: float,
    loss_mask: Tensor,
    log_ratio_token: Tensor,
    weight: Tensor,
    mis_masked: Tensor,
    entropy_token: Tensor | None,
    pool_ids: Tensor | None = None,
    pool_names: Sequence[str] | None = None,
) -> LossMetrics:
    """Reduce per-token quantities [T] to `LossMetrics` with one host transfer.

    pool_ids: int [T] pool index per token; pool_names[i] names pool i (default str(i)).
    """
    mask = loss_mask.to(torch.bool)
    n = mask.numel()
    dev = mask.device
    lr = log_ratio_token.double().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    k3 = torch.expm1(lr) - lr
    cols = [k3, mis_masked.double(), weight.double()]
    if entropy_token is not None:
        cols.append(entropy_token.double())
    per_tok = torch.stack([torch.where(mask, c, 0.0) for c in cols] + [mask.double()], dim=1)

    if pool_ids is None:
        group = torch.zeros(n, dtype=torch.long, device=dev)
        n_groups = 1
    else:
        if pool_ids.shape != (n,):
            raise ValueError(f"pool_ids must have shape [{n}], got {tuple(pool_ids.shape)}")
        group = pool_ids.long()
        n_groups = int(group.max()) + 1 if n else 0
        if n and int(group.min()) < 0:
            raise ValueError("pool_ids must be non-negative")
        if pool_names is not None and len(pool_names) < n_groups:
            raise ValueError(f"pool_names has {len(pool_names)} names for pool id {n_groups - 1}")
    sums = torch.zeros(n_groups, per_tok.shape[1], dtype=torch.float64, device=dev)
    sums.index_add_(0, group, per_tok)
    table = sums.tolist()
    total = [sum(col) for col in zip(*table, strict=True)] if table else [0.0] * per_tok.shape[1]

    def pool(s: list[float]) -> PoolMetrics:
        cnt = s[-1]
        d = cnt if cnt > 0 else 1.0
        return PoolMetrics(
            tokens=round(cnt),
            mismatch_kl=s[0] / d,
            masked_fraction=s[1] / d,
            mean_weight=s[2] / d,
            entropy=(s[3] / d) if entropy_token is not None else None,
        )

    per_pool: dict[str, PoolMetrics] = {}
    if pool_ids is not None:
        for i, s in enumerate(table):
            if s[-1] > 0:
                name = pool_names[i] if pool_names is not None else str(i)
                per_pool[name] = pool(s)
    return LossMetrics(**pool(total).model_dump(), loss=loss, per_pool=per_pool)
