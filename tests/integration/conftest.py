"""Helpers for end-to-end runs: a small run config written to a temp dir."""

from __future__ import annotations

import json
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
    for key, value in overrides.items():
        raw[key] = value
    return raw


@pytest.fixture
def small_raw(tmp_path: Path):
    return lambda **kw: small_run_raw(tmp_path, **kw)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
