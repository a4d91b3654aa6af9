"""benchmarks/defaults_tasks.py: which configs run the recipe's defaults, and how tasks
that met the bar on every run are counted (issue 32, item 3)."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def dt(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the benchmarks import each other by name
    import defaults_tasks

    yield defaults_tasks
    for name in ("defaults_tasks", "demo_seeds", "_runs"):
        sys.modules.pop(name, None)


def test_every_shipped_task_config_runs_the_recipe_defaults(dt: Any) -> None:
    for task in dt.TASKS + dt.OTHER_TASKS:
        with open(ROOT / "examples" / f"{task}.toml", "rb") as f:
            raw = tomllib.load(f)
        assert dt.beyond_defaults(raw) == [], task
        assert raw["task"]["name"] == task


def test_a_recipe_table_or_a_trainer_setting_besides_lr_is_named(dt: Any) -> None:
    assert dt.beyond_defaults({"trainer": {"lr": 1e-3}}) == []
    assert dt.beyond_defaults({"recipe": {}}) == []  # an empty table changes nothing
    found = dt.beyond_defaults(
        {"recipe": {"top_p": 0.99, "entropy_coef": 0.1}, "trainer": {"lr": 1e-3, "grad_clip": 0.5}}
    )
    assert found == ["[recipe] sets entropy_coef, top_p", "[trainer] sets grad_clip (only lr may change)"]


def test_a_task_counts_only_when_every_run_met_the_bar_on_the_defaults(dt: Any) -> None:
    per_task = {
        "all": {"defaults": True, "runs": 10, "runs_meeting_bar": 10},
        "nine": {"defaults": True, "runs": 10, "runs_meeting_bar": 9},
        "tuned": {"defaults": "[recipe] sets top_p", "runs": 10, "runs_meeting_bar": 10},
        "unrun": {"defaults": True, "runs": 0, "runs_meeting_bar": 0},
    }
    assert dt.tasks_reaching(per_task) == 1
