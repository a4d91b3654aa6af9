"""`RecipeConfig`: every switch of the recipe, so each ablation is one line.

The recipe itself: docs/architecture.md, The recipe.

Plain GRPO on the same run, for instance, is
`RecipeConfig(mask_replay=False, importance="none", score_centering=False)`.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

__all__ = ["RecipeConfig"]


class RecipeConfig(BaseModel):
    """Sampling, importance-sampling, loss and advantage settings of the recipe."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    temperature: float = 1.0
    """Sampling temperature T (logits are divided by T); 0 means greedy decoding, whose
    support is the single argmax id with log q = 0."""

    top_k: int = 64
    """Cap on the candidate set before top-p; <= 0 disables the cap."""

    top_p: float = 0.97
    """Nucleus mass in (0, 1]: keep the shortest rank-ordered prefix whose probability
    (renormalised over the top-k set) reaches top_p; 1 keeps the whole top-k set."""

    min_keep: int = Field(default=2, ge=1)
    """Top-p never cuts the support below this many ids (transformers' `min_tokens_to_keep`).
    1 is the plain nucleus, under which a state whose top token alone passes top_p gets a
    one-token support: sampled deterministically, replayed log p^S = 0, so no gradient ever
    reaches it again (an absorbing state). 2 (the default) keeps the runner-up sampled with
    its renormalised probability and gives both ids a gradient; the sampler is slightly less
    greedy and the record holds one more id per such row. Sampler and trainer see the same
    set (the sampler records it), so replay stays exact. README "Exploration under top-p"
    has the measurements behind the default."""

    entropy_coef: float = Field(default=0.0, ge=0.0)
    """Weight β of an entropy term on the replayed support, H_t = −Σ_{v∈S_t} p^S log p^S:
    with entropy_floor None the loss gets −β·H_t per token (a bonus), otherwise
    β·max(0, entropy_floor − H_t) (a floor: only low-entropy rows are pushed). 0 disables it.
    It cannot unfreeze a one-token support (H is 0 there for any weights, so its gradient
    is 0); it slows the collapse towards one, at the cost of a biased objective. Needs
    mask_replay (the sum runs over the recorded support)."""

    entropy_floor: float | None = Field(default=None, ge=0.0)
    """Target entropy (nats) of the entropy term; None makes it a plain bonus."""

    entropy_groups: Literal["all", "stuck"] = "all"
    """Which trajectories the entropy term applies to: "all", or only those of *stuck*
    groups (rewards all equal and below the batch's best group mean: the replies agree on
    an answer that is not the best, and GRPO gives them no signal to leave it;
    `policies.advantages.stuck_groups`). With "stuck" a prompt the policy solves may turn
    greedy, while one it is locked on a wrong answer for is pushed to sample again; a
    group that regains a spread leaves the term at once."""

    mask_replay: bool = True
    """Replay the sampler's recorded support on the trainer: log p^S over S_t only.
    False is the ablation that scores sampled tokens with the full-vocabulary softmax."""

    importance: Literal["mis", "tis", "icepop", "seq_mask", "none"] = "mis"
    """The mismatch correction: importance-weight function f of the ratio r = p/q (detached).
    "mis" f(r) = r·1[mis_low <= r <= mis_high] (the recipe's), "tis" f(r) = min(r, tis_cap)
    (truncated IS), "icepop" f(r_t) = r_t·1[icepop_low <= r_t <= icepop_high] on each token
    (IcePop's double-sided token mask), "seq_mask" f = 1[seq_mask_low <= ρ <= seq_mask_high]
    with ρ the trajectory's geometric-mean ratio (the whole trajectory is kept with weight 1
    or masked), "none" f = 1. docs/recipe.md (Corrections) has each formula, where it comes
    from and when it helps."""

    is_level: Literal["token", "sequence", "geometric"] = "token"
    """Which ratio f is applied to: each token's own r_t, the trajectory's product of
    ratios (sum of log-ratios), or the trajectory's geometric mean exp(mean log r_t).
    At the sequence levels every token of a trajectory shares one weight, and a masked
    trajectory masks all its tokens. Applies to "mis" and "tis"; "icepop" (token) and
    "seq_mask" (geometric) fix their own level and need it left at "token"."""

    mis_low: float = 0.5
    """Lower bound lo of the MIS window (ratios below it are masked)."""

    mis_high: float = 5.0
    """Upper bound hi of the MIS window (ratios above it are masked)."""

    tis_cap: float = 2.0
    """Cap C of truncated importance sampling, f(r) = min(r, C)."""

    icepop_low: float = 0.5
    """Lower bound α of IcePop's token window (tokens with r_t < α are masked)."""

    icepop_high: float = 5.0
    """Upper bound β of IcePop's token window (tokens with r_t > β are masked)."""

    seq_mask_low: float = 0.5
    """Lower bound of the sequence mask's window on the geometric-mean ratio."""

    seq_mask_high: float = 2.0
    """Upper bound of the sequence mask's window on the geometric-mean ratio."""

    score_centering: bool = True
    """Subtract the q-weighted expected score sum_v c_v log p^S(v), c_v = q(v)·f(r(v)),
    from each token's term (needs mask_replay: the sum runs over the recorded support)."""

    normalize_std: bool = False
    """Divide GRPO advantages by the group's reward standard deviation (off by default)."""

    flat_groups: Literal["zero", "batch"] = "zero"
    """Advantage of a group whose rewards are all equal: "zero" (GRPO: it carries no
    signal) or "batch" (centred on the batch's mean reward, so a prompt whose replies all
    agree on a wrong answer is pushed off it; policies.advantages)."""

    std_eps: float = Field(default=1e-6, gt=0.0)
    """Added to the group standard deviation when normalize_std is on, so a group of
    equal rewards gets advantage 0, not NaN."""

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not (math.isfinite(v) and v >= 0.0):
            raise ValueError(f"temperature must be a finite number >= 0, got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {v}")
        return v

    @field_validator("mis_low", "mis_high", "icepop_low", "icepop_high", "seq_mask_low", "seq_mask_high")
    @classmethod
    def _mis_bound(cls, v: float, info: ValidationInfo) -> float:
        name = info.field_name
        if not (v >= 0.0 and not math.isnan(v)):
            raise ValueError(f"{name} must be >= 0, got {v}")
        return v

    @field_validator("tis_cap")
    @classmethod
    def _tis_cap(cls, v: float) -> float:
        if not v > 0.0:
            raise ValueError(f"tis_cap must be > 0, got {v}")
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> RecipeConfig:
        for low in ("mis_low", "icepop_low", "seq_mask_low"):
            high = low.replace("_low", "_high")
            if getattr(self, low) > getattr(self, high):
                raise ValueError(f"{low} ({getattr(self, low)}) must not exceed {high} ({getattr(self, high)})")
        if self.importance in ("icepop", "seq_mask") and self.is_level != "token":
            raise ValueError(
                f"importance={self.importance!r} fixes its own level (icepop: token, seq_mask: "
                f"geometric); leave is_level at 'token', got {self.is_level!r}"
            )
        if self.entropy_coef > 0.0 and not self.mask_replay:
            raise ValueError(
                "entropy_coef > 0 needs mask_replay=True: the entropy runs over the replayed "
                "support (set entropy_coef=0 for the no-replay ablation)"
            )
        if self.entropy_groups != "all" and self.entropy_coef == 0.0:
            raise ValueError(
                f"entropy_groups={self.entropy_groups!r} selects where the entropy term applies, "
                "but entropy_coef is 0 (no term): set entropy_coef > 0"
            )
        if self.score_centering and not self.mask_replay:
            raise ValueError(
                "score_centering=True needs mask_replay=True: the centering sum runs over "
                "the replayed support (set score_centering=False for the no-replay ablation)"
            )
        return self
