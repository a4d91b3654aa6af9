"""Helpers for end-to-end runs: a small run config written to a temp dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def small_run_raw(tmp_path: Path, name: str = "t", **overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": name,
        "run_root": str(tmp_path / "runs"),
        "steps": 3,
        "mode": "async",
        "task": {"name": "guess_number", "params": {"n": 15, "max_turns": 4}},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_buffered_groups": 4},
        "trainer": {"lr": 3e-3},
        "pools": [
            {
                "name": "b200-bf16",
                "gpu": "B200",
                "precision": "bf16",
                "device": "cpu",
                "staleness_budget": 2,
                "max_concurrent_rollouts": 16,
            },
            {
                "name": "h100-fp8",
                "gpu": "H100-SXM",
                "precision": "fp8",
                "device": "cpu",
                "staleness_budget": 1,
                "max_concurrent_rollouts": 16,
            },
        ],
    }
    raw["telemetry"] = {"trace_sample": 1.0}  # the tests read every rollout's spans
    for key, value in overrides.items():
        raw[key] = value
    return raw


@pytest.fixture
def small_raw(tmp_path: Path):
    return lambda **kw: small_run_raw(tmp_path, **kw)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


ROOT = Path(__file__).resolve().parents[2]


def flotilla_run(config: Path, *args: str, timeout: float = 380) -> subprocess.CompletedProcess[str]:
    """`flotilla run CONFIG --quiet ARGS` in a subprocess from the repository root, every
    rollout traced (`telemetry.trace_sample = 1`: the helpers below read their spans)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    sample = ["--set", "telemetry.trace_sample=1.0"]
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", str(config), "--quiet", *sample, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_trained_without_failures(run_dir: Path, steps: int, min_episodes: int) -> None:
    """Every step of the run was written, none with a failed episode, and at least
    `min_episodes` episodes finished (their rollout spans carry an outcome), none failed."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["dropped_failed"] == 0 for r in rows), [r["dropped_failed"] for r in rows]
    spans = read_jsonl(run_dir / "traces.jsonl")
    episodes = [s["attributes"] for s in spans if s.get("name") == "rollout" and "failed" in s["attributes"]]
    assert len(episodes) >= min_episodes and not any(a["failed"] for a in episodes)
