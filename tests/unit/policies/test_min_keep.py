"""Issue 11: a state whose nucleus is one token, with and without `min_keep`, and the
entropy term. Sampler and trainer here share the same weights (on-policy), so every
difference comes from the support alone."""

from __future__ import annotations

import pytest
import torch

from policies import (
    RecipeConfig,
    recipe_loss,
    replay_logprobs,
    replay_logprobs_from_hidden,
    sample_with_support,
)

T, H, V, TOP = 6, 8, 40, 3


def _peaked_problem():
    """hidden [T, H], LM head W [V, H] and bias [V] whose bias makes id TOP hold > 0.999 of
    every row's probability: the nucleus at top_p = 0.97 is {TOP} on every row."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=gen, dtype=torch.float64).requires_grad_()
    weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.1).requires_grad_()
    bias = torch.zeros(V, dtype=torch.float64)
    bias[TOP] = 10.0
    bias.requires_grad_()
    return hidden, weight, bias


def _loss_and_grads(cfg: RecipeConfig, union: bool, advantage: float = -1.0):
    hidden, weight, bias = _peaked_problem()
    with torch.no_grad():
        sampler_logits = hidden @ weight.T + bias
    tokens, support = sample_with_support(
        sampler_logits,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        min_keep=cfg.min_keep,
        generator=torch.Generator().manual_seed(1),
    )
    if union:
        rep = replay_logprobs_from_hidden(hidden, weight, support, tokens, cfg.temperature, bias)
    else:
        rep = replay_logprobs(hidden @ weight.T + bias, support, tokens, cfg.temperature)
    adv = torch.full((T,), advantage)
    loss, metrics = recipe_loss(cfg, support, tokens, adv, replay=rep, num_loss_tokens=T)
    loss.backward()
    return support, tokens, (hidden.grad, weight.grad, bias.grad), metrics


@pytest.mark.parametrize("union", [False, True], ids=["full_path", "union_path"])
def test_one_token_nucleus_has_zero_gradient_without_min_keep(union: bool) -> None:
    """The documented old behaviour (min_keep = 1): a one-token support is sampled
    deterministically, log p^S = 0 exactly, and no gradient reaches any weight, even with a
    nonzero advantage."""
    cfg = RecipeConfig(top_p=0.97, min_keep=1)
    support, tokens, grads, metrics = _loss_and_grads(cfg, union)
    assert support.counts().tolist() == [1] * T and tokens.tolist() == [TOP] * T
    for g in grads:
        assert g is not None and torch.count_nonzero(g) == 0
    assert metrics.entropy == 0.0


@pytest.mark.parametrize("union", [False, True], ids=["full_path", "union_path"])
def test_one_token_nucleus_gets_a_gradient_with_min_keep(union: bool) -> None:
    """min_keep = 2 (the recipe default): the runner-up stays in S, and a negative advantage
    on the top id pushes it down (its bias gradient is positive) and the runner-ups up."""
    cfg = RecipeConfig(top_p=0.97)
    assert cfg.min_keep == 2
    support, tokens, grads, _ = _loss_and_grads(cfg, union)
    assert support.counts().tolist() == [2] * T
    assert support.ids[0::2].tolist() == [TOP] * T
    runner_ups = support.ids[1::2].long()
    g_h, g_w, g_b = grads
    assert torch.count_nonzero(g_h) > 0 and torch.count_nonzero(g_w) > 0
    # Every row drew TOP here (q(TOP) > 0.999), so every row pushes TOP down.
    assert tokens.tolist() == [TOP] * T
    assert float(g_b[TOP]) > 0.0
    assert (g_b[runner_ups] < 0).all()
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[TOP] = False
    untouched[runner_ups] = False
    assert torch.count_nonzero(g_b[untouched]) == 0  # only support ids get a gradient


def test_union_and_full_paths_agree_under_min_keep() -> None:
    cfg = RecipeConfig(top_p=0.97, min_keep=3)
    _, _, full, _ = _loss_and_grads(cfg, union=False)
    _, _, union, _ = _loss_and_grads(cfg, union=True)
    for a, b in zip(full, union, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_entropy_term_cannot_move_a_one_token_support() -> None:
    """Why the entropy term alone is no fix: H = 0 on a one-token row for any weights."""
    cfg = RecipeConfig(top_p=0.97, min_keep=1, entropy_coef=0.5)
    _, _, grads, _ = _loss_and_grads(cfg, union=True, advantage=0.0)
    for g in grads:
        assert torch.count_nonzero(g) == 0


def test_entropy_bonus_and_floor_on_a_wider_support() -> None:
    """With two ids and zero advantage, the bonus raises the runner-up (negative gradient on
    its bias); a floor below the rows' entropy contributes nothing, one above it acts."""
    bonus = RecipeConfig(top_p=0.97, entropy_coef=0.5)
    support, _, (_, _, g_b), metrics = _loss_and_grads(bonus, union=True, advantage=0.0)
    assert float(g_b[TOP]) > 0.0 and (g_b[support.ids[1::2].long()] < 0).all()
    assert metrics.entropy is not None and 0.0 < metrics.entropy < 0.02
    low = RecipeConfig(top_p=0.97, entropy_coef=0.5, entropy_floor=0.0)
    _, _, grads, _ = _loss_and_grads(low, union=True, advantage=0.0)
    assert all(torch.count_nonzero(g) == 0 for g in grads)
    high = RecipeConfig(top_p=0.97, entropy_coef=0.5, entropy_floor=0.5)
    _, _, (_, _, g_high), _ = _loss_and_grads(high, union=True, advantage=0.0)
    torch.testing.assert_close(g_high, g_b)  # below the floor the hinge has the bonus's slope


def test_config_rules_for_the_new_switches() -> None:
    with pytest.raises(ValueError, match="entropy_coef"):
        RecipeConfig(mask_replay=False, score_centering=False, entropy_coef=0.1)
    with pytest.raises(ValueError, match="min_keep"):
        RecipeConfig(min_keep=0)
    assert RecipeConfig(mask_replay=False, score_centering=False).min_keep == 2
