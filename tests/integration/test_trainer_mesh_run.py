"""`flotilla run` of the demo with a 2-rank trainer (FSDP2 over gloo): it trains; a trainer
rank killed mid-run fails the run naming the rank, within seconds; `--resume` continues from
the last checkpoint with no step repeated or skipped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def _flotilla(*args: str, cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _trainer_rank(parent: int, rank: int) -> psutil.Process:
    for child in psutil.Process(parent).children(recursive=True):
        cmd = child.cmdline()
        if "actors.trainer._actor:TrainerActor" in cmd and cmd[cmd.index("--rank") + 1] == str(rank):
            return child
    raise AssertionError(f"no trainer rank {rank} among the run's processes")


def _wait_rows(proc: subprocess.Popen[str], metrics: Path, n: int, deadline_s: float) -> None:
    t0 = time.monotonic()
    while not (metrics.exists() and len(read_jsonl(metrics)) >= n):
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() - t0 < deadline_s, "no progress"
        time.sleep(0.2)


def test_demo_on_two_trainer_ranks_dies_naming_the_rank_and_resumes(tmp_path: Path) -> None:
    steps = 6
    args = [
        "--set",
        "trainer.procs=2",
        "--set",
        f"run_root=\"{tmp_path / 'runs'}\"",
        "--set",
        "name=\"mesh\"",
        "--set",
        "checkpoint.every_steps=2",
        "--steps",
        str(steps),
        "--set",
        "rollout.prompts_per_step=4",
    ]
    run_dir = tmp_path / "runs" / "mesh"
    metrics = run_dir / "metrics.jsonl"
    proc = _flotilla("run", str(ROOT / "examples" / "guess_number.toml"), *args, cwd=tmp_path)
    try:
        _wait_rows(proc, metrics, 3, deadline_s=300)  # steps 1-3 done: step 2 is checkpointed
        victim = _trainer_rank(proc.pid, 1)
        killed = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out
    assert "trainer rank 1 died" in out, out[-3000:]
    assert took < 30.0, took  # generous: the box is shared; locally a few seconds
    first = read_jsonl(metrics)
    assert first[0]["trainer_memory"]["ranks"] == 2  # the size report, on the first line
    assert "trainer:" in out and "parameters" in out

    proc = _flotilla("run", "--resume", str(run_dir), cwd=tmp_path)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:]
    rows = read_jsonl(metrics)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["version"] for r in rows] == list(range(1, steps + 1))
    assert all(r["loss"] == r["loss"] for r in rows)  # finite losses, no NaN
