"""The soak (`benchmarks/fleet.py --soak N`) runs the real controller over fake actors on
the default data path (held trajectories), with real metrics and checkpoints; a short one
here keeps the benchmark runnable and checks the bounds it measures at any length."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)


def test_a_short_soak_runs_on_the_default_data_path_with_flat_descriptors_and_bounded_files() -> None:
    steps = 120
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fleet.py"), "--soak", str(steps)],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    soak = json.loads(proc.stdout.strip().splitlines()[-1])["soak"]
    assert soak["steps"] == steps and soak["metrics_lines"] == steps
    assert soak["rollouts"] == steps * 4  # every step trained a full batch
    assert soak["fd_growth"] == 0
    assert soak["rss_growth"] < 0.05
    # metrics lines and the controller's checkpointed state do not grow with the run
    assert soak["metrics_line_bytes_last"] < 1.1 * soak["metrics_line_bytes_first"]
    assert soak["state_bytes_last"] < 1.2 * soak["state_bytes_first"]
