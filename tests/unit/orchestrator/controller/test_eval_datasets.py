"""Evaluation beside training and dataset rows as task parameters, over in-memory links."""

from __future__ import annotations

from typing import Any

from actors.env import TaskDataset
from actors.types import SamplingParams, TaskSpec, Trajectory
from orchestrator.controller import ControllerState

from .fakes import FakeEnvs, Harness, run_config

ROWS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]


class RecordingEnvs(FakeEnvs):
    """FakeEnvs that remember every task and its sampling params."""

    def __init__(self) -> None:
        super().__init__()
        self.tasks: list[tuple[TaskSpec, SamplingParams, int]] = []

    async def run_episode(
        self,
        pool: Any,
        rank: int,
        task: TaskSpec,
        sampling: SamplingParams,
        min_version: int,
        env_rank: int,
        hold: bool = False,
    ) -> Trajectory:
        self.tasks.append((task, sampling, min_version))
        return await super().run_episode(pool, rank, task, sampling, min_version, env_rank, hold)


def _harness(state: ControllerState | None = None, **cfg: Any) -> Harness:
    h = Harness(run_config(task={"name": "chat_dataset"}, **cfg), state, envs=RecordingEnvs())
    h.controller.ctx.dataset = TaskDataset(ROWS, "train")
    h.controller.ctx.eval_dataset = TaskDataset([{"prompt": "held", "answer": "out"}], "eval")
    return h


async def test_evaluation_lines_and_held_out_episodes_never_trained(autojump_clock):
    h = _harness(steps=6, eval={"every": 2, "episodes": 3, "temperature": 0.0, "pool": "dear"})
    await h.controller.run()
    evals = [r for r in h.metrics.rows if "eval_reward" in r]
    assert [r["step"] for r in evals] == [2, 4, 6]  # the last step's evaluation is waited for
    for r in evals:
        assert r["eval_version"] >= r["step"] and r["eval_episodes"] == 3
        assert 0.0 <= r["eval_reward"] <= 1.0 and r["eval_s"] >= 0.0
    played = [(t, s, mv) for t, s, mv in h.envs.tasks if t.prompt_id.startswith("eval")]
    assert len(played) == 9
    assert all(s.temperature == 0.0 and t.params == {"prompt": "held", "answer": "out"} for t, s, _ in played)
    assert {mv for _, _, mv in played} == {2, 4, 6}  # the version just trained
    trained = h.trained()
    assert trained and not any(t.prompt_id.startswith("eval") for t in trained)
    assert [r["step"] for r in h.metrics.rows if "reward_mean" in r] == list(range(1, 7))


async def test_dataset_rows_follow_the_prompt_index_across_a_resume(autojump_clock):
    h = _harness(steps=4)
    await h.controller.run()
    ds = h.controller.ctx.dataset
    for task, _, _ in h.envs.tasks:
        i = int(task.prompt_id[1:])
        assert task.params == ds.params(i, seed=0)
    saved = h.checkpoints.saves[-1]
    resumed = _harness(ControllerState.model_validate(saved.model_dump()), steps=8)
    await resumed.controller.run()
    fresh = [t for t, _, _ in resumed.envs.tasks if t not in saved.buffered]
    first_new = min(int(t.prompt_id[1:]) for t in fresh)
    assert first_new == saved.prompts  # continues at the next prompt, so at the next row
    assert all(t.params == ds.params(int(t.prompt_id[1:]), seed=0) for t in fresh)
