"""EnvActor in a real mesh against a scripted sampler actor (real processes, real ZeroMQ).

Meshes are few and shared within a test: each process start costs seconds.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import trio

from actors.env import EnvActor, EnvConfig, make_task_specs
from actors.tokenizer import default_chat_tokens
from actors.types import SamplingParams, TaskSpec, Trajectory
from orchestrator.runtime import open_mesh
from tests.unit.actors.env_actors import ScriptedSampler

HELPERS = "tests.unit.actors.env_actors"
ENV = {"OMP_NUM_THREADS": "1"}
SAMPLING = SamplingParams(temperature=1.0, top_k=64, top_p=0.97, max_new_tokens=8)


def _check_layout(t: Trajectory) -> None:
    """The generated tokens are exactly the masked-in ones, each inside its support row."""
    gen = t.tokens[t.loss_mask]
    assert gen.numel() == t.versions.numel() == t.support_offsets.numel() - 1
    for i, y in enumerate(gen.tolist()):
        row = t.support_ids[t.support_offsets[i] : t.support_offsets[i + 1]].tolist()
        assert y in row
    assert t.loss_mask.numel() == 0 or not bool(t.loss_mask[0])


async def test_guess_number_scripted_optimal_always_wins_masks_observations_and_traces(tmp_path: Path) -> None:
    chat = default_chat_tokens()
    trace = tmp_path / "traces.jsonl"
    env = {**ENV, "FLOTILLA_TRACE_FILE": str(trace)}
    trajs: list[Trajectory] = [None] * 15  # type: ignore[list-item]
    async with (
        open_mesh(ScriptedSampler, procs=1, name="sampler", env=env) as sm,
        open_mesh(EnvActor, procs=1, name="env", env=env) as em,
    ):

        async def play(secret: int) -> None:
            spec = TaskSpec(task="guess_number", prompt_id=f"s{secret}", group_id="g", params={"secret": secret})
            trajs[secret] = await em[0].run_episode.call_one(sm[0], spec, SAMPLING, 2)

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
        assert context[:8] == ["guess", "the", "number", "from", "0", "to", "14", "in"]
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
        for a, b in itertools.pairwise(prompts):
            assert b[: len(a)] == a and len(b) > len(a)

    # spans: one "rollout" per episode, "generate" and "env.step" children, and the
    # sampler's own span a child of the env actor's generate span (another process)
    spans = [json.loads(line) for line in trace.read_text().splitlines()]
    rollouts = [s for s in spans if s["name"] == "rollout"]
    assert len(rollouts) == 15
    r = next(s for s in rollouts if s["attributes"]["prompt_id"] == "s0")
    t = trajs[0]
    assert r["attributes"]["task"] == "guess_number" and r["attributes"]["pool"] == "scripted"
    assert r["attributes"]["reward"] == 1.0 and r["attributes"]["turn"] == t.turns
    children = [s for s in spans if s["parent_span_id"] == r["span_id"]]
    gens = [s for s in children if s["name"] == "generate"]
    steps = [s for s in children if s["name"] == "env.step"]
    assert len(gens) == t.turns and len(steps) == t.turns + 1  # + the reset
    assert sorted(s["attributes"]["turn"] for s in gens) == list(range(t.turns))
    remote = [
        s for s in spans if s["name"] == "scripted.generate" and s["parent_span_id"] in {g["span_id"] for g in gens}
    ]
    assert len(remote) == t.turns and all(s["pid"] != r["pid"] for s in remote)
    assert all(s["trace_id"] == r["trace_id"] for s in children + remote)


async def test_arithmetic_token_observations_and_failures() -> None:
    chat = default_chat_tokens()
    cfg = EnvConfig(step_timeout_s=1.0, task_modules=[HELPERS])
    async with (
        open_mesh(ScriptedSampler, procs=1, name="sampler", env=ENV) as sm,
        open_mesh(EnvActor, cfg, procs=1, name="env", env=ENV) as em,
    ):
        run = em[0].run_episode
        with trio.fail_after(40):
            # arithmetic: the right sum is rewarded; the reply stopped on <|end|>, which
            # is generated (trained on) and nothing is appended after it
            for spec in make_task_specs("arithmetic", 4, 1, params={"max_new_tokens": 2}):
                t = await run.call_one(sm[0], spec, SAMPLING, 0)
                assert not t.failed and t.reward == 1.0 and t.turns == 1
                assert t.tokens[-1] == chat.end_id and bool(t.loss_mask[-1])
                _check_layout(t)

            # token observations over two turns: <|user|> 9 <|end|> <|assistant|> is context
            t = await run.call_one(sm[0], TaskSpec(task="test_tokens", prompt_id="p", group_id="g"), SAMPLING, 0)
            five = chat.int_id(5)
            tail = [five, chat.end_id, chat.user_id, chat.int_id(9), chat.end_id, chat.assistant_id, five, chat.end_id]
            assert not t.failed and t.turns == 2 and t.reward == 1.0
            assert t.tokens[-len(tail) :].tolist() == tail
            assert t.loss_mask[-len(tail) :].tolist() == [True, True] + [False] * 4 + [True, True]

            # a wrong answer (and a mesh handle: the runtime picks the sampler)
            await sm[0].set_policy.call_one("words")
            t = await run.call_one(sm, make_task_specs("arithmetic", 1, 1)[0], SAMPLING, 0)
            assert not t.failed and t.reward == 0.0

            # environment failures: recorded, reward 0, and the actor keeps serving
            cases = {
                "test_explode": "boom in the user environment",
                "test_hang_async": "timed out",
                "test_hang_blocking": "timed out",
                "test_garbage": "StepOutcome",
                "no_such_task": "unknown task",
            }
            for task, text in cases.items():
                t = await run.call_one(sm[0], TaskSpec(task=task, prompt_id="p", group_id="g"), SAMPLING, 0)
                assert t.failed and t.reward == 0.0 and text in (t.error or ""), (task, t.error)
                _check_layout(t)
                if task == "test_explode":  # one full turn before the raise: tokens kept
                    assert t.turns == 2 and t.num_generated == 2
                    # the environment's own frame and error are in the kept traceback tail
                    assert "in step" in t.error_traceback and "boom in the user" in t.error_traceback
            ok = await run.call_one(sm[0], make_task_specs("guess_number", 1, 1)[0], SAMPLING, 0)
            assert not ok.failed
            st = await em[0].stats.call_one()
            assert {k: st[k] for k in ("episodes", "failed", "running")} == {"episodes": 12, "failed": 5, "running": 0}
            assert st["stuck_calls"] == {"test_hang_blocking": 1} and st["loop_stalls"] == 0


async def test_context_limit_and_dead_sampler() -> None:
    cfg = EnvConfig(max_seq_len=18, generate_timeout_s=2.0)
    async with open_mesh(ScriptedSampler, procs=1, name="gone", env=ENV) as gone:
        dead = gone[0]
    async with (
        open_mesh(ScriptedSampler, procs=1, name="sampler", env=ENV) as sm,
        open_mesh(EnvActor, cfg, procs=1, name="env", env=ENV) as em,
    ):
        run = em[0].run_episode
        with trio.fail_after(30):
            # 14 prompt tokens + 1 guess fit; the next turn (+5 context +1 guess) does not:
            # the episode ends unfinished, without the unseen observation, not failed
            spec = TaskSpec(task="guess_number", prompt_id="p", group_id="g", params={"secret": 0})
            t = await run.call_one(sm[0], spec, SAMPLING, 0)
            assert not t.failed and t.turns == 1 and t.reward == 0.0 and t.tokens.numel() == 15
            # a prompt that leaves no room for one turn is a failure
            spec = TaskSpec(task="guess_number", prompt_id="p", group_id="g", params={"max_new_tokens": 5})
            t = await run.call_one(sm[0], spec, SAMPLING, 0)
            assert t.failed and "max_seq_len=18" in (t.error or "")
            # a sampler whose process is gone: ActorDied or the generate timeout, whichever
            # comes first, fails the episode; the actor keeps serving
            t = await run.call_one(dead, make_task_specs("guess_number", 1, 1)[0], SAMPLING, 0)
            assert t.failed and t.turns == 0 and t.error
            assert t.tokens.numel() > 0 and not bool(t.loss_mask.any())
            st = await em[0].stats.call_one()
            assert {k: st[k] for k in ("episodes", "failed", "running")} == {"episodes": 3, "failed": 2, "running": 0}
