"""Environment-library tasks through a real EnvActor process: reasoning-gym items scored by the
dataset's own scorer, an OpenEnv environment over its own client (a real server process),
and verifiers environments (single- and multi-turn) whose rollout runs against the actor's
gateway and whose rubric gives the reward. A scripted sampler actor replies (right and wrong
answers on purpose); the trajectory's loss mask must cover exactly the ids it generated."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from actors.chat import HFChatFormat
from actors.env import (
    EnvActor,
    EnvConfig,
    Environment,
    StepOutcome,
    TaskCheckError,
    check_task,
    register_task,
)
from actors.env.libs import LibraryMissing, require
from actors.types import SamplingParams, TaskSpec
from orchestrator.runtime import open_mesh
from tests.unit.actors.openenv_server import serve_openenv
from tests.unit.gateway._actors import ReplaySampler, tiny_tokenizer_dir

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).parent
END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return tiny_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def fmt(tok_dir) -> HFChatFormat:
    return HFChatFormat.from_dir(tok_dir)


async def _play(
    config: EnvConfig, fmt: HFChatFormat, replies: list[str], tasks: list[TaskSpec], max_new_tokens: int = 32
):
    """Each task's episode in turn against a sampler replying ``replies`` in order."""
    ids = [fmt.encode(r) for r in replies]
    async with (
        open_mesh(EnvActor, config, procs=1, name="env") as env,
        open_mesh(ReplaySampler, ids, fmt.vocab_size, procs=1, name="replay") as sampler,
    ):
        trajs = [
            await env[0].run_episode.call_one(sampler[0], t, SamplingParams(max_new_tokens=max_new_tokens))
            for t in tasks
        ]
        seen = await sampler[0].requests.call_one()
    return trajs, ids, seen


def _task(name: str, seed: int, params: dict) -> TaskSpec:
    return TaskSpec(task=name, prompt_id=f"p{seed}", group_id=f"g{seed}", seed=seed, params=params)


# ----------------------------------------------------------------------------- reasoning-gym
async def test_reasoning_gym_items_are_scored_by_the_datasets_scorer(tok_dir, fmt) -> None:
    rg = pytest.importorskip("reasoning_gym")
    params = {"min_terms": 2, "max_terms": 2, "max_digits": 2}
    seeds = [11, 12, 13]
    entries = [rg.create_dataset("basic_arithmetic", seed=s, size=1, **params)[0] for s in seeds]
    right, wrong = entries[0]["answer"], str(int(entries[1]["answer"]) + 1)
    # Right, wrong, and the right number with extra text around it (no tags: the whole reply
    # is the answer, which the scorer gives partial credit).
    replies = [
        f"<answer>{right}</answer>{END}",
        f"<answer>{wrong}</answer>{END}",
        f"so {entries[2]['answer']} it is{END}",
    ]
    tasks = [
        _task("reasoning_gym:basic_arithmetic", seeds[0], params),
        _task("reasoning_gym:basic_arithmetic", seeds[1], params),
        _task("reasoning_gym:basic_arithmetic", seeds[2], {**params, "answer_tag": ""}),
    ]
    trajs, ids, seen = await _play(EnvConfig(model_path=str(tok_dir), max_seq_len=512), fmt, replies, tasks)
    ds = rg.create_dataset("basic_arithmetic", seed=seeds[2], size=1, **params)
    partial = ds.score_answer(f"so {entries[2]['answer']} it is", entries[2])
    assert [t.failed for t in trajs] == [False] * 3, [t.error for t in trajs]
    assert [t.reward for t in trajs] == [1.0, 0.0, partial] and 0.0 < partial < 1.0
    for traj, reply, prompt, entry in zip(trajs, ids, seen, entries, strict=True):
        assert traj.task == "reasoning_gym:basic_arithmetic" and traj.turns == 1
        assert traj.tokens[traj.loss_mask].tolist() == reply  # exactly the generated ids
        assert traj.tokens.tolist() == prompt + reply
        assert entry["question"] in fmt.decode(prompt)  # the generated item
        assert traj.versions.tolist() == [7] * len(reply)


def test_reasoning_gym_params_are_checked_before_any_episode() -> None:
    pytest.importorskip("reasoning_gym")
    check_task("reasoning_gym:leg_counting", {"min_animals": 2, "max_animals": 3})
    for params, words in [
        ({"bogus": 1}, "bogus"),
        ({"seed": 3}, "params.seed"),
        ({"min_animals": 5, "max_animals": 2}, "max_animals"),
    ]:
        with pytest.raises(TaskCheckError, match=words):
            check_task("reasoning_gym:leg_counting", params)
    with pytest.raises(TaskCheckError, match="no dataset 'nope'"):
        check_task("reasoning_gym:nope", {})


def test_a_missing_library_names_its_extra(monkeypatch) -> None:
    for kind, module, extra in [
        ("reasoning_gym", "reasoning_gym", "reasoning-gym"),
        ("openenv", "openenv", "openenv"),
        ("verifiers", "verifiers", "verifiers"),
    ]:
        monkeypatch.setitem(sys.modules, module, None)  # import now raises ImportError
        with pytest.raises(LibraryMissing, match=rf"pip install -e '\.\[{extra}\]'"):
            require(kind)
    with pytest.raises(TaskCheckError, match=r"task.kind 'reasoning_gym' needs the reasoning-gym package"):
        check_task("reasoning_gym:leg_counting", {})


# ----------------------------------------------------------------------------- OpenEnv
@pytest.fixture(scope="module")
def openenv_server(tmp_path_factory):
    pytest.importorskip("openenv")
    with serve_openenv(tmp_path_factory.mktemp("openenv") / "server.log") as url:
        yield url


async def test_openenv_episode_runs_over_the_environments_own_client(tok_dir, fmt, openenv_server) -> None:
    import random

    seed = 5
    secret = random.Random(seed).randrange(8)
    wrong = (secret + 3) % 8
    replies = [f"{wrong}{END}", f"{secret}{END}"]
    name = f"openenv:{ROOT / 'examples/libraries/openenv_env.py'}:GuessClient"
    params = {"base_url": openenv_server}
    check_task(name, params)
    trajs, ids, seen = await _play(
        EnvConfig(model_path=str(tok_dir), max_seq_len=512), fmt, replies, [_task(name, seed, params)]
    )
    (traj,) = trajs
    assert not traj.failed, traj.error
    assert traj.reward == 1.0 and traj.turns == 2  # the environment's reward and done
    assert traj.tokens[traj.loss_mask].tolist() == ids[0] + ids[1]
    assert traj.tokens.tolist() == seen[1] + ids[1]  # append-only: the second prompt extends the first
    assert seen[1][: len(seen[0]) + len(ids[0])] == seen[0] + ids[0]
    text = fmt.decode(seen[1])
    assert "guess the number from 0 to 7 in 3 turns" in text
    assert ("higher" if wrong < secret else "lower") in text


def test_openenv_params_are_checked() -> None:
    pytest.importorskip("openenv")
    name = f"openenv:{ROOT / 'examples/libraries/openenv_env.py'}:GuessClient"
    with pytest.raises(TaskCheckError, match="base_url"):
        check_task(name, {})
    with pytest.raises(TaskCheckError, match="no field 'nope'"):
        check_task(name, {"base_url": "http://127.0.0.1:1", "action_field": "nope"})
    with pytest.raises(TaskCheckError, match="not an openenv.core.EnvClient"):
        check_task(f"openenv:{ROOT / 'examples/libraries/openenv_env.py'}:GuessAction", {"base_url": "x"})


# ----------------------------------------------------------------------------- verifiers
VF_ENVS = HERE / "vf_envs.py"
# Not in the dev extra: verifiers pins openai < 3 (0.4) or mcp < 2 (0.3), which the Agents
# SDK and openenv-core in the dev extra cannot share; install it on its own to run these.
NEEDS_VERIFIERS = pytest.mark.skipif(
    importlib.util.find_spec("verifiers") is None,
    reason="verifiers is not installed (pip install -e '.[verifiers]'; it conflicts with the dev extra)",
)


def _vf_config(tok_dir: Path) -> EnvConfig:
    return EnvConfig(model_path=str(tok_dir), max_seq_len=512, gateway=True, step_timeout_s=60)


@NEEDS_VERIFIERS
async def test_verifiers_single_turn_rubric_is_the_reward(tok_dir, fmt) -> None:
    # Rows are picked by seed % 3: seed 0 asks 2+3, seed 1 asks 4+4.
    name = f"verifiers:{VF_ENVS}:load_single"
    trajs, ids, seen = await _play(
        _vf_config(tok_dir), fmt, [f"5{END}", f"7{END}"], [_task(name, 0, {}), _task(name, 1, {})]
    )
    assert [t.failed for t in trajs] == [False, False], [t.error for t in trajs]
    assert [t.reward for t in trajs] == [1.0, 0.0]
    for traj, reply, prompt, question in zip(trajs, ids, seen, ["What is 2+3?", "What is 4+4?"], strict=True):
        assert traj.turns == 1 and traj.tokens[traj.loss_mask].tolist() == reply
        assert traj.tokens.tolist() == prompt + reply
        assert "Answer with one word." in fmt.decode(prompt) and question in fmt.decode(prompt)


@NEEDS_VERIFIERS
async def test_verifiers_multi_turn_episode_is_one_append_only_trajectory(tok_dir, fmt) -> None:
    name = f"verifiers:{VF_ENVS}:load_multi"
    trajs, ids, seen = await _play(_vf_config(tok_dir), fmt, [f"4{END}", f"5{END}"], [_task(name, 0, {})])
    (traj,) = trajs
    assert not traj.failed, traj.error
    assert traj.reward == 0.5 and traj.turns == 2 and traj.segments == 1  # the rubric's own weighting
    assert traj.tokens[traj.loss_mask].tolist() == ids[0] + ids[1]
    assert seen[1][: len(seen[0]) + len(ids[0])] == seen[0] + ids[0]
    assert traj.tokens.tolist() == seen[1] + ids[1]
    assert "try again" in fmt.decode(seen[1])


@NEEDS_VERIFIERS
async def test_verifiers_environment_by_id_and_a_failing_one(tok_dir, fmt, monkeypatch) -> None:
    from actors.env.libs._verifiers import check_environment

    monkeypatch.syspath_prepend(str(HERE))
    check_environment("vf_envs", {"kind": "multi"})  # vf.load_environment imports it by id
    with pytest.raises(ValueError, match="vf_nope"):
        check_environment("vf_nope", {})
    # The env actor process finds the id module on its PYTHONPATH, as an installed env would be.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    trajs, _, _ = await _play(
        _vf_config(tok_dir),
        fmt,
        [f"8{END}"],
        [_task("verifiers:vf_envs", 1, {"kind": "single"}), _task("verifiers:vf_nope", 1, {})],
    )
    assert not trajs[0].failed and trajs[0].reward == 1.0, trajs[0].error
    assert trajs[1].failed and "vf_nope" in trajs[1].error and trajs[1].reward == 0.0


# ----------------------------------------------------------------------------- the run config
POOL = {"name": "p", "gpu": "cpu", "device": "cpu"}


def test_library_kinds_in_the_run_config_and_preflight(monkeypatch) -> None:
    from orchestrator.entry.preflight import preflight
    from orchestrator.state.config import ConfigError, check_runnable, load_config

    def cfg(task: dict):
        return load_config(raw={"task": task, "pools": [POOL]})

    with pytest.raises(ConfigError, match="task: .*kind = 'reasoning_gym' needs name"):
        cfg({"kind": "reasoning_gym"})
    with pytest.raises(ConfigError, match="command only apply to kind = 'harness'"):
        cfg({"kind": "verifiers", "name": "x", "command": "python a.py"})
    with pytest.raises(ConfigError, match="plays the environment's own dataset"):
        cfg({"kind": "verifiers", "name": "x", "dataset": "rows.jsonl"})
    assert cfg({"kind": "openenv", "name": "m:C"}).task.task_name == "openenv:m:C"
    assert cfg({"name": "arithmetic"}).task.task_name == "arithmetic"
    if importlib.util.find_spec("reasoning_gym") is not None:
        ok = cfg({"kind": "reasoning_gym", "name": "leg_counting", "params": {"max_animals": 3}})
        check_runnable(ok)
        preflight(ok)
        with pytest.raises(ConfigError, match="rejected"):
            preflight(cfg({"kind": "reasoning_gym", "name": "leg_counting", "params": {"nope": 1}}))
    # A missing library stops the run before any actor starts, naming the extra.
    for kind, module, extra in [
        ("reasoning_gym", "reasoning_gym", "reasoning-gym"),
        ("openenv", "openenv", "openenv"),
        ("verifiers", "verifiers", "verifiers"),
    ]:
        monkeypatch.setitem(sys.modules, module, None)
        with pytest.raises(ConfigError, match=rf"task.kind '{kind}' needs the {extra} package.*\.\[{extra}\]"):
            c = cfg({"kind": kind, "name": "leg_counting" if kind != "openenv" else "m:C"})
            check_runnable(c)
            preflight(c)


# ----------------------------------------------------------------------------- close()
CLOSED: list[str] = []


@register_task("test_closing")
class Closing(Environment):
    """Ends as ``how`` says: done at the first step, by running out of turns, or by raising."""

    max_turns = 2

    def __init__(self, how: str) -> None:
        self.how = how

    def reset(self, task: TaskSpec) -> str:
        return "what is 1 + 1 ?"

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        if self.how == "raise":
            raise RuntimeError("boom")
        return StepOutcome(observation="wrong", done=self.how == "done")

    def close(self) -> None:
        CLOSED.append(self.how)


async def test_the_environment_is_closed_however_the_episode_ends() -> None:
    from actors.chat import load_chat_format
    from actors.env._episode import EnvCalls, EpisodeLimits, play_episode
    from actors.env._threads import EnvThreads
    from actors.sampler import GenerateRequest
    from orchestrator.runtime import span
    from tests.unit.actors.test_env_chat_episodes import _scripted

    chat = load_chat_format(None, {})
    CLOSED.clear()
    for how in ("done", "turns", "raise"):
        generate, _ = _scripted(chat, ["2", "3"])
        traj = await play_episode(
            generate,
            GenerateRequest,
            _task("test_closing", 0, {"how": how}),
            SamplingParams(max_new_tokens=1),
            0,
            chat=chat,
            limits=EpisodeLimits(5.0, 5.0, 64),
            request_prefix="c",
            span=span,
            calls=EnvCalls(EnvThreads(2)),
        )
        assert traj.failed == (how == "raise") and traj.turns == {"done": 1, "turns": 2, "raise": 1}[how]
    assert CLOSED == ["done", "turns", "raise"]
