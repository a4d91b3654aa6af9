"""sample_with_support: exact support against a brute-force reference, sampling law, greedy."""

from __future__ import annotations

import math

import pytest
import torch

from policies import SupportRecord, sample_with_support

# 99.9% quantiles of chi-square with df = 1..9 (fixed seed, so this is a regression bound).
_CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88]


def reference_support(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_keep: int = 1):
    """Sort by (−x, id), cap, cumulative sum in float64, cut (never below min_keep ids);
    written for clarity only."""
    x = (row.float() / temperature).tolist()
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    cand = order[:top_k] if top_k > 0 else order
    m = max(x[i] for i in cand)
    z = sum(math.exp(x[i] - m) for i in cand)
    probs = [math.exp(x[i] - m) / z for i in cand]
    kept, mass = [], 0.0
    for i, p in zip(cand, probs, strict=True):
        if p <= 0 or (top_p < 1.0 and mass >= top_p and len(kept) >= min_keep):
            break
        kept.append(i)
        mass += p
    zk = sum(math.exp(x[i] - m) for i in kept)
    logq = [x[i] - m - math.log(zk) for i in kept]
    return kept, logq


def _rows(support: SupportRecord):
    off = support.offsets.tolist()
    return [
        (support.ids[off[i] : off[i + 1]].tolist(), support.logq[off[i] : off[i + 1]]) for i in range(support.n_rows)
    ]


CASES = [
    # (logit kind, temperature, top_k, top_p[, min_keep])
    ("normal", 1.0, 64, 0.97),
    ("peaked", 1.0, 64, 0.9, 2),  # one-token nuclei widened to two ids
    ("peaked", 0.8, 0, 0.97, 3),  # uncapped, min_keep 3
    ("peaked", 1.0, 2, 0.5, 4),  # min_keep above the top-k cap: the cap wins
    ("ties", 1.0, 0, 0.5, 2),  # ties at the min_keep cut: lower id first
    ("neg_inf", 1.0, 0, 0.1, 8),  # ids with probability 0 are never kept, whatever min_keep
    ("normal", 0.6, 0, 0.9),  # uncapped, fits in the first candidate window
    ("normal", 1.7, 5, 0.99),  # top-k cap below the top-p set
    ("ties", 0.7, 6, 0.95),  # many exact ties, cap inside a tie block
    ("ties", 1.0, 0, 0.8),  # ties at the top-p cut, uncapped
    ("ties", 1.3, 3, 1.0),  # top_p = 1 keeps the whole capped set
    ("flat", 1.0, 0, 0.97),  # wide nucleus: candidate window grows to a full sort
    ("neg_inf", 1.0, 0, 1.0),  # masked vocabulary entries are never kept
]


def _logits(kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(16, 300, generator=gen) * 3
    if kind == "ties":
        return torch.randint(-3, 4, (16, 300), generator=gen).float() * 0.5
    if kind == "flat":
        return torch.randn(4, 600, generator=gen) * 0.05
    if kind == "peaked":  # half the rows have a top token above any top_p used here
        x = torch.randn(16, 300, generator=gen)
        x[::2, 7] += 12.0
        return x
    x = torch.randn(8, 40, generator=gen)
    x[:, 5:] = float("-inf")
    return x


@pytest.mark.parametrize("case", CASES)
def test_support_matches_brute_force(case: tuple) -> None:
    kind, temperature, top_k, top_p, *rest = case
    min_keep = rest[0] if rest else 1
    gen = torch.Generator().manual_seed(7)
    logits = _logits(kind, gen)
    tokens, support = sample_with_support(
        logits, temperature=temperature, top_k=top_k, top_p=top_p, min_keep=min_keep, generator=gen
    )
    support.check()
    assert tokens.dtype == torch.int64 and tokens.shape == (logits.shape[0],)
    assert support.ids.dtype == torch.int32 and support.offsets.dtype == torch.int32
    assert support.logq.dtype == torch.float32
    for b, (ids, logq) in enumerate(_rows(support)):
        ref_ids, ref_logq = reference_support(logits[b], temperature, top_k, top_p, min_keep)
        assert ids == ref_ids, f"row {b}"
        torch.testing.assert_close(logq, torch.tensor(ref_logq), atol=1e-5, rtol=0)
        assert int(tokens[b]) in ids
        assert torch.logsumexp(logq, 0).abs() < 1e-5
    support.token_index(tokens)  # raises if any token is outside its row


def test_tie_at_top_k_cut_keeps_lowest_ids_in_rank_order() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 1.0, 2.0, -1.0]])
    _, support = sample_with_support(logits, temperature=1.0, top_k=5, top_p=1.0)
    assert support.ids.tolist() == [1, 3, 6, 2, 4]


def test_bfloat16_and_float16_logits() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(32, 1000, generator=gen) * 4
    for dt in (torch.bfloat16, torch.float16):
        low = logits.to(dt)
        _, support = sample_with_support(low, temperature=0.9, top_k=64, top_p=0.97, generator=gen)
        for b, (ids, _) in enumerate(_rows(support)):
            assert ids == reference_support(low[b], 0.9, 64, 0.97)[0]


def test_sampling_frequencies_match_q_chi_square() -> None:
    logits = torch.tensor([2.0, 1.5, 1.5, 1.0, 0.2, -1.0, -3.0, 0.5])
    n = 40_000
    gen = torch.Generator().manual_seed(1234)
    tokens, support = sample_with_support(logits.expand(n, -1), temperature=0.9, top_k=6, top_p=0.9, generator=gen)
    ids, logq = _rows(support)[0]
    assert all(r[0] == ids for r in _rows(support)[:5])
    ref_ids, _ = reference_support(logits, 0.9, 6, 0.9)
    assert ids == ref_ids and len(ids) >= 3
    counts = torch.bincount(tokens, minlength=logits.numel()).double()
    assert counts[[i for i in range(8) if i not in ids]].sum() == 0
    expected = torch.exp(logq.double()) * n
    observed = counts[ids]
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < _CHI2_999[len(ids) - 2], (chi2, observed.tolist(), expected.tolist())


def test_same_generator_seed_same_draws() -> None:
    logits = torch.randn(50, 200)
    a = sample_with_support(logits, temperature=1.0, top_k=20, top_p=0.9,
                            generator=torch.Generator().manual_seed(5))  # fmt: skip
    b = sample_with_support(logits, temperature=1.0, top_k=20, top_p=0.9,
                            generator=torch.Generator().manual_seed(5))  # fmt: skip
    assert torch.equal(a[0], b[0]) and torch.equal(a[1].ids, b[1].ids)


def test_greedy_records_singleton_with_zero_logq() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 5.0]], dtype=torch.bfloat16)
    tokens, support = sample_with_support(logits, temperature=0.0, top_k=64, top_p=0.97)
    assert tokens.tolist() == [1, 0]  # lowest id among equal maxima
    assert support.ids.tolist() == [1, 0] and support.offsets.tolist() == [0, 1, 2]
    assert support.logq.tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(temperature=-0.5, top_k=5, top_p=0.9), "temperature"),
        (dict(temperature=1.0, top_k=5, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_k=5, top_p=1.01), "top_p"),
        (dict(temperature=1.0, top_k=5, top_p=0.9, min_keep=0), "min_keep"),
    ],
)
def test_bad_arguments_named(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        sample_with_support(torch.randn(2, 10), **kwargs)


def test_nan_row_named() -> None:
    logits = torch.randn(3, 10)
    logits[2, 4] = float("nan")
    with pytest.raises(ValueError, match="row 2"):
        sample_with_support(logits, temperature=1.0, top_k=5, top_p=0.9)


def test_one_token_nucleus_keeps_its_runner_up_with_min_keep() -> None:
    """The top id alone passes top_p: min_keep=1 records {top} with log q = 0 (the absorbing
    state of issue 11); min_keep=2 records {top, runner-up} with their renormalised q."""
    logits = torch.tensor([[0.0, 9.0, 2.0, 1.0, -1.0]])
    _, one = sample_with_support(logits, temperature=1.0, top_k=64, top_p=0.97, min_keep=1)
    assert one.ids.tolist() == [1] and one.logq.tolist() == [0.0]
    n = 20_000
    tokens, two = sample_with_support(
        logits.expand(n, -1),
        temperature=1.0,
        top_k=64,
        top_p=0.97,
        min_keep=2,
        generator=torch.Generator().manual_seed(0),
    )
    ids, logq = _rows(two)[0]
    assert ids == [1, 2]
    torch.testing.assert_close(logq, torch.log_softmax(torch.tensor([9.0, 2.0]), 0), atol=1e-6, rtol=0)
    # The runner-up is drawn at its q (≈ 9.1e-4): 18 expected in 20k draws.
    expected = n * math.exp(float(logq[1]))
    observed = int((tokens == 2).sum())
    assert abs(observed - expected) < 4 * math.sqrt(expected), (observed, expected)
    assert int(((tokens != 1) & (tokens != 2)).sum()) == 0
