"""examples/harness end to end, as its README runs it: the openai-client agent trains the
tiny model through the gateway (real processes throughout), a few steps, every episode
succeeding and every trajectory one segment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_harness_example_trains_through_the_gateway(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "orchestrator",
        "run",
        "examples/harness/config.toml",
        "--quiet",
        "--set",
        f'run_root="{tmp_path}"',
        "--set",
        "rollout.prompts_per_step=4",
        "--set",
        "telemetry.trace_sample=1.0",  # the assertions read every rollout's spans
        "--steps",
        "3",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=350, check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    rows = [json.loads(x) for x in (tmp_path / "harness" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollouts"] == 4 * 8 and r["dropped_failed"] == 0 for r in rows)
    assert all(r["segments_mean"] == 1.0 for r in rows)
    spans = [json.loads(x) for x in (tmp_path / "harness" / "traces.jsonl").read_text().splitlines()]
    # Episodes still running when the run ends are cancelled: their spans carry no result.
    done = [
        s["attributes"]
        for s in spans
        if s.get("name") == "rollout" and s["attributes"].get("kind") == "harness" and "segments" in s["attributes"]
    ]
    assert len(done) >= 3 * 4 * 8 and all(a["segments"] == 1 and not a["failed"] for a in done)
