"""Mask replay: union-of-supports path == full-vocabulary path (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from policies import (
    SupportRecord,
    replay_logprobs,
    replay_logprobs_from_hidden,
    sample_with_support,
    segment_logsumexp,
)


def _problem(t=48, h=24, v=400, seed=0, dtype=torch.float32, bias=True):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(t, h, generator=gen)).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=gen) * 0.1).to(dtype).requires_grad_() if bias else None
    with torch.no_grad():
        sampler_logits = hidden.float() @ weight.float().T + torch.randn(t, v, generator=gen) * 0.3
    tokens, support = sample_with_support(sampler_logits, temperature=0.8, top_k=32, top_p=0.95, generator=gen)
    return hidden, weight, b, tokens, support


def _grads(result, leaves, gen_seed=1):
    gen = torch.Generator().manual_seed(gen_seed)
    probe_s = torch.randn(result.logp_support.shape, generator=gen)
    probe_t = torch.randn(result.logp_token.shape, generator=gen)
    obj = (result.logp_support * probe_s).sum() + (result.logp_token * probe_t).sum()
    return torch.autograd.grad(obj, [x for x in leaves if x is not None])


@pytest.mark.parametrize(("tile_elements", "col_chunk"), [(1 << 22, 8192), (500, 8192), (300, 37), (1, 1)])
def test_union_path_equals_full_path_float32(tile_elements: int, col_chunk: int) -> None:
    hidden, weight, bias, tokens, support = _problem()
    full = replay_logprobs(hidden @ weight.T + bias, support, tokens, 0.8)
    union = replay_logprobs_from_hidden(
        hidden, weight, support, tokens, 0.8, bias, tile_elements=tile_elements, col_chunk=col_chunk
    )
    torch.testing.assert_close(union.logp_support, full.logp_support, atol=1e-5, rtol=0)
    torch.testing.assert_close(union.logp_token, full.logp_token, atol=1e-5, rtol=0)
    for gu, gf in zip(_grads(union, [hidden, weight, bias]), _grads(full, [hidden, weight, bias]), strict=True):
        torch.testing.assert_close(gu, gf, atol=1e-5, rtol=0)


def test_replayed_values_are_the_renormalised_support_softmax() -> None:
    hidden, weight, _, tokens, support = _problem(bias=False)
    res = replay_logprobs_from_hidden(hidden, weight, support, tokens, 0.8)
    logits = (hidden @ weight.T).detach() / 0.8
    off = support.offsets.tolist()
    for t in range(support.n_rows):
        ids = support.ids[off[t] : off[t + 1]].long()
        expect = torch.log_softmax(logits[t, ids], 0)
        torch.testing.assert_close(res.logp_support[off[t] : off[t + 1]].detach(), expect, atol=1e-5, rtol=0)
        assert float(res.logp_token[t].detach()) == pytest.approx(
            float(expect[ids.tolist().index(int(tokens[t]))]), abs=1e-5
        )


def test_bfloat16_inputs_match_float32_math() -> None:
    hidden, weight, _, tokens, support = _problem(dtype=torch.bfloat16, bias=False)
    union = replay_logprobs_from_hidden(hidden, weight, support, tokens, 0.8)
    assert union.logp_support.dtype == torch.float32
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    full = replay_logprobs(h32 @ w32.T, support, tokens, 0.8)
    torch.testing.assert_close(union.logp_support, full.logp_support, atol=1e-5, rtol=0)
    gu = _grads(union, [hidden, weight])
    gf = _grads(full, [h32, w32])
    assert gu[0].dtype == torch.bfloat16 and gu[1].dtype == torch.bfloat16
    for a, b in zip(gu, gf, strict=True):
        assert torch.isfinite(a.float()).all()
        torch.testing.assert_close(a.float(), b, atol=2e-2, rtol=2e-2)  # bf16 rounding of the grads
    bf16_logits = (hidden @ weight.T).detach()
    r = replay_logprobs(bf16_logits, support, tokens, 0.8)
    assert r.logp_support.dtype == torch.float32 and torch.isfinite(r.logp_support).all()


@pytest.mark.parametrize(("tile_elements", "col_chunk"), [(1 << 22, 8192), (6, 3), (1, 1)])
def test_union_path_gradcheck_float64(tile_elements: int, col_chunk: int) -> None:
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(6, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(11, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=gen, requires_grad=True)
    tokens, support = sample_with_support(
        (hidden @ weight.T).detach(), temperature=1.0, top_k=5, top_p=0.9, generator=gen
    )
    assert support.counts().max() > 1

    def f(h, w, b):
        return replay_logprobs_from_hidden(
            h, w, support, tokens, 0.7, b, tile_elements=tile_elements, col_chunk=col_chunk
        ).logp_support

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_token_outside_support_names_position() -> None:
    hidden, weight, _, tokens, support = _problem(bias=False)
    bad = tokens.clone()
    row5 = support.ids[support.offsets[5] : support.offsets[6]].long().tolist()
    bad[5] = next(v for v in range(weight.shape[0]) if v not in row5)
    with pytest.raises(ValueError, match="position 5"):
        replay_logprobs_from_hidden(hidden, weight, support, bad, 0.8)
    with pytest.raises(ValueError, match="position 5"):
        replay_logprobs((hidden @ weight.T), support, bad, 0.8)


def test_malformed_records_are_refused() -> None:
    ids = torch.tensor([1, 2, 2, 3], dtype=torch.int32)
    logq = torch.zeros(4)
    with pytest.raises(ValueError, match="row 1 repeats"):
        SupportRecord(ids, torch.tensor([0, 1, 4], dtype=torch.int32), logq).check()
    with pytest.raises(ValueError, match="row 1 has 0 entries"):
        SupportRecord(ids, torch.tensor([0, 4, 4], dtype=torch.int32), logq).check()
    with pytest.raises(ValueError, match="offsets"):
        SupportRecord(ids, torch.tensor([0, 1, 3], dtype=torch.int32), logq).check()
    with pytest.raises(ValueError, match="int32"):
        SupportRecord(ids.long(), torch.tensor([0, 4], dtype=torch.int32), logq)
    ok = SupportRecord(ids[:3], torch.tensor([0, 2, 3], dtype=torch.int32), logq[:3])
    with pytest.raises(ValueError, match="vocabulary size"):
        replay_logprobs(torch.zeros(2, 2), ok, torch.tensor([1, 2]), 1.0)


def test_greedy_supports_replay_to_zero_and_wide_rows_are_refused() -> None:
    logits = torch.randn(6, 30, requires_grad=True)
    tokens, support = sample_with_support(logits.detach(), temperature=0.0, top_k=0, top_p=1.0)
    res = replay_logprobs(logits, support, tokens, 0.0)
    assert res.logp_token.abs().max() == 0
    _, wide = sample_with_support(logits.detach(), temperature=1.0, top_k=4, top_p=1.0)
    with pytest.raises(ValueError, match="single-id"):
        replay_logprobs(logits, wide, wide.ids[wide.offsets[:-1].long()].long(), 0.0)


def test_record_rows_and_cat_round_trip() -> None:
    _, _, _, tokens, support = _problem(bias=False)
    parts = [support.rows(0, 10), support.rows(10, 11), support.rows(11, support.n_rows)]
    joined = SupportRecord.cat(parts)
    assert torch.equal(joined.ids, support.ids) and torch.equal(joined.offsets, support.offsets)
    assert torch.equal(joined.logq, support.logq)
    assert torch.equal(joined.token_index(tokens), support.token_index(tokens))


def test_segment_logsumexp_gradient() -> None:
    vals = torch.tensor([1.0, 2.0, -1.0, 0.5, 0.5], requires_grad=True)
    row = torch.tensor([0, 0, 1, 2, 2])
    out = segment_logsumexp(vals, row, 3)
    expect = torch.stack([vals[:2].logsumexp(0), vals[2:3].logsumexp(0), vals[3:].logsumexp(0)])
    torch.testing.assert_close(out, expect)
    (g,) = torch.autograd.grad(out.sum(), vals)
    (ge,) = torch.autograd.grad(expect.sum(), vals)
    torch.testing.assert_close(g, ge)
