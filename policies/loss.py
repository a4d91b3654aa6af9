"""The score-centred token loss (docs/architecture.md, The recipe, 4) with global token-mean aggregation (6).

Per generated token t with advantage A_t, detached weights w_y and c_v (see
`policies.importance`) and replayed log p^S_t:

    centering on:   ℓ_t = −A_t · ( w_y · log p^S_t(y_t) − Σ_{v∈S_t} c_v · log p^S_t(v) )
    centering off:  ℓ_t = −A_t · w_y · log p^S_t(y_t)

    loss = Σ_t m_t ℓ_t / N,   N = loss-token count of the WHOLE global batch,

optionally plus an entropy term over the replayed support (`entropy_coef` β > 0),
H_t = −Σ_{v∈S_t} p^S_t(v) log p^S_t(v):

    bonus (entropy_floor None):   ℓ_t += −β · H_t
    floor (entropy_floor = h):    ℓ_t +=  β · max(0, h − H_t)

on every token, or (``entropy_mask``, from `RecipeConfig.entropy_groups`) on the
tokens of stuck groups alone.

A one-token support has H_t = 0 for any weights, so this term never moves such a state;
that is the job of `RecipeConfig.min_keep` (see policies.sampling).

so summing the losses (and gradients) of micro-batches, each called with the same N,
gives exactly the loss (and gradient) of the batch processed at once.

Its gradient is the closed form −A·(w_y ∇log p^S(y) − Σ_v c_v ∇log p^S(v)). On-policy
(q = p^S, f ≡ 1) the centering term is −A Σ_v p^S(v) ∇log p^S(v) = −A ∇Σ_v p^S(v) = 0.

Without replay (ablation, `mask_replay=False`) the token term uses the full-vocabulary
log softmax(z/T)(y_t), and q in the ratio is the sampler's *processed* log q(y_t) from
the record (renormalised over its top-k/top-p set), exactly what a recipe without
replay compares; centering is unavailable there (`RecipeConfig` refuses it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .config import RecipeConfig
from .importance import importance_weights
from .metrics import LossMetrics, compute_metrics
from .replay import ReplayResult
from .support import SupportRecord

__all__ = ["recipe_loss"]


def _bounds(config: RecipeConfig) -> dict[str, float]:
    """The windows and cap of every correction, as `importance_weights` takes them."""
    keys = ("mis_low", "mis_high", "tis_cap", "icepop_low", "icepop_high", "seq_mask_low", "seq_mask_high")
    return {k: getattr(config, k) for k in keys}


def recipe_loss(
    config: RecipeConfig,
    support: SupportRecord,
    tokens: Tensor,
    advantages: Tensor,
    *,
    num_loss_tokens: int | float | Tensor,
    replay: ReplayResult | None = None,
    logp_token_full: Tensor | None = None,
    loss_mask: Tensor | None = None,
    seq_ids: Tensor | None = None,
    pool_ids: Tensor | None = None,
    pool_names: Sequence[str] | None = None,
    entropy_mask: Tensor | None = None,
) -> tuple[Tensor, LossMetrics]:
    """Loss of one micro-batch of generated tokens (one row of `support` each).

    Args:
        config: the recipe switches (importance, level, bounds, centering, replay).
        support: the sampler's record for these T tokens.
        tokens: int [T] sampled ids y_t.
        advantages: float [T] advantage of each token's trajectory (no gradient).
        num_loss_tokens: N, the number of tokens with loss_mask = 1 in the whole global
            batch (same value for every micro-batch of a step); must be > 0.
        replay: `replay_logprobs*` output for these rows (required when mask_replay).
        logp_token_full: [T] full-vocabulary log p(y_t) (required when not mask_replay).
        loss_mask: bool [T]; False rows contribute nothing to loss, gradient or
            metrics (default: all True).
        seq_ids: int [T] trajectory id per token (needed for sequence/geometric levels;
            a trajectory must lie in one micro-batch there).
        pool_ids, pool_names: int [T] sampler-pool index per token and pool names, for
            per-pool metrics.
        entropy_mask: bool [T]; the entropy term applies only where True (default: on
            every token).

    Returns:
        (loss, metrics): loss is a scalar carrying gradient to the replayed log-probs.

    Raises:
        ValueError: a missing input for the configured path, mismatched shapes,
            N <= 0, or a token outside its support.
    """
    n = support.n_rows
    dev = support.device
    if tokens.shape != (n,) or advantages.shape != (n,):
        raise ValueError(
            f"tokens and advantages must have shape [{n}] (one per support row), "
            f"got {tuple(tokens.shape)} and {tuple(advantages.shape)}"
        )
    n_global = float(num_loss_tokens)
    if not n_global > 0:
        raise ValueError(f"num_loss_tokens must be > 0, got {num_loss_tokens}")
    if loss_mask is None:
        mask = torch.ones(n, dtype=torch.bool, device=dev)
    elif loss_mask.shape != (n,):
        raise ValueError(f"loss_mask must have shape [{n}], got {tuple(loss_mask.shape)}")
    else:
        mask = loss_mask.to(device=dev, dtype=torch.bool)
    adv = advantages.detach().to(device=dev, dtype=torch.float32)

    entropy_token: Tensor | None = None
    if config.mask_replay:
        if replay is None:
            raise ValueError("mask_replay=True needs replay= (from replay_logprobs*)")
        if replay.logp_support.shape != (support.nnz,) or replay.logp_token.shape != (n,):
            raise ValueError("replay does not match the support record's shape")
        logp_y = replay.logp_token
        logp_s = replay.logp_support
        row = replay.row
        log_r_s = logp_s.detach().float() - support.logq
        log_r_y = log_r_s[replay.token_index]
        weights = importance_weights(
            log_r_y, mask,
            importance=config.importance, is_level=config.is_level,
            seq_ids=seq_ids, **_bounds(config),
            log_ratio_support=log_r_s if config.score_centering else None,
            logq_support=support.logq, row=row,
        )  # fmt: skip
        with torch.no_grad():
            p_s = torch.exp(logp_s.detach().float())
            ent = torch.where(p_s > 0, -p_s * logp_s.detach().float(), 0.0)
            entropy_token = torch.zeros(n, device=dev).index_add_(0, row, ent)
    else:
        if logp_token_full is None or logp_token_full.shape != (n,):
            raise ValueError(f"mask_replay=False needs logp_token_full of shape [{n}]")
        if config.score_centering:
            raise ValueError("score_centering needs mask_replay (see RecipeConfig)")
        logp_y = logp_token_full
        logq_y = support.logq[support.token_index(tokens)]
        log_r_y = logp_y.detach().float() - logq_y
        weights = importance_weights(
            log_r_y, mask,
            importance=config.importance, is_level=config.is_level,
            seq_ids=seq_ids, **_bounds(config),
        )  # fmt: skip

    # torch.where (not multiplication) keeps masked rows inert even if their inputs are
    # non-finite: the unselected branch gets an exact zero gradient.
    term = weights.w_token.to(logp_y.dtype) * torch.where(mask, logp_y, 0.0)
    if config.mask_replay and config.score_centering:
        assert weights.c_support is not None and replay is not None
        keep_s = mask[replay.row]
        contrib = weights.c_support.to(logp_s.dtype) * torch.where(keep_s, logp_s, 0.0)
        term = term - torch.zeros(n, dtype=contrib.dtype, device=dev).index_add(0, replay.row, contrib)
    per_token = -adv.to(term.dtype) * term
    if config.entropy_coef > 0.0:
        assert replay is not None
        keep_s = mask[replay.row]
        lp = torch.where(keep_s, logp_s, 0.0)
        h = torch.zeros(n, dtype=lp.dtype, device=dev).index_add(0, replay.row, -torch.exp(lp) * lp)
        if config.entropy_floor is None:
            ent_term = -config.entropy_coef * h
        else:
            ent_term = config.entropy_coef * torch.clamp(config.entropy_floor - h, min=0.0)
        if entropy_mask is not None:
            if entropy_mask.shape != (n,):
                raise ValueError(f"entropy_mask must have shape [{n}], got {tuple(entropy_mask.shape)}")
            ent_term = torch.where(entropy_mask.to(device=dev, dtype=torch.bool), ent_term, 0.0)
        per_token = per_token + ent_term
    per_token = torch.where(mask, per_token, 0.0)
    loss = per_token.sum() / n_global

    metrics = compute_metrics(
        loss=float(loss.detach()),
        loss_mask=mask,
        log_ratio_token=weights.log_ratio_token,
        weight=weights.w_token,
        mis_masked=weights.mis_masked,
        entropy_token=entropy_token,
        pool_ids=pool_ids,
        pool_names=pool_names,
    )
    return loss, metrics
