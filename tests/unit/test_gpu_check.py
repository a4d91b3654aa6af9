"""scripts/gpu_check.sh and its checks, as far as a machine without a GPU can run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_cuda_the_pass_fails_at_once_in_one_line(tmp_path: Path) -> None:
    env = _env() | {"GPU_CHECK_OUT": str(tmp_path)}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and proc.stderr == ""
    assert json.loads(lines[0]) == {"check": "cuda", "status": "failed", "reason": "torch sees no CUDA device"}


def test_an_unknown_argument_is_refused_in_one_line() -> None:
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--fast"], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 2 and "--fast" in proc.stderr and proc.stdout == ""


def test_the_weight_delta_check_runs_dry_on_cpu() -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_checks/weight_delta.py", "--device", "cpu", "--tiny"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    parts = {x["check"]: x for x in map(json.loads, proc.stdout.splitlines())}
    assert set(parts) == {"weight_delta.bf16", "weight_delta.fp8"}
    for part in parts.values():
        assert part["status"] == "passed"
        assert 0 < part["host_bytes_per_step"] < part["snapshot_bytes"]
