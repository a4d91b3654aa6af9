"""A task for benchmarks/chaos.py: guess_number whose environment raises now and then.

Loaded by the chaos run through `[task] modules = ["<repo>/benchmarks/chaos_tasks.py"]`.
"""

from __future__ import annotations

import random

from actors.env import GuessNumber, StepOutcome, register_task
from actors.types import TaskSpec


@register_task("flaky_guess_number")
class FlakyGuessNumber(GuessNumber):
    """guess_number, except that each `step` raises RuntimeError with probability
    `fail_rate` (an environment with a bug, or a flaky backend behind it)."""

    def __init__(self, fail_rate: float = 0.1, **params: int) -> None:
        if not 0.0 <= fail_rate < 1.0:
            raise ValueError(f"flaky_guess_number: fail_rate={fail_rate} must be in [0, 1)")
        super().__init__(**params)
        self.fail_rate = fail_rate
        self._rng = random.Random()

    def reset(self, task: TaskSpec) -> str:
        self._rng = random.Random(task.seed ^ 0x5EED)
        return super().reset(task)

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        if self._rng.random() < self.fail_rate:
            raise RuntimeError("flaky_guess_number: the environment's backend failed")
        return super().step(action_text, action_ids)
