"""The RL recipe: pure functions on tensors (docs/architecture.md, The recipe).

Sampler side: `sample_with_support` draws tokens after temperature / top-k / top-p and
records each token's kept support as a `SupportRecord` (CSR ids + offsets + log q).

Exploration under top-p: a plain nucleus shrinks to one token once the top token alone
holds top_p of the mass; with replay that state is sampled deterministically and its
log p^S is exactly 0, so no gradient moves it again. `RecipeConfig.min_keep` (default 2)
keeps the runner-up in every support (the trade-off is in `policies.sampling`);
`entropy_coef` / `entropy_floor` add an entropy term over the replayed support, which
slows the collapse but cannot undo a one-token support (its entropy is 0 for any weights).

Trainer side: `replay_logprobs_from_hidden` (or `replay_logprobs` on full logits) gives
log p^S over each recorded support; `recipe_loss` applies masked importance weights and
the score-centred token loss, token-mean over the global batch; `grpo_advantages` gives
group-mean-centred advantages. `RecipeConfig` holds every switch.

A trainer micro-batch step, in short:

    rep = replay_logprobs_from_hidden(h[gen], lm_head.weight, support, y, cfg.temperature)
    loss, metrics = recipe_loss(cfg, support, y, adv_per_token, replay=rep,
                                num_loss_tokens=N_global, seq_ids=traj_of_token)
    loss.backward()
"""

from .advantages import grpo_advantages, stuck_groups
from .config import RecipeConfig
from .importance import ImportanceWeights, importance_weights
from .loss import recipe_loss
from .metrics import LossMetrics, PoolMetrics
from .replay import (
    ReplayResult,
    full_vocab_logprobs,
    replay_logprobs,
    replay_logprobs_from_hidden,
    segment_logsumexp,
)
from .sampling import sample_with_support
from .support import SupportRecord

__all__ = [
    "ImportanceWeights",
    "LossMetrics",
    "PoolMetrics",
    "RecipeConfig",
    "ReplayResult",
    "SupportRecord",
    "full_vocab_logprobs",
    "grpo_advantages",
    "importance_weights",
    "recipe_loss",
    "replay_logprobs",
    "replay_logprobs_from_hidden",
    "sample_with_support",
    "segment_logsumexp",
    "stuck_groups",
]
