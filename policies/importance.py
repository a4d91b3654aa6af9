"""Importance weights: MIS / TIS / IcePop / sequence mask / none (docs/recipe.md, Corrections).

docs/architecture.md, The recipe, 3.

Per loss token t, with log-ratio ℓ_t = log p^S_t(y_t) − log q_t(y_t) (detached), the
level picks the ratio ρ that f sees:

    token      log ρ_t = ℓ_t
    sequence   log ρ_t = Σ_{s ∈ traj(t)} ℓ_s            (product of ratios, in log space)
    geometric  log ρ_t = (1/L) Σ_{s ∈ traj(t)} ℓ_s       (geometric mean, L loss tokens)

and f is  mis: ρ·1[lo <= ρ <= hi],  tis: min(ρ, C),  none: 1.  w_y = f(ρ_t); a trajectory
whose ρ falls outside [lo, hi] under MIS therefore masks all its tokens.

Two corrections fix their own level (`is_level` must stay "token" for them):

    icepop     token level, f(ρ) = ρ·1[α <= ρ <= β]   (the IcePop double-sided token mask)
    seq_mask   geometric level, f(ρ) = 1[lo_s <= ρ <= hi_s]  (a whole trajectory is kept with
               weight 1 or masked, no reweighting)

Centering coefficients c_v (docs/architecture.md, The recipe, 4) are the q-expectation of
the same weight: the weight token t would have had if v had been sampled there,

    c_v = q_t(v) · f(ρ_t(v)),   log ρ_t(v) = log ρ_t + κ_t (log r_t(v) − ℓ_t),

with κ = 1 (token, sequence) or 1/L (geometric). At token level this is the familiar
c_v = q(v)·f(r(v)); on-policy (r = 1) it is c_v = q(v) = p^S(v) for every level.

Everything is computed in log space (float64 for the trajectory sums) and only
exponentiated where f bounds the result, so log q = −30 or huge ratios stay finite.
Only tokens with loss_mask = 1 enter trajectory sums; masked tokens get w = c = 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["IMPORTANCE_KINDS", "ImportanceWeights", "importance_weights"]


@dataclass(frozen=True)
class ImportanceWeights:
    """Detached importance quantities of one micro-batch."""

    w_token: Tensor
    """float32 [T]: w_y = f(ρ_t); 0 on loss-masked tokens."""
    c_support: Tensor | None
    """float32 [nnz]: c_v = q(v)·f(ρ_t(v)); None when no support ratios were given."""
    mis_masked: Tensor
    """bool [T]: loss tokens whose weight a mask (mis, icepop, seq_mask) set to 0; all False
    for tis and none."""
    log_ratio_token: Tensor
    """float32 [T]: ℓ_t = log p(y_t) − log q(y_t)."""


IMPORTANCE_KINDS = ("mis", "tis", "icepop", "seq_mask", "none")


def _log_f(log_rho: Tensor, kind: str, lo: float, hi: float, cap: float) -> tuple[Tensor, Tensor]:
    """(log f(ρ), f(ρ) > 0) elementwise; kind "window" is ρ·1[lo<=ρ<=hi], "indicator" 1[lo<=ρ<=hi]."""
    if kind == "none":
        return torch.zeros_like(log_rho), torch.ones_like(log_rho, dtype=torch.bool)
    if kind == "tis":
        return torch.clamp(log_rho, max=math.log(cap)), torch.ones_like(log_rho, dtype=torch.bool)
    log_lo = math.log(lo) if lo > 0 else float("-inf")
    log_hi = math.log(hi) if hi > 0 else float("-inf")
    inside = (log_rho >= log_lo) & (log_rho <= log_hi)
    if kind == "window":
        return log_rho, inside
    return torch.zeros_like(log_rho), inside


def _resolve(importance: str, is_level: str, bounds: dict[str, float]) -> tuple[str, str, float, float]:
    """(f kind, level, lo, hi) of a correction; refuses unknown names and fixed-level clashes."""
    if importance not in IMPORTANCE_KINDS:
        raise ValueError(f"importance must be one of {IMPORTANCE_KINDS}, got {importance!r}")
    if importance in ("icepop", "seq_mask") and is_level != "token":
        raise ValueError(
            f"importance={importance!r} fixes its own level (icepop: token, seq_mask: geometric); "
            f"leave is_level at 'token', got {is_level!r}"
        )
    if importance == "icepop":
        return "window", "token", bounds["icepop_low"], bounds["icepop_high"]
    if importance == "seq_mask":
        return "indicator", "geometric", bounds["seq_mask_low"], bounds["seq_mask_high"]
    kind = "window" if importance == "mis" else importance
    return kind, is_level, bounds["mis_low"], bounds["mis_high"]


@torch.no_grad()
def importance_weights(
    log_ratio_token: Tensor,
    loss_mask: Tensor,
    *,
    importance: Literal["mis", "tis", "icepop", "seq_mask", "none"],
    is_level: Literal["token", "sequence", "geometric"] = "token",
    mis_low: float = 0.5,
    mis_high: float = 5.0,
    tis_cap: float = 2.0,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
    seq_mask_low: float = 0.5,
    seq_mask_high: float = 2.0,
    seq_ids: Tensor | None = None,
    log_ratio_support: Tensor | None = None,
    logq_support: Tensor | None = None,
    row: Tensor | None = None,
) -> ImportanceWeights:
    """Weights w_y (and c_v when support ratios are given); see the module docstring.

    Args:
        log_ratio_token: [T] log p(y_t) − log q(y_t).
        loss_mask: bool [T]; False rows get weight 0 and stay out of trajectory sums.
        seq_ids: int [T] trajectory id of each token; required for sequence/geometric.
            A trajectory must not be split across micro-batches at those levels.
        log_ratio_support, logq_support, row: [nnz] per-entry log r, log q and row index,
            to get the centering coefficients.
        mis_low..seq_mask_high: the window (lo, hi) of mis, icepop and seq_mask; tis_cap C.

    Raises:
        ValueError: an unknown importance or level, is_level other than "token" with
            icepop/seq_mask, or missing seq_ids at a trajectory level.
    """
    kind, is_level, lo, hi = _resolve(
        importance,
        is_level,
        dict(
            mis_low=mis_low,
            mis_high=mis_high,
            icepop_low=icepop_low,
            icepop_high=icepop_high,
            seq_mask_low=seq_mask_low,
            seq_mask_high=seq_mask_high,
        ),
    )
    n = log_ratio_token.numel()
    dev = log_ratio_token.device
    mask = loss_mask.to(torch.bool)
    ell = torch.where(mask, log_ratio_token.double(), 0.0)
    if is_level == "token":
        log_rho = ell
        kappa = torch.ones(n, dtype=torch.float64, device=dev)
    elif is_level in ("sequence", "geometric"):
        if seq_ids is None or seq_ids.shape != (n,):
            raise ValueError(f"is_level={is_level!r} needs seq_ids of shape [{n}]")
        _, seq = torch.unique(seq_ids, return_inverse=True)
        n_seq = int(seq.max()) + 1 if n else 0
        total = torch.zeros(n_seq, dtype=torch.float64, device=dev).index_add_(0, seq, ell)
        if is_level == "sequence":
            log_rho = total[seq]
            kappa = torch.ones(n, dtype=torch.float64, device=dev)
        else:
            length = torch.zeros(n_seq, dtype=torch.float64, device=dev)
            length = length.index_add_(0, seq, mask.double()).clamp(min=1.0)
            log_rho = (total / length)[seq]
            kappa = 1.0 / length[seq]
    else:
        raise ValueError(f"is_level must be 'token', 'sequence' or 'geometric', got {is_level!r}")

    log_f, positive = _log_f(log_rho, kind, lo, hi, tis_cap)
    keep = positive & mask
    w = torch.where(keep, torch.exp(torch.where(keep, log_f, 0.0)), 0.0)
    mis_masked = mask & ~positive

    c = None
    if log_ratio_support is not None:
        if logq_support is None or row is None:
            raise ValueError("log_ratio_support needs logq_support and row")
        alt = log_rho[row] + kappa[row] * (log_ratio_support.double() - ell[row])
        log_fv, pos_v = _log_f(alt, kind, lo, hi, tis_cap)
        keep_v = pos_v & mask[row]
        log_c = torch.where(keep_v, logq_support.double() + log_fv, 0.0)
        c = torch.where(keep_v, torch.exp(log_c), 0.0).float()

    return ImportanceWeights(w.float(), c, mis_masked, log_ratio_token.float())
