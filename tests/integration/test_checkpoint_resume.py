"""`flotilla run --resume` on damaged checkpoints, end to end: the CLI in a subprocess, the
trainer, sampler and environment actors in theirs, a tiny random-init model.

A damaged newest checkpoint beside a good older one: the run resumes from the older one
and says so in one line. Every checkpoint damaged: one line naming the file, exit 2. A
checkpoint without digests (an earlier version's) with NaN bytes in its optimizer file:
the trainer actor refuses it, and its error crosses the actor boundary as one line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import read_jsonl

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
MODEL, OPT = "model/model.safetensors", "optimizer.safetensors"

CONFIG = """
name = "resume"
run_root = "{root}"
steps = 2
[task]
name = "guess_number"
params = {{n = 15, max_turns = 4}}
[rollout]
prompts_per_step = 2
group_size = 2
max_buffered_groups = 2
[[pools]]
name = "b200-bf16"
gpu = "B200"
precision = "bf16"
device = "cpu"
max_concurrent_rollouts = 8
"""


def _flotilla(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.entry.cli", "run", "--quiet", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _damage(path: Path, byte: int | None) -> None:
    """64 bytes in the middle: XORed with 0x5A (byte None) or set to `byte`."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 64):
        data[i] = data[i] ^ 0x5A if byte is None else byte
    path.write_bytes(bytes(data))


def _edit_marker(ckpt: Path, **changes: object) -> None:
    m = json.loads((ckpt / "COMPLETE").read_text())
    for k, v in changes.items():
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    (ckpt / "COMPLETE").write_text(json.dumps(m))


def _errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("flotilla: ") and not ln.startswith("flotilla: warning")]


def test_resume_falls_back_past_a_damaged_checkpoint_and_refuses_when_none_verifies(tmp_path: Path) -> None:
    config = tmp_path / "resume.toml"
    config.write_text(CONFIG.format(root=tmp_path / "runs"))
    run_dir = tmp_path / "runs" / "resume"
    first = _flotilla(str(config))
    assert first.returncode == 0, first.stderr
    ckpt = run_dir / "checkpoint"

    # A good older checkpoint (step 2) beside a damaged newer one of the same size.
    shutil.copytree(ckpt, run_dir / "checkpoint.old")
    _edit_marker(ckpt, seq=json.loads((ckpt / "COMPLETE").read_text())["seq"] + 1)
    _damage(ckpt / MODEL, None)
    good = (run_dir / "checkpoint.old" / MODEL).read_bytes()
    resumed = _flotilla("--resume", str(run_dir), "--steps", "3")
    assert resumed.returncode == 0, resumed.stderr
    said = [ln for ln in resumed.stderr.splitlines() if "not loaded" in ln]
    assert len(said) == 1 and f"{ckpt / MODEL}: xxh3-128 digest" in said[0], resumed.stderr
    assert "resuming from the older checkpoint (step 2)" in said[0]
    assert "Traceback" not in resumed.stderr
    assert (run_dir / "checkpoint.corrupt" / MODEL).read_bytes() != good  # kept for inspection
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert json.loads((ckpt / "COMPLETE").read_text())["meta"]["step"] == 3  # a new one, verified
    assert not (run_dir / "checkpoint.old").exists()

    # The only checkpoint damaged: one line naming the file and the mismatch, exit 2.
    backup = tmp_path / "backup"
    shutil.copytree(ckpt, backup)
    _damage(ckpt / OPT, 0xFF)
    refused = _flotilla("--resume", str(run_dir), "--steps", "4")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.startswith(f"flotilla: {ckpt / OPT}: xxh3-128 digest ")
    assert "no other checkpoint" in refused.stderr
    assert (ckpt / OPT).exists()  # nothing deleted

    # An earlier version's checkpoint (no digests) with NaN bytes: the trainer actor refuses
    # it while it loads, and the error reaches the console as one line.
    shutil.rmtree(ckpt)
    shutil.copytree(backup, ckpt)
    _edit_marker(ckpt, digests=None, digest=None)
    _damage(ckpt / OPT, 0xFF)
    legacy = _flotilla("--resume", str(run_dir), "--steps", "4")
    assert legacy.returncode == 2, legacy.stderr
    assert "Traceback" not in legacy.stderr and "ExceptionGroup" not in legacy.stderr, legacy.stderr
    errors = _errors(legacy.stderr)
    assert len(errors) == 1, legacy.stderr
    assert errors[0].startswith(f"flotilla: {ckpt / OPT}: tensor ") and "non-finite value" in errors[0]
    assert "without file digests" in legacy.stderr
    assert len(legacy.stderr.splitlines()) <= 3, legacy.stderr  # warning, start line, error
