"""RecipeConfig validation, GRPO advantages, importance levels and per-pool metrics."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from policies import LossMetrics, RecipeConfig, grpo_advantages, importance_weights
from policies.metrics import compute_metrics


def test_config_defaults_follow_the_recipe() -> None:
    cfg = RecipeConfig()
    assert (cfg.temperature, cfg.top_k, cfg.top_p) == (1.0, 64, 0.97)
    assert (cfg.importance, cfg.is_level, cfg.mis_low, cfg.mis_high) == ("mis", "token", 0.5, 5.0)
    assert cfg.mask_replay and cfg.score_centering and not cfg.normalize_std
    assert RecipeConfig.model_validate_json(cfg.model_dump_json()) == cfg
    plain = RecipeConfig(mask_replay=False, importance="none", score_centering=False)
    assert not plain.mask_replay


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(mis_low=6.0), "mis_low"),
        (dict(mis_low=2.0, mis_high=1.0), "mis_high"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.2), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(mask_replay=False), "score_centering"),
        (dict(tis_cap=0.0), "tis_cap"),
        (dict(mis_low=-1.0), "mis_low"),
        (dict(importance="ppo"), "importance"),
        (dict(bogus=1), "bogus"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError) as err:
        RecipeConfig(**kwargs)
    assert field in str(err.value)


def test_every_config_field_has_a_docstring() -> None:
    import ast
    import inspect

    import policies.config as mod

    tree = ast.parse(inspect.getsource(mod))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RecipeConfig")
    body = cls.body
    documented = {
        body[i].target.id
        for i in range(len(body) - 1)
        if isinstance(body[i], ast.AnnAssign)
        and isinstance(body[i + 1], ast.Expr)
        and isinstance(body[i + 1].value, ast.Constant)
    }
    assert documented == set(RecipeConfig.model_fields)


def test_grpo_advantages_group_mean_variable_sizes() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 3.0, 3.0, 7.0, 2.0, 4.0])
    groups = torch.tensor([10, 10, 10, 4, 4, 99, 4, 10])
    adv = grpo_advantages(rewards, groups)
    expect = torch.tensor([1 - 5.5 / 4, -5.5 / 4, 0.5 - 5.5 / 4, 3 - 8 / 3, 3 - 8 / 3, 0.0, 2 - 8 / 3, 4 - 5.5 / 4])
    torch.testing.assert_close(adv, expect)
    for g in groups.unique():
        assert abs(float(adv[groups == g].sum())) < 1e-6
    names = [f"prompt-{int(g)}" for g in groups]
    torch.testing.assert_close(grpo_advantages(rewards, names), expect)


def test_grpo_advantages_std_normalisation_and_equal_rewards() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 4.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    for norm in (False, True):
        adv = grpo_advantages(rewards, groups, normalize_std=norm)
        assert torch.isfinite(adv).all()
        assert (adv[:3] == 0).all() and adv[6] == 0
    adv = grpo_advantages(rewards, groups, normalize_std=True)
    assert float(adv[3:6].std()) == pytest.approx(1.0, rel=1e-5)
    with pytest.raises(ValueError, match=r"rewards\[1\]"):
        grpo_advantages(torch.tensor([0.0, math.nan]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def _flat_batch_reference(rewards: list[float], groups: list[int], normalize_std: bool) -> list[float]:
    """flat_groups="batch" computed by hand: plain loops over Python floats."""
    n = len(rewards)
    mean_b = sum(rewards) / n
    std_b = math.sqrt(sum((r - mean_b) ** 2 for r in rewards) / max(n - 1, 1))
    out = []
    for r, g in zip(rewards, groups, strict=True):
        mine = [x for x, h in zip(rewards, groups, strict=True) if h == g]
        if min(mine) == max(mine):  # flat: centred on the batch
            a = r - mean_b
            out.append(a / (std_b + 1e-6) if normalize_std else a)
        else:
            m = sum(mine) / len(mine)
            s = math.sqrt(sum((x - m) ** 2 for x in mine) / (len(mine) - 1))
            out.append((r - m) / (s + 1e-6) if normalize_std else r - m)
    return out


@pytest.mark.parametrize("normalize_std", [False, True])
def test_flat_groups_are_centred_on_the_batch(normalize_std: bool) -> None:
    # groups: all right (0), all wrong (1), mixed (2), a single rollout (3), all 0.1 (4:
    # equal values whose float mean is not exactly 0.1)
    rewards = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.5, 0.1, 0.1, 0.1]
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 4, 4, 4]
    adv = grpo_advantages(torch.tensor(rewards), groups, normalize_std=normalize_std, flat_groups="batch")
    expect = torch.tensor(_flat_batch_reference(rewards, groups, normalize_std), dtype=torch.float32)
    torch.testing.assert_close(adv, expect)
    assert (adv[3:6] < 0).all() and (adv[:3] > 0).all()  # all wrong pushed off, all right toward
    plain = grpo_advantages(torch.tensor(rewards), groups, normalize_std=normalize_std)
    torch.testing.assert_close(adv[6:9], plain[6:9])  # a group with spread keeps its own mean
    assert (plain[:6] == 0).all() and (plain[9:] == 0).all()
    with pytest.raises(ValueError, match="flat_groups"):
        grpo_advantages(torch.tensor(rewards), groups, flat_groups="global")
    with pytest.raises(ValidationError, match="flat_groups"):
        RecipeConfig(flat_groups="global")


def test_importance_levels_by_hand() -> None:
    log_r = torch.log(torch.tensor([2.0, 4.0, 0.36, 1.0, 3.0]))
    mask = torch.tensor([True, True, True, True, False])
    seq = torch.tensor([0, 0, 1, 1, 1])
    kw = dict(mis_low=0.5, mis_high=5.0, tis_cap=2.0, seq_ids=seq)
    tok = importance_weights(log_r, mask, importance="mis", is_level="token", **kw)
    torch.testing.assert_close(tok.w_token, torch.tensor([2.0, 4.0, 0.0, 1.0, 0.0]))
    assert tok.mis_masked.tolist() == [False, False, True, False, False]
    sq = importance_weights(log_r, mask, importance="mis", is_level="sequence", **kw)
    # trajectory 0: 2·4 = 8 > 5 -> masked whole; trajectory 1: 0.36·1 < 0.5 (token 4 is loss-masked)
    assert sq.mis_masked.tolist() == [True, True, True, True, False]
    geo = importance_weights(log_r, mask, importance="mis", is_level="geometric", **kw)
    torch.testing.assert_close(geo.w_token, torch.tensor([8**0.5, 8**0.5, 0.6, 0.6, 0.0]))
    tis = importance_weights(log_r, mask, importance="tis", is_level="sequence", **kw)
    torch.testing.assert_close(tis.w_token, torch.tensor([2.0, 2.0, 0.36, 0.36, 0.0]))
    none = importance_weights(log_r, mask, importance="none", **kw)
    assert none.w_token.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_importance_long_trajectories_stay_finite() -> None:
    log_r = torch.full((4000,), 0.5)
    out = importance_weights(log_r, torch.ones(4000, dtype=torch.bool), importance="tis",
                             is_level="sequence", seq_ids=torch.zeros(4000, dtype=torch.long))  # fmt: skip
    assert torch.isfinite(out.w_token).all() and float(out.w_token[0]) == pytest.approx(2.0)


def test_metrics_overall_and_per_pool() -> None:
    log_r = torch.log(torch.tensor([1.0, 2.0, 0.5, 8.0, 1.0]))
    w = torch.tensor([1.0, 2.0, 0.5, 0.0, 3.0])
    masked = torch.tensor([False, False, False, True, False])
    ent = torch.tensor([0.1, 0.2, 0.3, 0.4, 9.0])
    mask = torch.tensor([True, True, True, True, False])
    pools = torch.tensor([0, 1, 1, 0, 1])
    m = compute_metrics(loss=0.5, loss_mask=mask, log_ratio_token=log_r, weight=w, mis_masked=masked,
                        entropy_token=ent, pool_ids=pools, pool_names=["h100-bf16", "l40s-fp8"])  # fmt: skip
    k3 = [r - 1 - math.log(r) for r in (1.0, 2.0, 0.5, 8.0)]
    assert m.tokens == 4 and m.loss == 0.5
    assert m.mismatch_kl == pytest.approx(sum(k3) / 4)
    assert m.masked_fraction == pytest.approx(0.25) and m.mean_weight == pytest.approx(3.5 / 4)
    assert m.entropy == pytest.approx(0.25)
    a, b = m.per_pool["h100-bf16"], m.per_pool["l40s-fp8"]
    assert (a.tokens, b.tokens) == (2, 2)
    assert a.mismatch_kl == pytest.approx((k3[0] + k3[3]) / 2) and a.masked_fraction == 0.5
    assert b.mean_weight == pytest.approx(1.25) and b.entropy == pytest.approx(0.25)
    merged = LossMetrics.merge([m, m])
    assert merged.tokens == 8 and merged.loss == 1.0
    assert merged.per_pool["l40s-fp8"].mean_weight == pytest.approx(1.25)
    assert '"per_pool"' in merged.model_dump_json()
