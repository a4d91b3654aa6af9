"""EnvActor in a real mesh against a scripted sampler actor (real processes, real ZeroMQ)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from actors.env import EnvActor, EnvConfig, make_task_specs
from actors.tokenizer import default_chat_tokens
from actors.types import SamplingParams, TaskSpec, Trajectory
from orchestrator.runtime import Mesh, open_mesh
from tests.unit.actors.env_actors import ScriptedSampler

HELPERS = "tests.unit.actors.env_actors"
ENV = {"OMP_NUM_THREADS": "1"}
SAMPLING = SamplingParams(temperature=1.0, top_k=64, top_p=0.97, max_new_tokens=8)


@pytest.fixture
async def env_mesh() -> AsyncIterator[Mesh[EnvActor]]:
    cfg = EnvConfig(step_timeout_s=1.0, task_modules=[HELPERS])
    async with open_mesh(EnvActor, cfg, procs=1, name="env", env=ENV) as mesh:
        yield mesh


def _check_layout(t: Trajectory) -> None:
    """The generated tokens are exactly the masked-in ones, each inside its support row."""
    gen = t.tokens[t.loss_mask]
    assert gen.numel() == t.versions.numel() == t.support_offsets.numel() - 1
    for i, y in enumerate(gen.tolist()):
        row = t.support_ids[t.support_offsets[i]:t.support_offsets[i + 1]].tolist()
        assert y in row
    assert t.loss_mask.numel() == 0 or not bool(t.loss_mask[0])


async def test_guess_number_scripted_optimal_always_wins_and_masks_observations(
        env_mesh: Mesh[EnvActor]) -> None:
    chat = default_chat_tokens()
    async with open_mesh(ScriptedSampler, "binary", procs=1, name="sampler", env=ENV) as sm:
        trajs: list[Trajectory] = [None] * 15  # type: ignore[list-item]

        async def play(secret: int) -> None:
            spec = TaskSpec(task="guess_number", prompt_id=f"s{secret}", group_id="g",
                            params={"secret": secret})
            trajs[secret] = await env_mesh[0].run_episode.call_one(sm[0], spec, SAMPLING, 2)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for secret in range(15):
                    nursery.start_soon(play, secret)
        requests = await sm[0].seen.call_one()

    observation_words = {"higher", "lower", "invalid"}
    for secret, t in enumerate(trajs):
        assert not t.failed and t.reward == 1.0 and 1 <= t.turns <= 4, (secret, t.error)
        assert t.pool == "scripted" and t.versions.tolist() == [3] * t.turns
        _check_layout(t)
        # the last generated token is the secret; every generated token is one guess
        assert t.tokens[t.loss_mask].tolist()[-1] == chat.int_id(secret)
        # what the model did not generate: the prompt, closing <|end|>s and observations
        context = chat.decode(t.tokens[~t.loss_mask].tolist()).split()
        assert context[:8] == "guess the number from 0 to 14 in".split()
        assert sum(w in observation_words for w in context) == t.turns - 1
        masked_in = set(chat.decode(t.tokens[t.loss_mask].tolist()).split())
        assert not masked_in & observation_words
    # the env's per-turn limit (1 token), stop ids and min_version reach the sampler
    assert {r.max_new_tokens for r in requests} == {1}
    assert {r.min_version for r in requests} == {2}
    assert all(r.stop_token_ids == chat.stop_ids for r in requests)
    # each turn's prompt is the previous prompt extended (never re-tokenised)
    by_episode: dict[str, list[list[int]]] = {}
    for r in requests:
        by_episode.setdefault(r.request_id.rsplit("/", 1)[0], []).append(r.prompt_ids)
    for prompts in by_episode.values():
        for a, b in zip(prompts, prompts[1:], strict=False):
            assert b[:len(a)] == a and len(b) > len(a)


async def test_arithmetic_reward_and_stop_token(env_mesh: Mesh[EnvActor]) -> None:
    chat = default_chat_tokens()
    async with open_mesh(ScriptedSampler, "sum", procs=1, name="sampler", env=ENV) as sm:
        with trio.fail_after(20):
            for spec in make_task_specs("arithmetic", 4, 1, params={"max_new_tokens": 2}):
                t = await env_mesh[0].run_episode.call_one(sm[0], spec, SAMPLING, 0)
                assert not t.failed and t.reward == 1.0 and t.turns == 1
                # the reply stopped on <|end|>: it is generated (trained on), nothing appended
                assert t.tokens[-1] == chat.end_id and bool(t.loss_mask[-1])
                _check_layout(t)
    async with open_mesh(ScriptedSampler, "words", procs=1, name="sampler", env=ENV) as sm:
        with trio.fail_after(20):
            spec = make_task_specs("arithmetic", 1, 1)[0]
            t = await env_mesh[0].run_episode.call_one(sm, spec, SAMPLING, 0)   # a mesh handle
            assert not t.failed and t.reward == 0.0


async def test_token_observations_multi_turn(env_mesh: Mesh[EnvActor]) -> None:
    chat = default_chat_tokens()
    async with open_mesh(ScriptedSampler, "words", procs=1, name="sampler", env=ENV) as sm:
        with trio.fail_after(20):
            spec = TaskSpec(task="test_tokens", prompt_id="p", group_id="g")
            t = await env_mesh[0].run_episode.call_one(sm[0], spec, SAMPLING, 0)
    assert not t.failed and t.turns == 2
    # reply "the" (max_new_tokens from sampling: 8, but the script says one word), then
    # <|end|>, then the token observation as a user turn, then the second reply
    the = chat.encode("the")[0]
    tail = [the, chat.end_id, chat.user_id, chat.int_id(9), chat.end_id, chat.assistant_id, the]
    assert t.tokens[-len(tail):].tolist() == tail
    assert t.loss_mask[-len(tail):].tolist() == [True, False, False, False, False, False, True]


async def test_environment_errors_fail_the_episode_and_the_actor_keeps_serving(
        env_mesh: Mesh[EnvActor]) -> None:
    async with open_mesh(ScriptedSampler, "words", procs=1, name="sampler", env=ENV) as sm:
        with trio.fail_after(30):
            cases = {"test_explode": "boom in the user environment",
                     "test_hang_async": "timed out", "test_hang_blocking": "timed out",
                     "test_garbage": "StepOutcome", "no_such_task": "unknown task"}
            for task, text in cases.items():
                spec = TaskSpec(task=task, prompt_id="p", group_id="g")
                t = await env_mesh[0].run_episode.call_one(sm[0], spec, SAMPLING, 0)
                assert t.failed and t.reward == 0.0 and text in (t.error or ""), (task, t.error)
                _check_layout(t)
            # the explode env got one full turn in before raising: its tokens are kept
            boom = await env_mesh[0].run_episode.call_one(
                sm[0], TaskSpec(task="test_explode", prompt_id="p", group_id="g"), SAMPLING, 0)
            assert boom.turns == 2 and boom.num_generated == 2
            # still serving: a normal episode right after
            ok = await env_mesh[0].run_episode.call_one(
                sm[0], make_task_specs("guess_number", 1, 1)[0], SAMPLING, 0)
            assert not ok.failed
            stats = await env_mesh[0].stats.call_one()
    assert stats == {"episodes": 7, "failed": 6, "running": 0}


async def test_dead_sampler_is_a_failed_trajectory() -> None:
    cfg = EnvConfig(generate_timeout_s=2.0)
    async with open_mesh(ScriptedSampler, "binary", procs=1, name="sampler", env=ENV) as sm:
        handle = sm[0]
    # the sampler mesh is closed, its process gone: the episode fails (ActorDied or the
    # generate timeout, whichever comes first) and the env actor keeps serving
    async with open_mesh(EnvActor, cfg, procs=1, name="env", env=ENV) as env:
        with trio.fail_after(20):
            t = await env[0].run_episode.call_one(
                handle, make_task_specs("guess_number", 1, 1)[0], SAMPLING, 0)
            assert t.failed and t.turns == 0 and t.error
            assert t.tokens.numel() > 0 and not bool(t.loss_mask.any())
            assert await env[0].stats.call_one() == {"episodes": 1, "failed": 1, "running": 0}


async def test_episode_spans(tmp_path: Path) -> None:
    trace = tmp_path / "traces.jsonl"
    env = {**ENV, "FLOTILLA_TRACE_FILE": str(trace)}
    async with open_mesh(ScriptedSampler, "binary", procs=1, name="sampler", env=env) as sm, \
            open_mesh(EnvActor, procs=1, name="env", env=env) as em:
        with trio.fail_after(20):
            spec = TaskSpec(task="guess_number", prompt_id="p", group_id="g", params={"secret": 0})
            t = await em[0].run_episode.call_one(sm[0], spec, SAMPLING, 0)
    spans = [json.loads(line) for line in trace.read_text().splitlines()]
    rollout = [s for s in spans if s["name"] == "rollout"]
    assert len(rollout) == 1
    r = rollout[0]
    assert r["attributes"]["task"] == "guess_number" and r["attributes"]["pool"] == "scripted"
    assert r["attributes"]["reward"] == 1.0 and r["attributes"]["turn"] == t.turns
    children = [s for s in spans if s["parent_span_id"] == r["span_id"]]
    gens = [s for s in children if s["name"] == "generate"]
    steps = [s for s in children if s["name"] == "env.step"]
    assert len(gens) == t.turns and len(steps) == t.turns + 1   # + the reset
    assert sorted(s["attributes"]["turn"] for s in gens) == list(range(t.turns))
    assert all(s["trace_id"] == r["trace_id"] for s in children)
    # the sampler's spans are children of the env actor's generate spans (other process)
    remote = [s for s in spans if s["name"] == "scripted.generate"]
    assert sorted(s["parent_span_id"] for s in remote) == sorted(g["span_id"] for g in gens)
    assert all(s["pid"] != r["pid"] for s in remote)
