"""benchmarks/defaults_tasks.py: which configs run the recipe's defaults, and how tasks
that met the bar on every run are counted (issue 32, item 3)."""

from __future__ import annotations

import json
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


def test_a_partial_set_does_not_count_as_reaching(dt: Any) -> None:
    per_task = {"three": {"defaults": True, "runs": 3, "runs_meeting_bar": 3}}
    assert dt.tasks_reaching(per_task) == 1
    assert dt.tasks_reaching(per_task, runs=10) == 0


def test_the_code_version_names_the_committed_runtime(dt: Any) -> None:
    version = dt.code_version()
    digest = version.removesuffix("+dirty")
    assert len(digest) == 12 and int(digest, 16) >= 0


def test_a_line_that_is_not_a_run_is_named(dt: Any, tmp_path: Path) -> None:
    record = tmp_path / "r.jsonl"
    record.write_text(
        '{"task": "t", "run": "0.0", "config": "c", "code": "k", "commit": "x", "figures": {}}\n{"task"\n'
    )
    with pytest.raises(SystemExit, match="line 2 is not a recorded run"):
        dt.read_record(record)


def _figures(reach: bool) -> dict[str, Any]:
    return {
        "step_to_target": 100 if reach else None,
        "wall_to_target_s": 50.0 if reach else None,
        "final": 0.9 if reach else 0.5,
        "steps": 200,
        "total_s": 80.0,
        "startup_and_shutdown_s": 5.0,
        "sampler_per_trained_token": 1.0,
        "load_avg": [0.0, 0.0, 0.0],
        "peak": 0.95 if reach else 0.6,
        "final_entropy": 0.05,
        "curve": {100: 0.5, 200: 0.9 if reach else 0.5},
    }


def test_a_recorded_set_resumes_where_it_stopped(
    dt: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text('name = "tiny"\nsteps = 200\n[task]\nname = "tiny"\n[trainer]\nlr = 1e-3\n')
    record = tmp_path / "record.jsonl"
    ran: list[int] = []

    def fake_run(raw: dict[str, Any]) -> dict[str, Any]:
        ran.append(raw["seed"])
        if len(ran) == 3:
            raise KeyboardInterrupt  # the set stopped during its third run
        return _figures(reach=raw["seed"] != 1)

    monkeypatch.setattr(dt, "run_seed", fake_run)
    monkeypatch.setattr(dt, "code_version", lambda: "abc")
    argv = ["defaults_tasks.py", str(config), "--seeds", "0,1", "--record", str(record)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(KeyboardInterrupt):
        dt.main()
    assert ran == [0, 1, 0] and len(record.read_text().splitlines()) == 2

    ran.clear()
    monkeypatch.setattr(dt, "run_seed", lambda raw: ran.append(raw["seed"]) or _figures(reach=True))
    dt.main()  # runs 0.1 and 1.1 only
    assert ran == [0, 1]
    assert len(record.read_text().splitlines()) == 4

    monkeypatch.setattr(sys, "argv", [*argv, "--report", "--markdown"])
    monkeypatch.setattr(dt, "run_seed", lambda raw: pytest.fail("--report ran a run"))
    capsys.readouterr()
    dt.main()
    printed = capsys.readouterr().out.splitlines()
    assert "| 1.0 | never | - | 0.500 | 0.600 | 0.050 | 0.50 0.50 | 80 s | **no** |" in printed
    assert "| 0.1 | 100 | 50 s | 0.900 | 0.950 | 0.050 | 0.50 0.90 | 80 s | yes |" in printed
    report = json.loads(printed[-1])
    tiny = report["per_task"]["tiny"]
    assert (tiny["runs"], tiny["runs_meeting_bar"], report["defaults_tasks_reaching"]) == (4, 3, 0)
    assert report["runtime_code"] == ["abc"]

    monkeypatch.setattr(dt, "code_version", lambda: "other")  # the runtime changed: every run again
    monkeypatch.setattr(sys, "argv", argv)
    ran.clear()
    monkeypatch.setattr(dt, "run_seed", lambda raw: ran.append(raw["seed"]) or _figures(reach=True))
    dt.main()
    assert ran == [0, 1, 0, 1]
