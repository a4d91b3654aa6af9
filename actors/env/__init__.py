"""Environments: the interface users implement, built-in tasks, and the EnvActor.

Implement ``Environment.reset(task)`` and ``Environment.step(action_text, action_ids)``
(plain or async), register it with ``@register_task("name")``, and an ``EnvActor``
plays episodes of it against a sampler, returning ``Trajectory`` objects.
"""

from actors.env._actor import EnvActor, EnvConfig
from actors.env._chat_dataset import ChatDataset
from actors.env._check import TaskCheckError, check_task
from actors.env._dataset import DatasetError, TaskDataset
from actors.env._episode import EpisodeBuilder
from actors.env._interface import (
    Environment,
    Observation,
    StepOutcome,
    make_env,
    make_task_specs,
    register_task,
    registered_tasks,
    task_factory,
)
from actors.env._modules import TaskModuleError, import_task_modules, resolve_callable
from actors.env._tasks import Arithmetic, GuessNumber, Reverse, Sort, SumMod, first_int, guess_number_optimal

__all__ = [
    "Arithmetic",
    "ChatDataset",
    "DatasetError",
    "EnvActor",
    "EnvConfig",
    "Environment",
    "EpisodeBuilder",
    "GuessNumber",
    "Observation",
    "Reverse",
    "Sort",
    "StepOutcome",
    "SumMod",
    "TaskCheckError",
    "TaskDataset",
    "TaskModuleError",
    "check_task",
    "first_int",
    "guess_number_optimal",
    "import_task_modules",
    "make_env",
    "make_task_specs",
    "register_task",
    "registered_tasks",
    "resolve_callable",
    "task_factory",
]
