"""The gateway's HTTP surface in-process: OpenAI-style errors, routing by URL or API key,
streaming through the official client, plain completions, and the reward channel."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch
import trio

from actors.chat import WordChatFormat
from actors.gateway import Gateway, SessionLimits
from actors.sampler import GenerateRequest, GenerateResult
from actors.types import SamplingParams, TaskSpec

TASK = TaskSpec(task="t", prompt_id="p", group_id="g")


class Replies:
    """A generate function answering with scripted word replies (one support row per token)."""

    def __init__(self, fmt: WordChatFormat, texts: list[str]) -> None:
        self.fmt, self.texts, self.requests = fmt, texts, []

    async def __call__(self, req: GenerateRequest) -> GenerateResult:
        ids = self.fmt.encode(self.texts[len(self.requests) % len(self.texts)]) + [self.fmt.chat.end_id]
        ids = ids[: req.max_new_tokens]
        self.requests.append(req)
        n = len(ids)
        return GenerateResult(
            request_id=req.request_id,
            token_ids=ids,
            support_ids=torch.tensor(ids, dtype=torch.int32),
            support_offsets=torch.arange(n + 1, dtype=torch.int32),
            support_logq=torch.zeros(n),
            versions=[2] * n,
            finish_reason="stop" if ids[-1] == self.fmt.chat.end_id else "length",
            pool="fake",
            prompt_tokens=len(req.prompt_ids),
            seconds=0.0,
        )


@pytest.fixture
async def served(nursery):
    fmt = WordChatFormat()
    gw = Gateway(fmt, model_name="tiny")
    await nursery.start(gw.serve)
    gen = Replies(fmt, ["3", "5", "correct"])
    session = gw.open_session(TASK, gen, SessionLimits(SamplingParams(), 48, 4), 0)
    async with httpx.AsyncClient(base_url=gw.address, timeout=10) as client:
        yield gw, session, gen, client


async def _err(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    if param is not None:
        assert body["param"] == param, body
    return body


async def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(served) -> None:
    gw, s, gen, c = served
    url = f"/s/{s.id}/v1/chat/completions"
    ok = {"model": "tiny", "messages": [{"role": "user", "content": "guess"}]}
    await _err(await c.post(url, content=b"{not json"), 400)
    await _err(await c.post(url, json=[1, 2]), 400)
    await _err(await c.post(url, json={"model": "tiny"}), 400, "messages")
    await _err(await c.post(url, json={**ok, "messages": []}), 400, "messages")
    await _err(await c.post(url, json={**ok, "messages": [{"role": "robot", "content": "x"}]}), 400, "messages.0.role")
    await _err(await c.post(url, json={**ok, "n": 2}), 400, "n")
    await _err(await c.post(url, json={**ok, "temperature": -1}), 400, "temperature")
    await _err(await c.post(url, json={**ok, "max_tokens": 0}), 400, "max_tokens")
    await _err(await c.post(url, json={**ok, "tools": [{"type": "web"}]}), 400)
    await _err(
        await c.post(url, json={**ok, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        400,
        "messages.0.content.0.type",
    )
    # The word format has no tool turns: a clear 400, not a crash.
    await _err(await c.post(url, json={**ok, "messages": [{"role": "tool", "content": "5"}]}), 400, "messages")
    await _err(await c.post(url, json={**ok, "messages": [{"role": "user", "content": "x " * 60}]}), 400)
    await _err(await c.post("/s/nope/v1/chat/completions", json=ok), 404)
    await _err(await c.post("/v1/chat/completions", json=ok), 401)
    await _err(await c.post("/v1/chat/completions", json=ok, headers={"Authorization": "Bearer nope"}), 401)
    await _err(await c.get("/v1/nothing"), 404)
    await _err(await c.get(url), 405)
    await _err(await c.post(f"/s/{s.id}/reward", json={"reward": "lots"}), 400, "reward")
    assert gen.requests == []  # nothing malformed reached the sampler
    # ... and the server still answers, by URL and by API key.
    r = await c.post(url, json=ok)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "3"
    r = await c.post(
        "/v1/chat/completions",
        headers={"Authorization": f"Bearer {s.id}"},
        json={
            **ok,
            "messages": ok["messages"] + [{"role": "assistant", "content": "3"}, {"role": "user", "content": "higher"}],
        },
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "5"
    assert len(s.segments) == 1
    models = (await c.get(f"/s/{s.id}/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    # A closed session is gone.
    gw.close_session(s)
    await _err(await c.post(url, json=ok), 404)


# openai's AsyncStream stops at "[DONE]" without exhausting httpx's byte generators, which
# trio reports when they are collected; a property of the client library, not of the gateway.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_openai_client_streams_and_history_is_extended_not_retokenised(served) -> None:
    openai = pytest.importorskip("openai")
    gw, s, gen, c = served
    client = openai.AsyncOpenAI(base_url=f"{gw.address}/s/{s.id}/v1", api_key="unused", max_retries=0, http_client=c)
    messages = [{"role": "user", "content": "guess the number"}]
    text = ""
    async with await client.chat.completions.create(model="tiny", messages=messages, stream=True) as stream:
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
    assert text == "3"
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "higher"}]
    r = await client.chat.completions.create(model="tiny", messages=messages, stop=["never"])
    assert r.choices[0].message.content == "5" and r.usage.completion_tokens == 2
    chat = WordChatFormat().chat
    # Request 2's prompt = request 1's prompt + its reply + only the new user turn's ids.
    first, second = gen.requests[0].prompt_ids, gen.requests[1].prompt_ids
    assert second == first + [chat.int_id(3), chat.end_id] + chat.user_turn("higher")
    traj = s.trajectory(1.0)
    assert traj.tokens.tolist() == second + [chat.int_id(5), chat.end_id]
    assert traj.tokens[traj.loss_mask].tolist() == [chat.int_id(3), chat.end_id, chat.int_id(5), chat.end_id]
    assert traj.versions.tolist() == [2, 2, 2, 2] and all(r.session_id == s.id for r in gen.requests)
    # The recipe's sampling, min_keep included (a one-token support would get no gradient).
    recipe = SamplingParams()
    assert all(
        (r.temperature, r.top_k, r.top_p, r.min_keep)
        == (recipe.temperature, recipe.top_k, recipe.top_p, recipe.min_keep)
        for r in gen.requests
    )
    assert recipe.min_keep == 2


async def test_stop_strings_cut_the_reply_and_reward_posts_land(served) -> None:
    _, s, gen, c = served
    gen.texts = ["3 and 5 guess"]
    url = f"/s/{s.id}/v1/chat/completions"
    r = await c.post(url, json={"messages": [{"role": "user", "content": "guess"}], "stop": "5", "max_tokens": 4})
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "3 and " and body["choices"][0]["finish_reason"] == "stop"
    traj = s.trajectory(0.0)
    # Kept: the generated ids up to and including the one that completed the stop string.
    assert traj.num_generated == 3
    assert (await c.post(f"/s/{s.id}/reward", json={"reward": 0.25})).status_code == 200
    assert s.reward == 0.25


async def test_plain_completions_extend_the_text(served) -> None:
    _, s, gen, c = served
    url = f"/s/{s.id}/v1/completions"
    r = (await c.post(url, json={"prompt": "guess the", "max_tokens": 1})).json()
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == "3"
    r = (await c.post(url, json={"prompt": "guess the 3 number", "max_tokens": 1})).json()
    assert len(s.segments) == 1
    fmt = WordChatFormat()
    assert gen.requests[1].prompt_ids == fmt.encode("guess the") + [fmt.chat.int_id(3)] + fmt.encode("number")
    r = await c.post(url, json={"prompt": "something else", "max_tokens": 1})
    assert r.status_code == 200 and len(s.segments) == 2
    assert math.isclose(s.trajectory(1.0).reward, 1.0)
    await _err(await c.post(url, json={"prompt": "x", "stream": True}), 400, "stream")
    await trio.lowlevel.checkpoint()


async def test_requests_of_one_session_are_served_one_at_a_time(served) -> None:
    """Two requests in flight on one session: the second waits on the session's lock and
    reaches the sampler only after the first is answered; both are answered."""
    _, s, gen, c = served
    inner, in_flight, most = gen.__call__, [0], [0]
    entered, release = trio.Event(), trio.Event()

    async def slow(req):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        if not entered.is_set():
            entered.set()
            await release.wait()  # the first request holds the sampler until released
        try:
            return await inner(req)
        finally:
            in_flight[0] -= 1

    s.generate = slow
    url = f"/s/{s.id}/v1/chat/completions"
    answers = []

    async def ask() -> None:
        r = await c.post(url, json={"messages": [{"role": "user", "content": "guess"}], "max_tokens": 2})
        answers.append(r.status_code)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            nursery.start_soon(ask)
            await entered.wait()
            while s._lock._lock.statistics().tasks_waiting < 1:  # the second is queued
                await trio.sleep(0.01)
            assert most[0] == 1 and not answers
            release.set()
    assert answers == [200, 200] and most[0] == 1 and len(gen.requests) == 2


async def test_logprobs_come_from_the_sampler_and_unsupported_asks_are_clear_400s(served) -> None:
    _, s, _, c = served
    url = f"/s/{s.id}/v1/chat/completions"
    ok = {"messages": [{"role": "user", "content": "guess"}]}
    await _err(await c.post(url, json={**ok, "top_logprobs": 2}), 400, "top_logprobs")
    await _err(await c.post(f"/s/{s.id}/v1/completions", json={"prompt": "guess", "logprobs": 2}), 400, "logprobs")
    body = (await c.post(url, json={**ok, "logprobs": True, "top_logprobs": 1})).json()
    entries = body["choices"][0]["logprobs"]["content"]
    assert len(entries) == body["usage"]["completion_tokens"] == 2  # "3" and the end marker
    # The scripted sampler's support is the sampled token alone: log q = 0, and it is the top one.
    assert [e["logprob"] for e in entries] == [0.0, 0.0] and entries[0]["token"] == "3"
    assert entries[0]["top_logprobs"] == [{"token": "3", "logprob": 0.0, "bytes": [51]}]
    assert (await c.post(url, json=ok)).json()["choices"][0]["logprobs"] is None


async def test_a_stream_has_a_usage_chunk_only_when_asked(served) -> None:
    _, s, gen, c = served
    url = f"/s/{s.id}/v1/chat/completions"
    ok = {"messages": [{"role": "user", "content": "guess"}], "stream": True}

    async def chunks(body: dict) -> list[dict]:
        r = await c.post(url, json=body)
        lines = [x.removeprefix("data: ") for x in r.text.split("\n\n") if x.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(x) for x in lines[:-1]]

    plain = await chunks(ok)
    assert all(ch["choices"] for ch in plain) and all("usage" not in ch for ch in plain)
    assert plain[0]["choices"][0]["delta"]["role"] == "assistant" and plain[-1]["choices"][0]["finish_reason"] == "stop"
    gen.requests.clear()
    s.segments.clear()
    with_usage = await chunks({**ok, "stream_options": {"include_usage": True}})
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["completion_tokens"] == 2
    assert all(ch["usage"] is None for ch in with_usage[:-1])
