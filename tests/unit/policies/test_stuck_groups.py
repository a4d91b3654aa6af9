"""Issue 32, item 3: the entropy term on stuck groups alone (`entropy_groups = "stuck"`).

A stuck group's replies all earn the same reward, below the batch's best group mean.
`stuck_groups` is checked against a plain loop over the groups, and the masked entropy
term against the same loss without the term plus the term summed by hand over the
masked rows."""

from __future__ import annotations

import random

import pytest
import torch

from policies import RecipeConfig, recipe_loss, replay_logprobs, sample_with_support, stuck_groups


def _reference_stuck(rewards: list[float], groups: list[int]) -> list[bool]:
    by_group: dict[int, list[float]] = {}
    for r, g in zip(rewards, groups, strict=True):
        by_group.setdefault(g, []).append(r)
    best = max(sum(v) / len(v) for v in by_group.values())
    stuck = {g: len(set(v)) == 1 and v[0] < best for g, v in by_group.items()}
    return [stuck[g] for g in groups]


def test_stuck_groups_by_hand() -> None:
    # group 0 flat at 0 (stuck), 1 mixed, 2 flat at 1 (the best: not stuck), 3 flat at 0.5 (stuck)
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.5])
    groups = ["a", "a", "b", "b", "c", "c", "d"]
    assert stuck_groups(rewards, groups).tolist() == [True, True, False, False, False, False, True]
    # every group flat at one reward: nothing to compare with, none stuck
    assert not stuck_groups(torch.tensor([0.3, 0.3, 0.3]), [0, 0, 1]).any()
    assert stuck_groups(torch.zeros(0), []).shape == (0,)


@pytest.mark.parametrize("seed", range(20))
def test_stuck_groups_matches_a_loop_over_groups(seed: int) -> None:
    rng = random.Random(seed)
    n_groups = rng.randint(1, 6)
    groups = [rng.randrange(n_groups) for _ in range(rng.randint(1, 30))]
    levels = [0.0, 0.5, 1.0] if seed % 2 else [0.0, 1.0]
    rewards = [rng.choice(levels) for _ in groups]
    got = stuck_groups(torch.tensor(rewards), torch.tensor(groups)).tolist()
    assert got == _reference_stuck(rewards, groups)


def test_config_refuses_stuck_without_an_entropy_term() -> None:
    with pytest.raises(ValueError, match="entropy_coef"):
        RecipeConfig(entropy_groups="stuck")
    assert RecipeConfig(entropy_groups="stuck", entropy_coef=0.1).entropy_groups == "stuck"


@pytest.mark.parametrize("floor", [None, 1.4])
def test_the_entropy_term_acts_on_masked_rows_alone(floor: float | None) -> None:
    t, v = 12, 30
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(t, v, generator=gen, dtype=torch.float64) * 2.0
    tokens, support = sample_with_support(logits, temperature=1.0, top_k=8, top_p=0.97, generator=gen)
    adv = torch.randn(t, generator=gen)
    mask = torch.rand(t, generator=gen) < 0.5
    beta = 0.3

    def loss(cfg: RecipeConfig, entropy_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        z = logits.clone().requires_grad_()
        rep = replay_logprobs(z, support, tokens, 1.0)
        value, _ = recipe_loss(cfg, support, tokens, adv, replay=rep, num_loss_tokens=t, entropy_mask=entropy_mask)
        (grad,) = torch.autograd.grad(value, z)
        return value.detach(), grad

    with_term, g_term = loss(RecipeConfig(entropy_coef=beta, entropy_floor=floor, entropy_groups="stuck"), mask)
    without, g_plain = loss(RecipeConfig(), None)
    # the term by hand: per row H = -sum_{v in S} p^S log p^S over the replayed support
    z = logits.clone().requires_grad_()
    rep = replay_logprobs(z, support, tokens, 1.0)
    row_h = torch.zeros(t, dtype=torch.float64).index_add(0, rep.row, -rep.logp_support.exp() * rep.logp_support)
    per_row = -beta * row_h if floor is None else beta * torch.clamp(floor - row_h, min=0.0)
    term = torch.where(mask, per_row, 0.0).sum() / t
    (g_by_hand,) = torch.autograd.grad(term, z)
    torch.testing.assert_close(with_term, without + term.detach())
    torch.testing.assert_close(g_term, g_plain + g_by_hand)
    if floor is not None:  # the hinge acts on some rows and not on others
        assert bool((row_h < floor).any()) and bool((row_h > floor).any())
    assert torch.count_nonzero(g_by_hand[~mask]) == 0 and torch.count_nonzero(g_by_hand[mask]) > 0
