"""Each environment-library example trains end to end: `flotilla run` of
examples/libraries/{reasoning_gym,openenv,verifiers}.toml on the tiny local checkpoint that
examples/libraries/make_checkpoint.py makes, 0 failed episodes. The OpenEnv run plays against
the example environment's real server process; the verifiers run needs verifiers installed
(it is not in the dev extra) and skips without it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.actors.openenv_server import serve_openenv

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("libmodel") / "model"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "examples/libraries/make_checkpoint.py", "--out", str(out)],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


def _train(example: str, model: Path, run_root: Path, *sets: str) -> list[dict]:
    """Run the example for 2 steps; return its rollout spans (every one must have succeeded)."""
    cmd = [
        sys.executable,
        "-m",
        "orchestrator",
        "run",
        f"examples/libraries/{example}.toml",
        "--quiet",
        "--steps",
        "2",
        "--set",
        f'model.path="{model}"',
        "--set",
        f'run_root="{run_root}"',
        "--set",
        "telemetry.trace_sample=1.0",  # the assertions read every rollout's spans
        *sets,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    run = next(p for p in run_root.iterdir() if (p / "metrics.jsonl").is_file())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["dropped_failed"] == 0 for r in rows), [r["dropped_failed"] for r in rows]
    spans = [json.loads(x) for x in (run / "traces.jsonl").read_text().splitlines()]
    episodes = [
        s["attributes"]
        for s in spans  # the env actors' side of each finished rollout
        if s.get("name") == "rollout" and s.get("service", "").startswith("env") and "failed" in s["attributes"]
    ]
    assert len(episodes) >= 16 and not any(a["failed"] for a in episodes)
    assert all(a["generated"] > 0 for a in episodes)
    return episodes


@pytest.mark.timeout(450)
def test_reasoning_gym_example_trains(model: Path, tmp_path: Path) -> None:
    pytest.importorskip("reasoning_gym")
    episodes = _train("reasoning_gym", model, tmp_path)
    assert {a["task"] for a in episodes} == {"reasoning_gym:basic_arithmetic"}


@pytest.mark.timeout(450)
def test_openenv_example_trains(model: Path, tmp_path: Path) -> None:
    pytest.importorskip("openenv")
    with serve_openenv(tmp_path / "server.log") as url:
        episodes = _train("openenv", model, tmp_path / "runs", "--set", f'task.params.base_url="{url}"')
    assert all(1 <= a["turn"] <= 3 for a in episodes)


@pytest.mark.timeout(450)
@pytest.mark.skipif(
    importlib.util.find_spec("verifiers") is None,
    reason="verifiers is not installed (pip install -e '.[verifiers]'; it conflicts with the dev extra)",
)
def test_verifiers_example_trains(model: Path, tmp_path: Path) -> None:
    episodes = _train("verifiers", model, tmp_path)
    assert all(a["kind"] == "verifiers" and 1 <= a["turn"] <= 3 for a in episodes)
