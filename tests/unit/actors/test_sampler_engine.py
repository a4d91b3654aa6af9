"""The torch generation engine against transformers, and continuous batching on top of it."""

from __future__ import annotations

import pytest
import torch
import trio

from actors.models import build_model, default_model_config, model_weights
from actors.sampler import ContinuousBatcher, GenerateRequest, Qwen3Engine
from policies import sample_with_support

torch.set_num_threads(1)

CFG = default_model_config()


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=0)


@pytest.fixture(scope="module")
def weights(model):
    return model_weights(model)


def _prompts(n: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG["vocab_size"], (length,), generator=g).tolist() for length in lengths[:n]]


def _run(batcher: ContinuousBatcher) -> dict:
    out = {}
    while batcher.has_work():
        for res in batcher.step():
            out[res.request_id] = res
    return out


def test_logits_match_hf_prefill_and_decode(model, weights) -> None:
    engine = Qwen3Engine(CFG, max_slots=4)
    engine.load(weights)
    prompts = _prompts(3, [5, 11, 2])
    cont = _prompts(3, [6, 6, 6], seed=2)
    with torch.no_grad():
        ref = [model(torch.tensor([p + c])).logits[0] for p, c in zip(prompts, cont, strict=True)]
    slots = [3, 0, 2]  # not contiguous, not in order: decode gathers cache rows
    logits = engine.prefill(slots, prompts, all_logits=True)
    for row, p in enumerate(prompts):
        torch.testing.assert_close(logits[row, : len(p)], ref[row][: len(p)], atol=1e-4, rtol=0)
    for step in range(6):
        step_logits = engine.decode(slots, [c[step] for c in cont])
        for row, p in enumerate(prompts):
            torch.testing.assert_close(step_logits[row], ref[row][len(p) + step], atol=1e-4, rtol=0)
    # A slot subset decodes on its own (the others are simply not stepped).
    with torch.no_grad():
        ref0 = model(torch.tensor([prompts[1] + cont[1] + [7]])).logits[0, -1]
    torch.testing.assert_close(engine.decode([0], [7])[0], ref0, atol=1e-4, rtol=0)


def test_partial_load_equals_full_load(weights) -> None:
    full, part = Qwen3Engine(CFG, max_slots=1), Qwen3Engine(CFG, max_slots=1)
    other = model_weights(build_model(CFG, seed=5))
    full.load(other)
    part.load(weights)
    part.load(other, names=[n for n in other if ".layers.1." in n or "lm_head" in n])
    assert not torch.equal(part.prefill([0], [[1, 2, 3]]), full.prefill([0], [[1, 2, 3]]))
    part.load(other, names=list(other))
    torch.testing.assert_close(part.prefill([0], [[1, 2, 3]]), full.prefill([0], [[1, 2, 3]]), atol=0, rtol=0)


def test_tokens_lie_in_support_and_rows_equal_policies(model, weights) -> None:
    """Replay the sampler's draws: HF logits + the request's generator reproduce every row."""
    engine = Qwen3Engine(CFG, max_slots=2)
    batcher = ContinuousBatcher(engine, pool="p")
    batcher.set_weights(weights, version=0)
    prompt = _prompts(1, [7])[0]
    kw = dict(temperature=0.8, top_k=16, top_p=0.9, min_keep=1)
    batcher.submit(GenerateRequest(request_id="a", prompt_ids=prompt, max_new_tokens=12, seed=123, **kw))
    res = _run(batcher)["a"]
    support = res.support()
    support.check()
    support.token_index(torch.tensor(res.token_ids))  # raises if a token is outside its row
    assert res.versions == [0] * 12 and res.finish_reason == "length" and res.prompt_tokens == 7

    with torch.no_grad():
        logits = model(torch.tensor([prompt + res.token_ids])).logits[0, len(prompt) - 1 : -1]
    gen = torch.Generator().manual_seed(123)
    for t in range(12):
        tok, row = sample_with_support(logits[t : t + 1], generator=gen, **kw)
        assert int(tok) == res.token_ids[t]
        got = support.rows(t, t + 1)
        assert torch.equal(got.ids, row.ids)
        torch.testing.assert_close(got.logq, row.logq, atol=1e-5, rtol=0)


def test_min_keep_rows_are_replayed_exactly_and_all_get_a_gradient(model, weights) -> None:
    """min_keep = 2 at a low temperature and top_p, where most plain nuclei are one token:
    the sampler's records (batched, its own generator) equal the rows the trainer side
    computes from the same weights, every row holds >= 2 ids, and replaying them through
    the model gives every generated position a nonzero gradient."""
    from policies import RecipeConfig, recipe_loss, replay_logprobs_from_hidden

    engine = Qwen3Engine(CFG, max_slots=4)
    batcher = ContinuousBatcher(engine, pool="p")
    batcher.set_weights(weights, version=0)
    kw = dict(temperature=0.05, top_k=16, top_p=0.5)
    prompts = _prompts(4, [3, 6, 9, 4], seed=4)
    for i, p in enumerate(prompts):
        batcher.submit(GenerateRequest(request_id=str(i), prompt_ids=p, max_new_tokens=8, min_keep=2, **kw))
    results = _run(batcher)
    plain_one_token = 0
    for i, p in enumerate(prompts):
        res = results[str(i)]
        support = res.support()
        assert (support.counts() >= 2).all()
        ids = torch.tensor([p + res.token_ids])
        out = model(ids, output_hidden_states=True)
        logits = out.logits[0, len(p) - 1 : -1].detach()
        for t in range(len(res.token_ids)):
            _, row = sample_with_support(logits[t : t + 1], min_keep=2, **kw)
            assert torch.equal(support.rows(t, t + 1).ids, row.ids), (i, t)
            torch.testing.assert_close(support.rows(t, t + 1).logq, row.logq, atol=1e-5, rtol=0)
            _, plain = sample_with_support(logits[t : t + 1], min_keep=1, **kw)
            plain_one_token += plain.nnz == 1
        hidden = out.hidden_states[-1][0, len(p) - 1 : -1].detach().requires_grad_()
        tokens = torch.tensor(res.token_ids)
        rep = replay_logprobs_from_hidden(hidden, model.lm_head.weight.detach(), support, tokens, kw["temperature"])
        cfg = RecipeConfig(**kw)
        loss, _ = recipe_loss(cfg, support, tokens, torch.ones(len(tokens)), replay=rep, num_loss_tokens=len(tokens))
        loss.backward()
        assert (hidden.grad.abs().sum(-1) > 0).all(), i
    assert plain_one_token > 8  # the case the fix is about does occur here


def test_continuous_batching_matches_running_alone(weights) -> None:
    """Requests of different lengths joining mid-flight (and queueing for a slot) give
    the same tokens as each run alone with the same seed."""
    prompts = _prompts(4, [3, 9, 5, 14], seed=3)
    reqs = [
        GenerateRequest(request_id=f"r{i}", prompt_ids=p, max_new_tokens=n, seed=10 + i, top_k=32)
        for i, (p, n) in enumerate(zip(prompts, [10, 4, 8, 6], strict=True))
    ]
    alone = {}
    for req in reqs:
        b = ContinuousBatcher(Qwen3Engine(CFG, max_slots=1), pool="p")
        b.set_weights(weights, 0)
        b.submit(req)
        alone.update(_run(b))

    b = ContinuousBatcher(Qwen3Engine(CFG, max_slots=2), pool="p")
    b.set_weights(weights, 0)
    b.submit(reqs[0])
    got = {}
    for _ in range(3):
        got.update({r.request_id: r for r in b.step()})
    for req in reqs[1:]:  # r1 joins mid-flight, r2 and r3 wait for free slots
        b.submit(req)
    assert b.waiting == 3
    b.step()
    assert b.running == 2 and b.waiting == 2
    got.update(_run(b))
    assert set(got) == set(alone)
    for rid, res in alone.items():
        assert got[rid].token_ids == res.token_ids, rid
        assert torch.equal(got[rid].support_ids, res.support_ids), rid
        torch.testing.assert_close(got[rid].support_logq, res.support_logq, atol=1e-5, rtol=0)


def test_in_flight_update_splits_versions(model, weights) -> None:
    new_master = model_weights(build_model(CFG, seed=9))
    snapshot = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    b = ContinuousBatcher(Qwen3Engine(CFG, max_slots=2), pool="p")
    b.set_weights(snapshot, 3)
    prompt = [5, 6, 7]
    b.submit(GenerateRequest(request_id="x", prompt_ids=prompt, max_new_tokens=8, temperature=0.0))
    for _ in range(3):
        assert b.step() == []
    changed = [n for n in new_master if "mlp" in n]  # a sparse update: only the MLPs change
    for n in changed:
        snapshot[n] = new_master[n].to(torch.bfloat16)
    b.set_weights(snapshot, 4, changed)
    (res,) = _run(b).values()
    assert res.versions == [3, 3, 3, 4, 4, 4, 4, 4]
    # Greedy tokens after the update follow the updated weights (the KV cache of the
    # first tokens was computed with the old ones, so check the step right after).
    engine = Qwen3Engine(CFG, max_slots=1)
    engine.load(snapshot)
    old = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    mixed = Qwen3Engine(CFG, max_slots=1)
    mixed.load(old)
    mixed.prefill([0], [prompt + res.token_ids[:2]])
    mixed.load(snapshot, changed)
    assert int(mixed.decode([0], [res.token_ids[2]]).argmax()) == res.token_ids[3]


def test_stop_tokens_min_version_and_bad_input(weights) -> None:
    b = ContinuousBatcher(Qwen3Engine(CFG, max_slots=2, max_len=16), pool="p")
    b.set_weights(weights, 0)
    # Greedy: learn the first token, then ask again with it as a stop token.
    b.submit(GenerateRequest(request_id="g", prompt_ids=[1, 2], max_new_tokens=3, temperature=0.0))
    first = _run(b)["g"].token_ids[0]
    b.submit(
        GenerateRequest(request_id="s", prompt_ids=[1, 2], max_new_tokens=3, temperature=0.0, stop_token_ids=[first])
    )
    res = _run(b)["s"]
    assert res.token_ids == [first] and res.finish_reason == "stop"
    # Context full: 14-token prompt in a 16-token slot leaves room for two tokens.
    b.submit(GenerateRequest(request_id="c", prompt_ids=[3] * 14, max_new_tokens=10))
    res = _run(b)["c"]
    assert len(res.token_ids) == 2 and res.finish_reason == "length"
    # min_version: not admitted until the weights catch up.
    b.submit(GenerateRequest(request_id="m", prompt_ids=[1], max_new_tokens=2, min_version=1))
    assert not b.has_work() and b.waiting == 1
    b.set_weights(weights, 1)
    assert _run(b)["m"].versions == [1, 1]

    with pytest.raises(ValueError, match="prompt_ids\\[1\\] = 999"):
        b.submit(GenerateRequest(request_id="v", prompt_ids=[1, 999], max_new_tokens=1))
    with pytest.raises(ValueError, match="context is 16"):
        b.submit(GenerateRequest(request_id="l", prompt_ids=[1] * 16, max_new_tokens=1))
    b.submit(GenerateRequest(request_id="d", prompt_ids=[1], max_new_tokens=5))
    with pytest.raises(ValueError, match="already in flight"):
        b.submit(GenerateRequest(request_id="d", prompt_ids=[1], max_new_tokens=5))
    b.step()
    aborted = b.abort("d")
    assert aborted is not None and aborted.finish_reason == "abort" and len(aborted.token_ids) == 1
    assert b.running == 0 and b.abort("d") is None


def test_missing_weight_is_named(weights) -> None:
    engine = Qwen3Engine(CFG, max_slots=1)
    partial = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        engine.load(partial)
    with pytest.raises(RuntimeError, match="no weights"):
        engine.prefill([0], [[1]])


async def _serve(backend, weights, client, n: int) -> None:
    """Run ``backend`` with ``weights`` until ``client(0..n-1)``, started together, are done."""
    from orchestrator.weightsync import wire_snapshot

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(backend.run)
            await backend.update_weights(wire_snapshot(weights, "bf16"), 0)
            async with trio.open_nursery() as clients:
                for i in range(n):
                    clients.start_soon(client, i)
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("window", [0.05, 0.0])
async def test_requests_arriving_one_by_one_share_a_prefill(weights, window) -> None:
    """With an admission window, requests that trickle in (2 ms apart) are prefilled together;
    without one, the idle loop prefills the first one alone."""
    from actors.sampler import TorchBackend

    backend = TorchBackend(CFG, pool="p", max_batch=16, batch_window_s=window)
    results = []

    async def one(i: int) -> None:
        await trio.sleep(0.002 * i)
        req = GenerateRequest(request_id=f"r{i}", prompt_ids=[1, 2, 3 + i], max_new_tokens=1)
        results.append(await backend.generate(req))

    await _serve(backend, weights, one, 8)
    assert sorted(r.request_id for r in results) == [f"r{i}" for i in range(8)]
    batches = backend.counters()["prefill_batches"]
    if window:
        assert batches == 1
    else:
        assert batches > 1


@pytest.mark.parametrize("returning", [3, 2])
async def test_admission_window_closes_when_the_answered_sessions_are_back(weights, returning) -> None:
    """Sessions answered together whose next turns all arrive are admitted at once, without
    the quiet gap (nothing else was expected); when one of them does not come back, the
    window applies as before (at least ``batch_window_s`` of quiet)."""
    from actors.sampler import TorchBackend

    window = 1.0  # long: on a loaded machine a turn's own compute must stay far below it
    backend = TorchBackend(CFG, pool="p", max_batch=8, batch_window_s=window)
    waited: list[float] = []

    async def session(i: int) -> None:
        prompt = [1, 2, 3 + i]
        for turn in range(2 if i < returning else 1):
            req = GenerateRequest(request_id=f"s{i}t{turn}", prompt_ids=prompt, max_new_tokens=2, session_id=f"s{i}")
            t0 = trio.current_time()
            res = await backend.generate(req)
            if turn:
                waited.append(trio.current_time() - t0)
            prompt = prompt + res.token_ids + [5, 6]

    await _serve(backend, weights, session, 3)
    assert len(waited) == returning
    if returning == 3:
        assert max(waited) < window / 2, waited
    else:
        assert min(waited) >= window, waited
    assert backend.counters()["prefix_hits"] == returning


@pytest.mark.parametrize("slots", [[1, 2, 3], [3, 0, 2]])
def test_extend_and_in_step_decode_match_hf(model, weights, slots) -> None:
    """extend over a run of slots (cache read as a view) or scattered ones (rows gathered),
    with different cached lengths and chunk sizes; then decode of rows at one position (no
    mask) and at different ones: all equal to transformers' logits."""
    engine = Qwen3Engine(CFG, max_slots=4)
    engine.load(weights)
    prompts = _prompts(3, [7, 3, 5])
    chunks = _prompts(3, [2, 6, 4], seed=2)  # every row ends at position 9
    cont = _prompts(3, [3, 3, 3], seed=3)
    with torch.no_grad():
        ref = [model(torch.tensor([p + c + d])).logits[0] for p, c, d in zip(prompts, chunks, cont, strict=True)]
    engine.prefill(slots, prompts)
    logits = engine.extend(slots, chunks)
    for row in range(3):
        torch.testing.assert_close(logits[row], ref[row][8], atol=1e-4, rtol=0)
    for step in range(3):
        step_logits = engine.decode(slots, [d[step] for d in cont])
        for row in range(3):
            torch.testing.assert_close(step_logits[row], ref[row][9 + step], atol=1e-4, rtol=0)
    engine.truncate(slots[0], 5)  # rows at different positions again: the masked decode
    with torch.no_grad():
        ref0 = model(torch.tensor([(prompts[0] + chunks[0])[:5] + [9]])).logits[0, -1]
    torch.testing.assert_close(engine.decode(slots, [9, 1, 2])[0], ref0, atol=1e-4, rtol=0)
