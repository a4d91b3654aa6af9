"""The mismatch corrections (MIS, TIS, IcePop, sequence mask) against a per-token reference loop.

The reference below is written from the formulas in docs/recipe.md (Corrections) with
plain Python floats, one token at a time; it shares no code with policies.importance.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from policies import RecipeConfig, SupportRecord, full_vocab_logprobs, recipe_loss, replay_logprobs


def _batch(seed: int, t: int = 14, v: int = 8, spread: float = 1.0):
    """Logits leaf [t, v]; random supports holding y; log q a perturbed copy of the replayed
    distribution (so ratios fall both inside and outside the windows); 3 trajectories."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, v, generator=gen, dtype=torch.float64) * 1.5).requires_grad_()
    ids, offsets, logq, tokens = [], [0], [], []
    for i in range(t):
        k = int(torch.randint(2, v + 1, (1,), generator=gen))
        row = torch.randperm(v, generator=gen)[:k]
        z = logits.detach()[i, row] + torch.randn(k, generator=gen, dtype=torch.float64) * spread
        ids.append(row)
        logq.append(torch.log_softmax(z, 0))
        tokens.append(int(row[int(torch.randint(0, k, (1,), generator=gen))]))
        offsets.append(offsets[-1] + k)
    support = SupportRecord(
        torch.cat(ids).to(torch.int32), torch.tensor(offsets, dtype=torch.int32), torch.cat(logq).float()
    )
    adv = torch.randn(t, generator=gen)
    seq = torch.tensor([0] * 5 + [1] * 4 + [2] * (t - 9))
    mask = torch.rand(t, generator=gen) > 0.15
    return logits, support, torch.tensor(tokens), adv, seq, mask


def _f(kind: str, rho: float, cfg: RecipeConfig) -> float:
    """The weight function of each correction, from its formula."""
    if kind == "none":
        return 1.0
    if kind == "tis":
        return min(rho, cfg.tis_cap)
    if kind == "mis":
        return rho if cfg.mis_low <= rho <= cfg.mis_high else 0.0
    if kind == "icepop":
        return rho if cfg.icepop_low <= rho <= cfg.icepop_high else 0.0
    if kind == "seq_mask":
        return 1.0 if cfg.seq_mask_low <= rho <= cfg.seq_mask_high else 0.0
    raise AssertionError(kind)


def reference_loss(logits, support, tokens, adv, seq, mask, cfg: RecipeConfig, temperature, n_global):
    """Σ_t −A_t (w_t log p_t(y_t) − Σ_v c_tv log p_t(v)) / N with w and c computed token by
    token in floats; differentiable in `logits` through the log p terms only."""
    off = support.offsets.tolist()
    n = support.n_rows
    logp_rows, ratio_rows, q_rows, j_of = [], [], [], []
    for t in range(n):
        ids = support.ids[off[t] : off[t + 1]].long()
        lp = torch.log_softmax(logits[t, ids] / temperature, 0)
        lq = support.logq[off[t] : off[t + 1]].double()
        logp_rows.append(lp)
        ratio_rows.append([math.exp(float(a) - float(b)) for a, b in zip(lp.detach(), lq, strict=True)])
        q_rows.append([math.exp(float(b)) for b in lq])
        j_of.append(ids.tolist().index(int(tokens[t])))
    if not cfg.mask_replay:
        full = torch.log_softmax(logits / temperature, -1)
        logp_y = [full[t, int(tokens[t])] for t in range(n)]
        r_y = [math.exp(float(logp_y[t].detach()) - math.log(q_rows[t][j_of[t]])) for t in range(n)]
    else:
        logp_y = [logp_rows[t][j_of[t]] for t in range(n)]
        r_y = [ratio_rows[t][j_of[t]] for t in range(n)]
    kind, level = cfg.importance, cfg.is_level
    if kind == "icepop":
        level = "token"
    if kind == "seq_mask":
        level = "geometric"
    total = logits.new_zeros(())
    for t in range(n):
        if not mask[t]:
            continue
        mates = [s for s in range(n) if seq[s] == seq[t] and mask[s]]
        if level == "token":
            rho, kappa = r_y[t], 1.0
        elif level == "sequence":
            rho, kappa = math.prod(r_y[s] for s in mates), 1.0
        else:
            rho, kappa = math.exp(sum(math.log(r_y[s]) for s in mates) / len(mates)), 1.0 / len(mates)
        term = _f(kind, rho, cfg) * logp_y[t]
        if cfg.score_centering:
            for i, lp in enumerate(logp_rows[t]):
                alt = rho * (ratio_rows[t][i] / r_y[t]) ** kappa
                term = term - q_rows[t][i] * _f(kind, alt, cfg) * lp
        total = total - float(adv[t]) * term
    return total / n_global


PRESETS = ["mis", "tis", "icepop", "seq_mask"]
CASES = [
    *(RecipeConfig(importance=k) for k in PRESETS),
    *(RecipeConfig(importance=k, score_centering=False) for k in PRESETS),
    *(RecipeConfig(importance=k, mask_replay=False, score_centering=False) for k in PRESETS),
    RecipeConfig(importance="icepop", icepop_low=0.8, icepop_high=1.25),
    RecipeConfig(importance="seq_mask", seq_mask_low=0.9, seq_mask_high=1.1),
    RecipeConfig(importance="tis", tis_cap=1.1, is_level="geometric"),
]


@pytest.mark.parametrize(
    "cfg", CASES, ids=lambda c: f"{c.importance}-r{int(c.mask_replay)}-c{int(c.score_centering)}-{c.is_level}"
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_match_reference_loop(cfg: RecipeConfig, seed: int) -> None:
    logits, support, tokens, adv, seq, mask = _batch(seed)
    n_global = int(mask.sum()) + 2
    kwargs = dict(num_loss_tokens=n_global, loss_mask=mask, seq_ids=seq)
    if cfg.mask_replay:
        kwargs["replay"] = replay_logprobs(logits, support, tokens, 0.8)
    else:
        kwargs["logp_token_full"] = full_vocab_logprobs(logits, tokens, 0.8)
    loss, _ = recipe_loss(cfg, support, tokens, adv, **kwargs)
    (grad,) = torch.autograd.grad(loss, logits)
    expect = reference_loss(logits, support, tokens, adv, seq, mask, cfg, 0.8, n_global)
    (expect_grad,) = torch.autograd.grad(expect, logits)
    assert float(loss.detach()) == pytest.approx(float(expect.detach()), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad, expect_grad, atol=1e-6, rtol=1e-5)
    assert grad.abs().max() > 0  # not a vacuous comparison


def _weights_of(cfg: RecipeConfig, seed: int = 3):
    """Per-token weights the loss used, read off the gradient of the uncentred, no-replay
    loss with respect to log p(y): d loss / d log p(y_t) = −A_t w_t / N."""
    logits, support, tokens, adv, seq, mask = _batch(seed, spread=1.5)
    logp = full_vocab_logprobs(logits, tokens, 1.0).detach().requires_grad_()
    loss, metrics = recipe_loss(
        cfg, support, tokens, torch.ones_like(adv), logp_token_full=logp, num_loss_tokens=1, loss_mask=mask, seq_ids=seq
    )
    (g,) = torch.autograd.grad(loss, logp)
    logq = support.logq[support.token_index(tokens)].double()
    return -g, torch.exp(logp.detach() - logq), seq, mask, metrics


def test_icepop_masks_tokens_one_by_one() -> None:
    cfg = RecipeConfig(importance="icepop", mask_replay=False, score_centering=False, icepop_low=0.8, icepop_high=1.25)
    w, r, _, mask, metrics = _weights_of(cfg)
    inside = (r >= 0.8) & (r <= 1.25) & mask
    assert inside.any() and (mask & ~inside).any()  # both cases occur
    torch.testing.assert_close(w[inside], r[inside])
    assert (w[~inside] == 0).all()
    assert metrics.masked_fraction == pytest.approx(float((mask & ~inside).sum() / mask.sum()))


def test_seq_mask_keeps_or_drops_whole_trajectories_with_weight_one() -> None:
    cfg = RecipeConfig(
        importance="seq_mask", mask_replay=False, score_centering=False, seq_mask_low=0.7, seq_mask_high=1.3
    )
    w, r, seq, mask, _ = _weights_of(cfg)
    kept = dropped = 0
    for s in seq.unique().tolist():
        rows = (seq == s) & mask
        geo = math.exp(float(torch.log(r[rows]).mean()))
        if 0.7 <= geo <= 1.3:
            assert (w[rows] == 1.0).all()
            kept += 1
        else:
            assert (w[rows] == 0.0).all()
            dropped += 1
        assert (w[(seq == s) & ~mask] == 0).all()
    assert kept and dropped  # the batch exercises both branches


def test_tis_caps_only_from_above() -> None:
    cfg = RecipeConfig(importance="tis", mask_replay=False, score_centering=False, tis_cap=1.2)
    w, r, _, mask, _ = _weights_of(cfg)
    assert (r[mask] > 1.2).any() and (r[mask] < 1.0).any()
    torch.testing.assert_close(w[mask], torch.clamp(r[mask], max=1.2))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(importance="icepop", is_level="sequence"), "fixes its own level"),
        (dict(importance="seq_mask", is_level="geometric"), "fixes its own level"),
        (dict(importance="icepop", icepop_low=3.0, icepop_high=2.0), "icepop_low"),
        (dict(importance="seq_mask", seq_mask_low=1.5, seq_mask_high=1.2), "seq_mask_low"),
        (dict(seq_mask_high=-1.0), "seq_mask_high must be >= 0"),
        (dict(importance="cispo"), "importance"),
    ],
)
def test_bad_settings_are_refused_with_one_clear_line(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        RecipeConfig(**kwargs)
