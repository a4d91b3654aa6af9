"""Harness tasks in the run config and the harness runner's small parts: bad input is one
clear error naming the field; rewards are read from the right place."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from actors.gateway import HarnessConfig, resolve
from actors.gateway._harness import _reward_line, task_dict
from actors.types import TaskSpec
from orchestrator.entry.preflight import preflight
from orchestrator.state.config import ConfigError, load_config

POOL = {"name": "cpu", "gpu": "cpu", "precision": "bf16", "device": "cpu"}
AGENT = Path(__file__).resolve().parents[3] / "examples" / "harness" / "agent.py"


def _cfg(tmp_path: Path, task: dict):
    return load_config(raw={"name": "h", "run_root": str(tmp_path), "pools": [POOL], "task": task})


def test_harness_task_section_is_checked(tmp_path) -> None:
    with pytest.raises(ConfigError, match="task: .*exactly one of command or entrypoint"):
        _cfg(tmp_path, {"kind": "harness"})
    with pytest.raises(ConfigError, match="exactly one of command or entrypoint"):
        _cfg(tmp_path, {"kind": "harness", "command": "python a.py", "entrypoint": "a:b"})
    with pytest.raises(ConfigError, match="command only apply to kind = 'harness'"):
        _cfg(tmp_path, {"command": "python a.py"})
    cfg = _cfg(tmp_path, {"kind": "harness", "name": "agent", "entrypoint": f"{AGENT}:play"})
    assert preflight(cfg).task_modules == []  # no registered task needed: the harness is the task
    with pytest.raises(ConfigError, match="gateway_server"):  # one server now: hypercorn
        _cfg(tmp_path, {"kind": "harness", "entrypoint": f"{AGENT}:play", "gateway_server": "hypercorn"})
    with pytest.raises(ConfigError, match="max_failed_in_a_row"):
        _cfg(tmp_path, {"kind": "harness", "entrypoint": f"{AGENT}:play", "max_failed_in_a_row": 0})


def test_preflight_names_a_missing_entrypoint_or_program(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"task.entrypoint .*has no function 'nope'"):
        preflight(_cfg(tmp_path, {"kind": "harness", "entrypoint": f"{AGENT}:nope"}))
    with pytest.raises(ConfigError, match=r"task.grader 'no_such_module_x:f': ModuleNotFoundError"):
        preflight(_cfg(tmp_path, {"kind": "harness", "entrypoint": f"{AGENT}:play", "grader": "no_such_module_x:f"}))
    with pytest.raises(ConfigError, match="program 'no-such-agent-binary' not found"):
        preflight(_cfg(tmp_path, {"kind": "harness", "command": "no-such-agent-binary {task}"}))
    preflight(_cfg(tmp_path, {"kind": "harness", "command": f"{sys.executable} {AGENT} {{task}}"}))


def test_harness_config_and_resolution() -> None:
    with pytest.raises(ValidationError, match="exactly one of command or entrypoint"):
        HarnessConfig()
    with pytest.raises(ValidationError, match="must look like 'module:function'"):
        HarnessConfig(entrypoint="just_a_module")
    assert resolve(f"{AGENT}:guess")(3, "2 and more") == "higher"
    assert resolve("json:dumps")([1]) == "[1]"


def test_reward_line_and_task_dict() -> None:
    assert _reward_line('noise\n{"reward": 0.5}\n{"other": 1}\n') == 0.5
    assert _reward_line('{"reward": 1}\n{"reward": 0.25}\n') == 0.25
    assert _reward_line('{"reward": "high"}\nnothing') is None
    task = TaskSpec(task="t", prompt_id="p7", group_id="g", seed=11, params={"question": "q", "seed": 2})
    assert task_dict(task) == {"seed": 2, "prompt_id": "p7", "question": "q"}  # params win
