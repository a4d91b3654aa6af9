"""The SGLang backend's response parsing (the backend itself needs a CUDA GPU: untested here)."""

from __future__ import annotations

import math

import pytest
import torch

from actors.sampler import GenerateRequest, parse_sglang_response


def _body(logprob_rows):
    # The shape SGLang documents for return_sampling_mask: one kept-id list and one
    # renormalised log-prob list per generated token.
    return {
        "output_ids": [7, 3],
        "meta_info": {
            "output_token_sampling_mask": [[7, 2], [3]],
            "output_token_sampling_logprobs": logprob_rows,
            "finish_reason": {"type": "stop", "matched": 3},
            "prompt_tokens": 4,
            "weight_version": "5",
        },
    }


def test_parse_sampling_mask_into_csr() -> None:
    req = GenerateRequest(request_id="r", prompt_ids=[1, 2, 3, 4], max_new_tokens=8, stop_token_ids=[3])
    res = parse_sglang_response(req, _body([[math.log(0.75), math.log(0.25)], [0.0]]), pool="h100", seconds=0.1)
    assert res.token_ids == [7, 3] and res.finish_reason == "stop" and res.versions == [5, 5]
    assert res.support_ids.tolist() == [7, 2, 3] and res.support_offsets.tolist() == [0, 2, 3]
    torch.testing.assert_close(res.support_logq.exp(), torch.tensor([0.75, 0.25, 1.0]))
    res.support().token_index(torch.tensor(res.token_ids))


def test_parse_refuses_rows_without_per_id_logq() -> None:
    req = GenerateRequest(request_id="r", prompt_ids=[1], max_new_tokens=8)
    with pytest.raises(ValueError, match="token 0: SGLang gave no log q for each kept id"):
        parse_sglang_response(req, _body([-0.3, 0.0]), pool="h100", seconds=0.1)
    body = _body([[0.0, -1.0], [0.0]])
    body["meta_info"]["output_token_sampling_mask"] = [[1, 2], [3]]
    with pytest.raises(ValueError, match="token 0: sampled id 7 is not in its sampling mask"):
        parse_sglang_response(req, body, pool="h100", seconds=0.1)


# -- Protocol tests against tests/unit/actors/sglang_stub.py ----------------------------------
# The stub answers SGLang's documented endpoints; these tests check the backend's side of the
# protocol (fields, order, versions, aborts, no blocking). They are not a test of SGLang.

import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import trio  # noqa: E402

from actors.sampler._sglang import SGLangBackend  # noqa: E402
from tests.unit.actors.sglang_stub import start_stub  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def stub():
    server, state = start_stub()
    yield f"http://127.0.0.1:{server.server_port}", state
    server.shutdown()
    server.server_close()


def _req(rid: str, n: int = 4, **kw) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=[5, 9, 11], max_new_tokens=n, top_k=3, **kw)


def _snapshot() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}


async def test_protocol_generate_update_with_versions_and_rows_unchanged(stub, tmp_path) -> None:
    url, state = stub
    be = SGLangBackend(pool="h100", model_config={"model_type": "qwen3"}, url=url, weights_dir=str(tmp_path))
    async with trio.open_nursery() as nursery:
        await nursery.start(be.run)
        await be.update_weights(_snapshot(), 1)
        res = await be.generate(_req("a", min_version=1))
        # The rows SGLang returns reach the recipe unchanged (CSR of the stub's kept sets).
        toks = [(25 + i) % 97 for i in range(4)]
        assert res.token_ids == toks and res.versions == [1] * 4 and res.finish_reason == "length"
        assert res.support_ids.tolist() == [(t + j) % 97 for t in toks for j in range(3)]
        assert res.support_offsets.tolist() == [0, 3, 6, 9, 12]
        torch.testing.assert_close(res.support_logq.exp(), torch.tensor([0.6, 0.3, 0.1] * 4))
        await be.update_weights(_snapshot(), 2)
        assert be.version == 2
        nursery.cancel_scope.cancel()
    calls = [c["path"] for c in state.log]
    assert calls == [
        "/continue_generation",  # start-up: clear a pause an earlier owner left
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
        "/generate",
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    upd = [c["body"] for c in state.log if c["path"] == "/update_weights_from_disk"]
    assert [u["weight_version"] for u in upd] == ["1", "2"]
    assert all(u["flush_cache"] for u in upd)  # retract mode: KV recomputed under new weights
    assert state.log[1]["body"] == {"mode": "retract"}
    gen = next(c["body"] for c in state.log if c["path"] == "/generate")
    assert gen["return_sampling_mask"] and gen["rid"] == "a" and gen["sampling_params"]["top_k"] == 3
    # Only the loaded snapshot stays on disk; it holds what the server was told to load.
    kept = sorted(p.name for p in (tmp_path / "h100-0").iterdir())
    assert kept == ["v2"] and (tmp_path / "h100-0" / "v2" / "model.safetensors").is_file()


async def test_protocol_a_server_left_paused_by_a_dead_owner_serves_the_next_one(stub, tmp_path) -> None:
    url, state = stub
    with state.lock:
        state.paused = "retract"  # an earlier sampler died between pause and continue
    be = SGLangBackend(pool="p", model_config={}, url=url, weights_dir=str(tmp_path))
    async with trio.open_nursery() as nursery:
        await nursery.start(be.run)
        assert state.paused is None  # serving again before any update or request
        nursery.cancel_scope.cancel()


async def test_protocol_request_waits_for_min_version_and_refuses_infinite_top_k(stub, tmp_path) -> None:
    url, state = stub
    be = SGLangBackend(pool="p", model_config={}, url=url, weights_dir=str(tmp_path))
    async with trio.open_nursery() as nursery:
        await nursery.start(be.run)
        with pytest.raises(ValueError, match="finite top_k"):
            await be.generate(GenerateRequest(request_id="x", prompt_ids=[1], max_new_tokens=1, top_k=0))
        with pytest.raises(ValueError, match="min_keep=2 with top_p=0.97 is not supported"):
            await be.generate(_req("m", min_keep=2, top_p=0.97))
        with trio.move_on_after(0.3) as waited:  # no weights yet: the request waits, sends nothing
            await be.generate(_req("b", min_version=0))
        assert waited.cancelled_caught and not any(c["path"] == "/generate" for c in state.log)
        nursery.cancel_scope.cancel()


async def test_cancelling_a_generate_does_not_block_the_event_loop_and_aborts_it(tmp_path) -> None:
    server, state = start_stub(token_delay=0.05)  # 200 tokens: ~10 s if nothing aborts it
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        be = SGLangBackend(pool="p", model_config={}, url=url, weights_dir=str(tmp_path))
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await trio.sleep(0.01)
                ticks += 1

        async with trio.open_nursery() as nursery:
            await nursery.start(be.run)
            await be.update_weights(_snapshot(), 0)
            nursery.start_soon(ticker)
            t0 = trio.current_time()
            with trio.move_on_after(0.3):
                await be.generate(_req("long", n=200))
            cancelled_in = trio.current_time() - t0
            with trio.fail_after(2.0):  # the abort reaches the server from the backend's task
                while not any(c["path"] == "/abort_request" for c in state.log):
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert cancelled_in < 0.5, cancelled_in
        assert ticks >= 15, ticks  # the loop kept running while the request was in flight
        assert next(c["body"] for c in state.log if c["path"] == "/abort_request") == {"rid": "long"}
        deadline = time.monotonic() + 2
        while state.running and time.monotonic() < deadline:  # the stub stops generating
            time.sleep(0.01)
        assert not state.running
    finally:
        server.shutdown()
        server.server_close()


async def test_abort_returns_partial_output_with_finish_reason_abort(tmp_path) -> None:
    server, state = start_stub(token_delay=0.02)
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        be = SGLangBackend(pool="p", model_config={}, url=url, weights_dir=str(tmp_path))
        async with trio.open_nursery() as nursery:
            await nursery.start(be.run)
            await be.update_weights(_snapshot(), 0)
            assert not be.abort("nope")
            out = []

            async def gen() -> None:
                out.append(await be.generate(_req("r", n=500)))

            nursery.start_soon(gen)
            while not state.running:
                await trio.sleep(0.01)
            await trio.sleep(0.1)
            assert be.abort("r")
            with trio.fail_after(3):
                while not out:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        res = out[0]
        assert res.finish_reason == "abort" and 0 < len(res.token_ids) < 500
        assert res.support_offsets.numel() == len(res.token_ids) + 1
    finally:
        server.shutdown()
        server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(port: int, **kw) -> dict:
    return {
        "model_path": "/nonexistent/model",
        "module": "tests.unit.actors.sglang_stub",
        "python": sys.executable,
        "port": port,
        "health_timeout_s": 30.0,
        **kw,
    }


async def test_launched_server_is_health_checked_used_and_stopped_with_no_orphan(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    port = _free_port()
    be = SGLangBackend(pool="p", model_config={}, launch=_launch(port), port=port, gpu=3, weights_dir=str(tmp_path))
    async with trio.open_nursery() as nursery:
        with trio.fail_after(30):
            await nursery.start(be.run)  # returns only once GET /health answered
        await be.update_weights(_snapshot(), 0)
        res = await be.generate(_req("g"))
        assert len(res.token_ids) == 4 and res.versions == [0] * 4
        async with httpx.AsyncClient() as c:
            log = (await c.get(f"http://127.0.0.1:{port}/stub_log")).json()
        assert [e["path"] for e in log][-1] == "/generate"
        nursery.cancel_scope.cancel()
    with pytest.raises(httpx.ConnectError):  # the server went with the backend
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


async def test_launched_server_that_dies_fails_start_up_with_its_output(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    port = _free_port()
    launch = _launch(port, args=["--no-such-flag"])
    be = SGLangBackend(pool="p", model_config={}, launch=launch, port=port, weights_dir=str(tmp_path))
    with trio.fail_after(30), pytest.raises(RuntimeError, match="exited before it was healthy") as err:
        await be.run()
    assert "--no-such-flag" in str(err.value) and "sglang_stub" in str(err.value)
    assert os.environ.get("CUDA_VISIBLE_DEVICES") is None  # set for the child only
