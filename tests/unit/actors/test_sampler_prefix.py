"""The sampler's session prefix cache: a turn computes only its new tokens, exactly."""

from __future__ import annotations

import pytest
import torch

from actors.models import build_model, default_model_config, model_weights
from actors.sampler import ContinuousBatcher, GenerateRequest, Qwen3Engine

torch.set_num_threads(1)

CFG = default_model_config()


@pytest.fixture(scope="module")
def weights():
    return model_weights(build_model(CFG, seed=0))


def _batcher(weights, *, slots: int = 4, **kw) -> ContinuousBatcher:
    b = ContinuousBatcher(Qwen3Engine(CFG, max_slots=slots), pool="p", **kw)
    b.set_weights(weights, version=0)
    return b


def _one(b: ContinuousBatcher, req: GenerateRequest):
    b.submit(req)
    out = []
    while b.has_work():
        out += b.step()
    assert len(out) == 1
    return out[0]


def _conversation(b: ContinuousBatcher, session: str | None, turns: int = 3):
    """Three turns: each prompt is the previous prompt + reply + a user chunk."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, CFG["vocab_size"], (9,), generator=g).tolist()
    results = []
    for t in range(turns):
        res = _one(
            b,
            GenerateRequest(
                request_id=f"r{t}",
                prompt_ids=prompt,
                max_new_tokens=5,
                seed=100 + t,
                temperature=1.0,
                top_k=8,
                top_p=0.9,
                session_id=session,
            ),
        )
        results.append(res)
        prompt = prompt + res.token_ids + torch.randint(0, CFG["vocab_size"], (4,), generator=g).tolist()
    return results


def test_cached_turns_equal_recomputed_turns_and_skip_the_prefix(weights) -> None:
    cold, warm = _batcher(weights), _batcher(weights)
    ref, got = _conversation(cold, None), _conversation(warm, "s1")
    for r, g in zip(ref, got, strict=True):
        assert g.token_ids == r.token_ids
        assert torch.equal(g.support_ids, r.support_ids)
        torch.testing.assert_close(g.support_logq, r.support_logq, atol=1e-5, rtol=0)
    assert warm.prefix_hits == 2 and cold.prefix_hits == 0
    # Turn t>0 computes only what follows the cache: the last reply token and the new user chunk.
    assert warm.prompt_tokens == 9 + 2 * (1 + 4)
    assert cold.prompt_tokens == sum(r.prompt_tokens for r in ref)
    assert warm.prefix_tokens_reused == sum(r.prompt_tokens for r in ref[1:]) - 2 * 5
    assert warm.parked == 1 and warm.free_slots == 4


def test_rewritten_history_keeps_only_the_shared_prefix(weights) -> None:
    b, ref = _batcher(weights), _batcher(weights)
    req = dict(max_new_tokens=4, seed=7, temperature=1.0, top_k=8, top_p=0.9)
    first = _one(b, GenerateRequest(request_id="a", prompt_ids=list(range(10, 30)), session_id="s", **req))
    assert first.token_ids
    edited = list(range(10, 20)) + [3, 4, 5]  # turns 10..29 replaced after position 10
    got = _one(b, GenerateRequest(request_id="b", prompt_ids=edited, session_id="s", **req))
    want = _one(ref, GenerateRequest(request_id="b", prompt_ids=edited, **req))
    assert got.token_ids == want.token_ids
    assert b.prefix_tokens_reused == 10 and b.prompt_tokens == 20 + 3


def test_parked_sessions_are_evicted_least_recent_first(weights) -> None:
    b = _batcher(weights, slots=2)
    for sid in ("a", "b"):
        _one(b, GenerateRequest(request_id=sid, prompt_ids=[1, 2, 3], max_new_tokens=2, session_id=sid))
    assert b.parked == 2
    _one(b, GenerateRequest(request_id="c", prompt_ids=[4, 5, 6], max_new_tokens=2))  # needs a slot
    assert b.prefix_evictions == 1 and b.parked == 1
    _one(b, GenerateRequest(request_id="b2", prompt_ids=[1, 2, 3, 9], max_new_tokens=2, session_id="b"))
    assert b.prefix_hits == 1  # "b" survived, "a" (least recent) was evicted
    assert b.drop_session("b") and not b.drop_session("a")
    assert b.parked == 0 and b.free_slots == 2


@pytest.mark.parametrize("mode", ["reuse", "recompute"])
def test_weight_update_reuses_or_recomputes_the_prefix(weights, mode) -> None:
    other = model_weights(build_model(CFG, seed=1))
    b = _batcher(weights, stale_prefix=mode)
    _one(b, GenerateRequest(request_id="a", prompt_ids=list(range(1, 12)), max_new_tokens=3, session_id="s"))
    b.set_weights(other, version=1)
    res = _one(b, GenerateRequest(request_id="b", prompt_ids=list(range(1, 20)), max_new_tokens=3, session_id="s"))
    assert res.versions == [1, 1, 1]
    if mode == "reuse":
        assert b.prefix_hits == 1 and b.prefix_tokens_reused == 11
    else:
        assert b.prefix_hits == 0 and b.prompt_tokens == 11 + 19


def test_abort_does_not_park(weights) -> None:
    b = _batcher(weights)
    b.submit(GenerateRequest(request_id="a", prompt_ids=[1, 2, 3], max_new_tokens=50, session_id="s"))
    b.step()
    assert b.abort("a") is not None
    assert b.parked == 0 and b.free_slots == 4
