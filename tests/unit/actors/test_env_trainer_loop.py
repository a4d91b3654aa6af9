"""One turn of the RL loop with every real actor: sampler → env → trainer → weights → sampler."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from actors.env import EnvActor, make_task_specs
from actors.models import default_model_config
from actors.sampler import SamplerActor
from actors.tokenizer import VOCAB_SIZE
from actors.trainer import StepResult, TrainerActor, TrainerConfig
from actors.types import MissingTrajectories, SamplingParams, Trajectory, TrajectoryRef
from orchestrator.runtime import open_mesh

ENV = {"OMP_NUM_THREADS": "1"}


def _valid(t: Trajectory, version: int) -> None:
    assert not t.failed, t.error
    assert t.pool == "cpu-bf16" and t.versions.tolist() == [version] * t.num_generated
    gen = t.tokens[t.loss_mask].tolist()
    for i, y in enumerate(gen):
        assert y in t.support_ids[t.support_offsets[i] : t.support_offsets[i + 1]].tolist()
    assert t.turns == t.num_generated  # one token per guess


SAMPLING = SamplingParams(temperature=1.0, top_k=64, top_p=0.97)


@asynccontextmanager
async def _loop(env_procs: int) -> AsyncIterator[tuple[Any, Any, Any]]:
    """A trainer, a sampler on its first keyframe and `env_procs` env actors."""
    model = default_model_config(VOCAB_SIZE)
    async with open_mesh(TrainerActor, TrainerConfig(model=model), procs=1, name="trainer", env=ENV) as trainer:
        keyframe = await trainer[0].keyframe.call_one("bf16")
        async with (
            open_mesh(
                SamplerActor, "cpu-bf16", "bf16", model, procs=1, name="sampler", env=ENV, initial_weights=keyframe
            ) as sampler,
            open_mesh(EnvActor, procs=env_procs, name="env", env=ENV) as env,
        ):
            yield trainer, sampler, env


async def test_sampler_env_trainer_round_trip() -> None:
    with trio.fail_after(60):
        async with _loop(env_procs=1) as (trainer, sampler, env):
            specs = make_task_specs("guess_number", 2, 4, seed=7)
            trajs: list[Trajectory] = []

            async def play(spec: object) -> None:
                trajs.append(await env[0].run_episode.call_one(sampler[0], spec, SAMPLING, 0))

            async with trio.open_nursery() as nursery:
                for spec in specs:
                    nursery.start_soon(play, spec)
            for t in trajs:
                _valid(t, 0)
            result = await trainer[0].train_step.call_one(trajs)
            assert result.applied and result.version == 1 and result.tokens == sum(t.num_generated for t in trajs)
            # the sampler's log q came from bf16 weights, the trainer's p from fp32
            assert 0 <= result.overall.mismatch_kl < 0.05

            have = await sampler[0].have_version.call_one()
            update = await trainer[0].updates_for.call_one("sampler0", have, "bf16")
            assert await sampler[0].apply_weights.call_one(update) == 1
            await trainer[0].acks.call_one("bf16", {"sampler0": 1})
            again = await env[0].run_episode.call_one(sampler[0], specs[0], SAMPLING, 1)
            _valid(again, 1)


async def test_held_trajectories_go_from_the_env_actor_to_the_trainer() -> None:
    """`hold`: the env actor answers refs, the trainer fetches the tensors itself, and a
    holder that died makes the step train nothing and name the missing keys."""
    with trio.fail_after(90):
        async with _loop(env_procs=2) as (trainer, sampler, env):
            specs = make_task_specs("guess_number", 2, 2, seed=3)
            refs: list[TrajectoryRef] = []

            async def play(i: int, spec: object) -> None:
                ref = await env[i % 2].run_episode.call_one(sampler[0], spec, SAMPLING, 0, True)
                ref.holder = i % 2
                refs.append(ref)

            async with trio.open_nursery() as nursery:
                for i, spec in enumerate(specs):
                    nursery.start_soon(play, i, spec)
            assert all(isinstance(r, TrajectoryRef) and r.key and not r.failed for r in refs)
            assert {r.holder for r in refs} == {0, 1}
            held = [await env[i].stats.call_one() for i in range(2)]
            assert sum(s["held"] for s in held) == 4 and all(s["held_bytes"] > 0 for s in held)

            result = await trainer[0].train_step.call_one(refs, env)
            assert isinstance(result, StepResult) and result.applied and result.version == 1
            assert result.tokens == sum(r.num_generated for r in refs)
            # What was fetched is what was played: each holder served its own refs once.
            stats = [await env[i].stats.call_one() for i in range(2)]
            assert [s["held_fetched"] for s in stats] == [sum(r.holder == i for r in refs) for i in range(2)]
            assert await env[0].release_held.call_one([r.key for r in refs if r.holder == 0]) == 2
            assert (await env[0].stats.call_one())["held"] == 0

            # Holder 1 dies: its refs are missing and nothing is trained.
            os.kill(env.pids[1], signal.SIGKILL)
            while 1 not in env.dead_ranks:
                await trio.sleep(0.05)
            lost = await trainer[0].train_step.call_one(refs, env)
            assert isinstance(lost, MissingTrajectories)
            assert sorted(lost.keys) == sorted(r.key for r in refs)  # holder 0 released its own
            assert await trainer[0].version.call_one() == 1
