"""GRPO advantages (docs/architecture.md, The recipe, 5).

For rollout i in group g (the samples of one prompt), with n_g rollouts in the group:

    A_i = R_i − mean_{j∈g} R_j                                   (default)
    A_i = (R_i − mean_g R) / (std_g R + eps)                      (normalize_std=True)

std_g is the unbiased sample standard deviation sqrt(Σ (R_j − mean_g)² / (n_g − 1)),
taken as 0 for a single-rollout group. Groups may have any size (dropped rollouts
simply make a group smaller); a group of equal rewards gets A = 0 exactly, never NaN.

A *flat* group is one whose rewards are all equal (a single rollout included). With
flat_groups="batch" such a group is centred on the batch instead of on itself:

    A_i = R_i − mean_B R                    (B: every rollout of the batch)
    A_i = (R_i − mean_B R) / (std_B R + eps)                      (normalize_std=True)

so a prompt whose replies are all wrong is pushed off its answer (A < 0), and one whose
replies are all right toward it, where plain GRPO leaves both where they are. Groups
with any spread keep their own mean (and std).

A *stuck* group (`stuck_groups`) is a flat group below the batch's best group mean: its
replies agree on an answer that some other prompt's group beats, and GRPO gives it no
way out (the entropy term's `entropy_groups = "stuck"` acts there alone).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

__all__ = ["grpo_advantages", "stuck_groups"]


def _group_index(rewards: Tensor, group_ids: Tensor | Sequence[int] | Sequence[str]) -> tuple[Tensor, int]:
    """Each rollout's group as 0..G-1, and G; checks the shapes."""
    if not isinstance(group_ids, Tensor):
        labels = {g: i for i, g in enumerate(dict.fromkeys(group_ids))}
        group_ids = torch.tensor([labels[g] for g in group_ids], dtype=torch.long, device=rewards.device)
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both have shape [N], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if rewards.numel() == 0:
        return group_ids.long(), 0
    _, g = torch.unique(group_ids, return_inverse=True)
    return g, int(g.max()) + 1


@torch.no_grad()
def stuck_groups(rewards: Tensor, group_ids: Tensor | Sequence[int] | Sequence[str]) -> Tensor:
    """bool [N]: the rollout's group is flat (all rewards equal) and its reward is below
    the batch's best group mean. A batch whose groups are all flat at one reward has none."""
    g, n_groups = _group_index(rewards, group_ids)
    if n_groups == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)
    r = rewards.double()
    low = torch.full((n_groups,), math.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, g, r, "amin")
    high = torch.full_like(low, -math.inf).scatter_reduce_(0, g, r, "amax")
    count = torch.zeros_like(low).index_add_(0, g, torch.ones_like(r))
    mean = torch.zeros_like(low).index_add_(0, g, r) / count
    return ((low == high) & (high < mean.max()))[g]


@torch.no_grad()
def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence[int] | Sequence[str],
    *,
    normalize_std: bool = False,
    eps: float = 1e-6,
    flat_groups: Literal["zero", "batch"] = "zero",
) -> Tensor:
    """Group-mean-centred advantages, float32 [N] (see the module docstring).

    Args:
        rewards: float [N] scalar reward per rollout.
        group_ids: group (prompt) of each rollout: an int tensor [N] or a sequence of
            ints or strings (e.g. `Trajectory.group_id`); any labels.
        normalize_std: divide by the group std + eps.
        eps: > 0, guards the division.
        flat_groups: "zero" (GRPO: a flat group gets 0) or "batch" (centred on the batch).

    Raises:
        ValueError: shape mismatch, non-finite rewards, eps <= 0, or an unknown flat_groups.
    """
    if flat_groups not in ("zero", "batch"):
        raise ValueError(f"flat_groups must be 'zero' or 'batch', got {flat_groups!r}")
    g, n_groups = _group_index(rewards, group_ids)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.float32, device=rewards.device)
    r = rewards.double()
    if not bool(torch.isfinite(r).all()):
        i = int(torch.nonzero(~torch.isfinite(r)).flatten()[0])
        raise ValueError(f"rewards[{i}] is not finite ({float(r[i])})")
    count = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, g, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, g, r) / count
    dev = r - mean[g]
    if normalize_std:
        ss = torch.zeros_like(count).index_add_(0, g, dev * dev)
        std = torch.sqrt(ss / (count - 1).clamp(min=1.0))
        dev = dev / (std[g] + eps)
    if flat_groups == "batch":
        low = torch.full_like(count, math.inf).scatter_reduce_(0, g, r, "amin")
        high = torch.full_like(count, -math.inf).scatter_reduce_(0, g, r, "amax")
        flat = (low == high)[g]
        if bool(flat.any()):
            batch = r - r.mean()
            if normalize_std:
                n = r.numel()
                batch = batch / (torch.sqrt((batch * batch).sum() / max(n - 1, 1)) + eps)
            dev = torch.where(flat, batch, dev)
    return dev.float()
