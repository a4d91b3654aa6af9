"""recipe_loss: closed-form gradient, on-policy centering, unbiasedness, aggregation, numerics."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from policies import (
    RecipeConfig,
    SupportRecord,
    full_vocab_logprobs,
    recipe_loss,
    replay_logprobs,
    replay_logprobs_from_hidden,
    sample_with_support,
)


def _random_batch(seed: int, t: int = 12, v: int = 9, dtype=torch.float64):
    """Logits leaf [t, v], random supports (random size, random order) holding y, random
    log q (renormalised over the row), advantages, three trajectories, partial loss mask."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, v, generator=gen, dtype=torch.float64) * 1.5).to(dtype).requires_grad_()
    ids, offsets, logq, tokens = [], [0], [], []
    for _ in range(t):
        k = int(torch.randint(1, v + 1, (1,), generator=gen))
        row = torch.randperm(v, generator=gen)[:k]
        lq = torch.log_softmax(torch.randn(k, generator=gen) * 1.2, 0)
        ids.append(row)
        logq.append(lq)
        tokens.append(int(row[int(torch.randint(0, k, (1,), generator=gen))]))
        offsets.append(offsets[-1] + k)
    support = SupportRecord(
        torch.cat(ids).to(torch.int32), torch.tensor(offsets, dtype=torch.int32), torch.cat(logq).float()
    )
    adv = torch.randn(t, generator=gen)
    seq = torch.tensor([0] * 4 + [1] * 5 + [2] * (t - 9))
    mask = torch.rand(t, generator=gen) > 0.2
    return logits, support, torch.tensor(tokens), adv, seq, mask


def _f(rho: float, cfg: RecipeConfig) -> float:
    if cfg.importance == "none":
        return 1.0
    if cfg.importance == "tis":
        return min(rho, cfg.tis_cap)
    return rho if cfg.mis_low <= rho <= cfg.mis_high else 0.0


def closed_form_grad(logits, support, tokens, adv, seq, mask, cfg: RecipeConfig, temperature, n_global):
    """−A·(w_y ∇log p^S(y) − Σ_v c_v ∇log p^S(v)) / N per row, written independently."""
    z = logits.detach().double() / temperature
    off = support.offsets.tolist()
    rows = []
    for t in range(support.n_rows):
        ids = support.ids[off[t] : off[t + 1]].long()
        p = torch.softmax(z[t, ids], 0)
        q = torch.exp(support.logq[off[t] : off[t + 1]].double())
        j = ids.tolist().index(int(tokens[t]))
        rows.append((ids, p, q, p / q, j))
    log_rho, kappa = {}, {}
    for t in range(support.n_rows):
        same = [s for s in range(support.n_rows) if seq[s] == seq[t] and mask[s]]
        lr = [math.log(float(rows[s][3][rows[s][4]])) for s in same]
        if cfg.is_level == "token":
            log_rho[t], kappa[t] = math.log(float(rows[t][3][rows[t][4]])), 1.0
        elif cfg.is_level == "sequence":
            log_rho[t], kappa[t] = sum(lr), 1.0
        else:
            log_rho[t], kappa[t] = sum(lr) / len(lr), 1.0 / len(lr)
    grad = torch.zeros_like(z)
    for t in range(support.n_rows):
        if not mask[t]:
            continue
        ids, p, q, r, j = rows[t]
        w = _f(math.exp(log_rho[t]), cfg)
        score = -p.clone()
        score[j] += 1.0
        g = w * score
        if cfg.score_centering:
            for i in range(len(ids)):
                alt = math.exp(log_rho[t] + kappa[t] * (math.log(float(r[i])) - math.log(float(r[j]))))
                e = -p.clone()
                e[i] += 1.0
                g = g - float(q[i]) * _f(alt, cfg) * e
        grad[t, ids] = -float(adv[t]) * g / temperature / n_global
    return grad


CONFIGS = [
    RecipeConfig(),
    RecipeConfig(score_centering=False),
    RecipeConfig(importance="tis", tis_cap=1.5),
    RecipeConfig(importance="none"),
    RecipeConfig(is_level="sequence", mis_low=0.01, mis_high=100.0),
    RecipeConfig(is_level="sequence"),
    RecipeConfig(is_level="geometric"),
    RecipeConfig(importance="tis", is_level="geometric", score_centering=False),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.importance}-{c.is_level}-c{int(c.score_centering)}")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradient_matches_closed_form(cfg: RecipeConfig, seed: int) -> None:
    logits, support, tokens, adv, seq, mask = _random_batch(seed)
    n_global = int(mask.sum()) + 3  # the batch is part of a bigger global batch
    rep = replay_logprobs(logits, support, tokens, 0.7)
    loss, _ = recipe_loss(cfg, support, tokens, adv, replay=rep, num_loss_tokens=n_global,
                          loss_mask=mask, seq_ids=seq)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logits)
    expect = closed_form_grad(logits, support, tokens, adv, seq, mask, cfg, 0.7, n_global)
    torch.testing.assert_close(grad, expect, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("importance", ["none", "mis", "tis"])
def test_on_policy_centering_gradient_is_zero(importance: str) -> None:
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(40, 300, generator=gen) * 2).requires_grad_()
    tokens, support = sample_with_support(logits.detach(), temperature=0.9, top_k=64, top_p=0.97, generator=gen)
    rep = replay_logprobs(logits, support, tokens, 0.9)
    on_policy = SupportRecord(support.ids, support.offsets, rep.logp_support.detach().float())
    adv = torch.randn(40, generator=gen)
    grads = []
    for centering in (True, False):
        cfg = RecipeConfig(importance=importance, score_centering=centering)
        rep = replay_logprobs(logits, on_policy, tokens, 0.9)
        loss, metrics = recipe_loss(cfg, on_policy, tokens, adv, replay=rep, num_loss_tokens=40)
        grads.append(torch.autograd.grad(loss, logits)[0])
        assert metrics.mismatch_kl == pytest.approx(0.0, abs=1e-6)
    centering_grad = grads[0] - grads[1]
    assert centering_grad.abs().max() < 1e-7
    assert grads[1].abs().max() > 1e-3  # the token term itself is not trivially zero


def _bandit_grads(cfg: RecipeConfig, delta: torch.Tensor, n: int = 200_000):
    """Per-sample ascent directions from the recipe on a 6-arm bandit, support = arms 0..4."""
    theta = torch.tensor([0.5, -0.3, 1.0, 0.0, -1.0, 2.0], dtype=torch.float64)
    reward = torch.tensor([1.0, 0.0, 0.5, -0.5, 2.0], dtype=torch.float64)
    sup = torch.arange(5)
    logq_row = torch.log_softmax(theta[sup] + delta, 0)
    gen = torch.Generator().manual_seed(11)
    pick = torch.multinomial(torch.exp(logq_row), n, replacement=True, generator=gen)
    support = SupportRecord(
        sup.to(torch.int32).repeat(n),
        torch.arange(0, 5 * n + 1, 5, dtype=torch.int32),
        logq_row.float().repeat(n),
    )
    logits = theta.expand(n, 6).clone().requires_grad_()
    rep = replay_logprobs(logits, support, pick, 1.0)
    loss, metrics = recipe_loss(cfg, support, pick, reward[pick].float(), replay=rep, num_loss_tokens=n)
    (g,) = torch.autograd.grad(loss, logits)
    per_sample = -g * n  # ascent direction of each sample
    th = theta.clone().requires_grad_()
    (exact,) = torch.autograd.grad((torch.softmax(th[sup], 0) * reward).sum(), th)
    ratio = torch.exp(torch.log_softmax(theta[sup], 0) - logq_row)
    return per_sample, exact, ratio, metrics


PLAIN_IS = dict(importance="mis", mis_low=0.0, mis_high=float("inf"))


@pytest.mark.parametrize("centering", [True, False])
@pytest.mark.parametrize(
    ("kwargs", "delta"),
    [
        (PLAIN_IS, torch.tensor([1.5, -1.2, 0.0, 0.8, -1.7], dtype=torch.float64)),
        ({}, torch.tensor([0.4, -0.5, 0.3, 0.0, -0.2], dtype=torch.float64)),  # MIS, ratios in window
    ],
)
def test_unbiased_gradient_on_bandit(kwargs: dict, delta: torch.Tensor, centering: bool) -> None:
    cfg = RecipeConfig(score_centering=centering, **kwargs)
    per_sample, exact, ratio, metrics = _bandit_grads(cfg, delta)
    if kwargs:
        assert ((ratio < 0.5) | (ratio > 5.0)).any()  # plain IS case really leaves the MIS window
    else:
        assert ((ratio >= 0.5) & (ratio <= 5.0)).all() and metrics.masked_fraction == 0.0
    mean = per_sample.mean(0)
    se = per_sample.std(0) / math.sqrt(per_sample.shape[0])
    assert ((mean - exact).abs() <= 3 * se + 1e-12).all(), (mean, exact, se)


def test_bandit_detects_bias_without_weights() -> None:
    per_sample, exact, _, _ = _bandit_grads(
        RecipeConfig(importance="none"), torch.tensor([1.5, -1.2, 0.0, 0.8, -1.7], dtype=torch.float64)
    )
    mean = per_sample.mean(0)
    se = per_sample.std(0) / math.sqrt(per_sample.shape[0])
    assert ((mean - exact).abs() > 10 * se).any()  # the test above has power


@pytest.mark.parametrize(
    "cfg", [RecipeConfig(), RecipeConfig(is_level="sequence"), RecipeConfig(is_level="geometric", importance="tis")]
)
def test_masked_tokens_change_neither_loss_nor_gradient(cfg: RecipeConfig) -> None:
    logits, support, tokens, adv, seq, mask = _random_batch(5, dtype=torch.float32)
    assert (~mask).any()

    def run(lg, sup, a):
        rep = replay_logprobs(lg, sup, tokens, 1.0)
        loss, m = recipe_loss(cfg, sup, tokens, a, replay=rep, num_loss_tokens=20, loss_mask=mask, seq_ids=seq)
        return loss, torch.autograd.grad(loss, lg)[0], m

    loss0, g0, m0 = run(logits, support, adv)
    changed = logits.detach().clone()
    changed[~mask] = torch.randn(int((~mask).sum()), logits.shape[1]) * 50
    changed.requires_grad_()
    row = support.row_index()
    logq = torch.where(mask[row], support.logq, torch.full_like(support.logq, -30.0))
    adv2 = torch.where(mask, adv, torch.full_like(adv, 1e6))
    loss1, g1, m1 = run(changed, SupportRecord(support.ids, support.offsets, logq), adv2)
    assert float(loss0.detach()) == float(loss1.detach())
    assert torch.equal(g0, g1)
    assert (g1[~mask] == 0).all()
    assert m0.model_dump() == m1.model_dump() and m0.tokens == int(mask.sum())


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_micro_batches_equal_whole_batch(level: str) -> None:
    gen = torch.Generator().manual_seed(9)
    lengths = [7, 3, 10, 1, 6, 5]
    t, h, v = sum(lengths), 16, 200
    hidden = torch.randn(t, h, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / 4).requires_grad_()
    with torch.no_grad():
        sampler = hidden @ weight.T + 0.5 * torch.randn(t, v, generator=gen)
    tokens, support = sample_with_support(sampler, temperature=1.0, top_k=32, top_p=0.97, generator=gen)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    adv = torch.randn(len(lengths), generator=gen)[seq]
    mask = torch.rand(t, generator=gen) > 0.25
    n_global = int(mask.sum())
    cfg = RecipeConfig(is_level=level)

    def step(a: int, b: int):
        rep = replay_logprobs_from_hidden(hidden[a:b], weight, support.rows(a, b), tokens[a:b], 1.0)
        return recipe_loss(cfg, support.rows(a, b), tokens[a:b], adv[a:b], replay=rep,
                           num_loss_tokens=n_global, loss_mask=mask[a:b], seq_ids=seq[a:b])  # fmt: skip

    whole, m_whole = step(0, t)
    whole.backward()
    g_whole = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    total, parts = 0.0, []
    bounds = [0, 10, 20, 21, t]  # trajectory boundaries
    for a, b in itertools.pairwise(bounds):
        loss, m = step(a, b)
        loss.backward()  # gradient accumulation
        total += float(loss.detach())
        parts.append(m)
    assert total == pytest.approx(float(whole.detach()), abs=1e-6)
    torch.testing.assert_close(hidden.grad, g_whole[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(weight.grad, g_whole[1], atol=1e-6, rtol=0)
    merged = type(m_whole).merge(parts)
    assert merged.tokens == m_whole.tokens
    assert merged.mismatch_kl == pytest.approx(m_whole.mismatch_kl, abs=1e-9)
    assert merged.entropy == pytest.approx(m_whole.entropy, abs=1e-6)


@pytest.mark.parametrize("cfg", [RecipeConfig(), RecipeConfig(importance="tis"), RecipeConfig(importance="none"),
                                 RecipeConfig(is_level="sequence"), RecipeConfig(is_level="geometric")])  # fmt: skip
def test_bf16_and_extreme_logq_stay_finite(cfg: RecipeConfig) -> None:
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(30, 32, generator=gen).bfloat16().requires_grad_()
    weight = torch.randn(500, 32, generator=gen).bfloat16().requires_grad_()
    tokens, support = sample_with_support((hidden @ weight.T).detach(), temperature=1.0, top_k=64, top_p=0.97,
                                          generator=gen)  # fmt: skip
    extreme = SupportRecord(support.ids, support.offsets, torch.full_like(support.logq, -30.0))
    seq = torch.arange(30) // 10
    adv = torch.randn(30, generator=gen)
    rep = replay_logprobs_from_hidden(hidden, weight, extreme, tokens, 1.0)
    loss, m = recipe_loss(cfg, extreme, tokens, adv, replay=rep, num_loss_tokens=30, seq_ids=seq)
    loss.backward()
    assert torch.isfinite(loss) and math.isfinite(m.mismatch_kl) and m.mismatch_kl > 1e6
    assert torch.isfinite(hidden.grad.float()).all() and torch.isfinite(weight.grad.float()).all()
    logits = (hidden @ weight.T).detach().requires_grad_()  # bf16 logits, full path
    rep = replay_logprobs(logits, extreme, tokens, 1.0)
    loss, _ = recipe_loss(cfg, extreme, tokens, adv, replay=rep, num_loss_tokens=30, seq_ids=seq)
    (g,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(loss) and g.dtype == torch.bfloat16 and torch.isfinite(g.float()).all()


def test_without_replay_uses_full_vocab_logprob_and_processed_q() -> None:
    cfg = RecipeConfig(mask_replay=False, score_centering=False, importance="tis", tis_cap=1.5)
    logits, support, tokens, adv, _seq, mask = _random_batch(8)
    lp = full_vocab_logprobs(logits, tokens, 0.8)
    loss, m = recipe_loss(cfg, support, tokens, adv, logp_token_full=lp, num_loss_tokens=10, loss_mask=mask)
    (g,) = torch.autograd.grad(loss, logits)
    z = logits.detach() / 0.8
    p = torch.softmax(z, -1)
    logq_y = support.logq[support.token_index(tokens)].double()
    w = torch.clamp(torch.exp(torch.log(p[torch.arange(12), tokens]) - logq_y), max=1.5)
    onehot = torch.nn.functional.one_hot(tokens, z.shape[1]).double()
    expect = (-(adv.double() * w * mask)[:, None] * (onehot - p) / 0.8) / 10
    torch.testing.assert_close(g, expect, atol=1e-6, rtol=1e-5)
    assert m.entropy is None
    with pytest.raises(ValueError, match="logp_token_full"):
        recipe_loss(cfg, support, tokens, adv, num_loss_tokens=10)


def test_loss_input_errors() -> None:
    logits, support, tokens, adv, _seq, _mask = _random_batch(1)
    rep = replay_logprobs(logits, support, tokens, 1.0)
    with pytest.raises(ValueError, match="num_loss_tokens"):
        recipe_loss(RecipeConfig(), support, tokens, adv, replay=rep, num_loss_tokens=0)
    with pytest.raises(ValueError, match="replay"):
        recipe_loss(RecipeConfig(), support, tokens, adv, num_loss_tokens=3)
    with pytest.raises(ValueError, match="seq_ids"):
        recipe_loss(RecipeConfig(is_level="sequence"), support, tokens, adv, replay=rep, num_loss_tokens=3)
    with pytest.raises(ValueError, match="advantages"):
        recipe_loss(RecipeConfig(), support, tokens, adv[:3], replay=rep, num_loss_tokens=3)
