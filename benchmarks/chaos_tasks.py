"""A task for benchmarks/chaos.py: guess_number whose environment raises now and then.

Loaded by the chaos run through `[task] modules = ["<repo>/benchmarks/chaos_tasks.py"]`.
"""

from __future__ import annotations

import random

from actors.env import GuessNumber, StepOutcome, register_task
from actors.types import TaskSpec


@register_task("flaky_guess_number")
class FlakyGuessNumber(GuessNumber):
    """guess_number, except that an episode fails with probability `fail_rate`: one of its
    `step` calls raises RuntimeError (an environment with a bug, or a flaky backend)."""

    def __init__(self, fail_rate: float = 0.1, **params: int) -> None:
        if not 0.0 <= fail_rate < 1.0:
            raise ValueError(f"flaky_guess_number: fail_rate={fail_rate} must be in [0, 1)")
        super().__init__(**params)
        self.fail_rate = fail_rate
        self._fail_at: int | None = None

    def reset(self, task: TaskSpec) -> str:
        rng = random.Random()  # not the task's seed: a retried slot may succeed
        self._fail_at = rng.randrange(1, self.max_turns + 1) if rng.random() < self.fail_rate else None
        return super().reset(task)

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        if self._fail_at is not None and self.turn + 1 >= self._fail_at:
            raise RuntimeError("flaky_guess_number: the environment's backend failed")
        return super().step(action_text, action_ids)
