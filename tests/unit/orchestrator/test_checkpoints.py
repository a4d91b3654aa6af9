"""Crash-safe checkpoint replacement and torn JSONL repair, with real SIGKILLs and cut files.

A subprocess replaces generation 1 of a checkpoint by generation 2 and SIGKILLs itself
right after step k of the sequence, for every k (including in the middle of writing a
file and between the deletions of the old checkpoint); resume must then find a complete
checkpoint that verifies (its digests) and whose every byte belongs to one generation.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from orchestrator.state.checkpoints import (
    MARKER,
    CheckpointError,
    checkpoint_meta,
    latest_checkpoint,
    repair_jsonl,
    save_checkpoint_dir,
    verify_checkpoint,
)
from orchestrator.state.telemetry import MetricsLog

ROOT = Path(__file__).resolve().parents[3]

# The generation's files: names and sizes differ per generation, so a mix is detectable.
_SAVER = r'''
import importlib.util, os, signal, sys
from pathlib import Path
import trio
# Load the module alone (not the orchestrator package): a fast start for many processes.
spec = importlib.util.spec_from_file_location("checkpoints", sys.argv[5])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)

run_dir, gen, kill_at, log = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
count = 0

def step(name):
    global count
    count += 1
    with open(log, "a") as f:
        f.write(name + "\n")
    if count == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

def files(g):
    return {"model/weights.bin": bytes([g]) * (1000 * g + 7), "optimizer.bin": bytes([g + 100]) * (500 * g + 3),
            "controller_state.json": f'{{"step": {10 * g}}}'.encode()}

async def write(d):
    for rel, data in files(gen).items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            step("write:half-file")       # killed here: a file cut mid-write
            f.write(data[len(data) // 2:])
        step("write:file")

trio.run(lambda: mod.save_checkpoint_dir(run_dir, write, meta={"gen": gen}, on_step=step))
'''


def _gen_files(g: int) -> dict[str, bytes]:
    return {
        "model/weights.bin": bytes([g]) * (1000 * g + 7),
        "optimizer.bin": bytes([g + 100]) * (500 * g + 3),
        "controller_state.json": f'{{"step": {10 * g}}}'.encode(),
    }


def _save(run_dir: Path, gen: int, kill_at: int = 0, log: Path | None = None) -> subprocess.CompletedProcess:
    """Save generation `gen` in a subprocess that SIGKILLs itself after step `kill_at` (0: never)."""
    log = log or run_dir.parent / f"steps-{gen}.log"
    module = ROOT / "orchestrator" / "state" / "checkpoints.py"
    return subprocess.run(
        [sys.executable, "-c", _SAVER, str(run_dir), str(gen), str(kill_at), str(log), str(module)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _save_here(run_dir: Path, gen: int) -> None:
    async def write(d: Path) -> None:
        for rel, data in _gen_files(gen).items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(data)

    trio.run(lambda: save_checkpoint_dir(run_dir, write, meta={"gen": gen}))


def _generation(ckpt: Path) -> int:
    """The one generation every file of `ckpt` belongs to (fails on a mix or a torn file)."""
    meta = checkpoint_meta(ckpt)
    assert meta is not None, f"{ckpt} is not complete"
    assert verify_checkpoint(ckpt) is None and set(meta["digests"]) == set(meta["files"])
    gen = meta["meta"]["gen"]
    on_disk = {str(p.relative_to(ckpt)): p.read_bytes() for p in ckpt.rglob("*") if p.is_file() and p.name != MARKER}
    assert on_disk == _gen_files(gen)
    return gen


def _kill_and_resume(tmp_path: Path, only: set[str] | None) -> list[str]:
    probe = tmp_path / "probe"
    probe.mkdir()
    assert _save(probe / "run", 1).returncode == 0
    log = tmp_path / "probe-steps.log"
    assert _save(probe / "run", 2, log=log).returncode == 0
    steps = log.read_text().split()
    assert {
        "stage",
        "write:half-file",
        "fsync",
        "marker",
        "verify",
        "retire",
        "promote",
        "delete:marker",
        "delete:file",
        "delete:dir",
    } <= set(steps)
    assert steps.index("marker") < steps.index("verify") < steps.index("retire")  # verified before any deletion
    marker_at = steps.index("marker") + 1

    for k in range(1, len(steps) + 1):
        if only is not None and steps[k - 1] not in only:
            continue
        run_dir = tmp_path / f"k{k}" / "run"
        run_dir.mkdir(parents=True)
        _save_here(run_dir, 1)
        proc = _save(run_dir, 2, kill_at=k)
        assert proc.returncode == -signal.SIGKILL, (k, steps[k - 1], proc.stderr)
        found = latest_checkpoint(run_dir)
        assert found == run_dir / "checkpoint", (k, steps[k - 1])
        gen = _generation(found)
        # Generation 2 counts from the moment its marker is on disk, never before.
        assert gen == (2 if k >= marker_at else 1), (k, steps[k - 1], gen)
        assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint"], (k, steps[k - 1])
        # The run goes on: the next replacement works from whatever the crash left.
        _save_here(run_dir, 3)
        assert _generation(latest_checkpoint(run_dir)) == 3
    return steps


@pytest.mark.slow
def test_a_kill_at_every_step_of_a_replacement_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    steps = _kill_and_resume(tmp_path, None)
    assert len(steps) >= 15


def test_a_kill_around_the_swap_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    _kill_and_resume(tmp_path, {"fsync", "marker", "verify", "retire", "promote", "delete:marker"})


def test_a_kill_during_the_first_save_leaves_no_checkpoint_and_no_crash(tmp_path: Path) -> None:
    for k in (1, 2, 5):  # staged; mid-file; after some files
        run_dir = tmp_path / f"k{k}"
        run_dir.mkdir()
        assert _save(run_dir, 1, kill_at=k).returncode == -signal.SIGKILL
        assert latest_checkpoint(run_dir) is None
        assert list(run_dir.iterdir()) == []


def test_a_failing_writer_leaves_the_current_checkpoint(tmp_path: Path) -> None:
    _save_here(tmp_path, 1)

    async def broken(d: Path) -> None:
        (d / "half").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        trio.run(lambda: save_checkpoint_dir(tmp_path, broken))
    assert (tmp_path / "checkpoint.new").exists()
    assert _generation(latest_checkpoint(tmp_path)) == 1
    assert not (tmp_path / "checkpoint.new").exists()


def test_a_manifest_catches_a_file_lost_after_the_marker(tmp_path: Path) -> None:
    _save_here(tmp_path, 1)
    _save_here(tmp_path, 2)
    # Simulate a crash state: gen 2 staged and marked, then a file of it vanished; gen 1 retired.
    os.rename(tmp_path / "checkpoint", tmp_path / "checkpoint.new")
    (tmp_path / "checkpoint.new" / "optimizer.bin").unlink()
    assert checkpoint_meta(tmp_path / "checkpoint.new") is None
    # A marked checkpoint missing a file is damaged, not interrupted: one line, nothing changed.
    with pytest.raises(CheckpointError, match=r"checkpoint\.new/optimizer\.bin: missing .*no other checkpoint"):
        latest_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.new"]


def _metrics(path: Path, n: int) -> None:
    log = MetricsLog(path)
    for i in range(1, n + 1):
        log.write({"step": i, "reward_mean": i / 10, "pools": {"a": {"tokens": i * 7}}})
    log.close()


def test_a_torn_last_metrics_line_is_truncated_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _metrics(path, 5)
    whole = path.read_bytes()
    last_start = whole.rstrip(b"\n").rfind(b"\n") + 1
    for cut in range(last_start + 1, len(whole) - 1):  # every length that tears the last line
        path.write_bytes(whole[:cut])
        with pytest.raises(json.JSONDecodeError):
            MetricsLog.read(path)  # what resume did before the repair
        warnings: list[str] = []
        removed = repair_jsonl(path, warn=warnings.append)
        assert removed == cut - last_start
        assert len(warnings) == 1 and "metrics.jsonl" in warnings[0] and "torn" in warnings[0]
        assert [r["step"] for r in MetricsLog.read(path)] == [1, 2, 3, 4]
        assert path.read_bytes() == whole[:last_start]
    # A complete last record that only lacks its newline is kept and given one.
    path.write_bytes(whole[:-1])
    warnings = []
    assert repair_jsonl(path, warn=warnings.append) == 0 and path.read_bytes() == whole and warnings
    # A whole file, an empty one and a missing one are left alone, silently.
    for data in (whole, b""):
        path.write_bytes(data)
        assert repair_jsonl(path, warn=pytest.fail) == 0 and path.read_bytes() == data
    assert repair_jsonl(tmp_path / "absent.jsonl", warn=pytest.fail) == 0


def test_a_writer_killed_mid_line_leaves_a_tail_that_repair_removes(tmp_path: Path) -> None:
    """A real process appending spans is SIGKILLed between the two halves of a line."""
    path = tmp_path / "traces.jsonl"
    code = (
        "import json, os, signal, sys\n"
        "f = open(sys.argv[1], 'a')\n"
        "for i in range(3):\n"
        "    f.write(json.dumps({'name': 'span', 'i': i}) + '\\n'); f.flush()\n"
        "f.write('{\"name\": \"spa'); f.flush()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], timeout=30)
    assert proc.returncode == -signal.SIGKILL
    warnings: list[str] = []
    assert repair_jsonl(path, warn=warnings.append) == len('{"name": "spa')
    assert [json.loads(line)["i"] for line in path.read_text().splitlines()] == [0, 1, 2]
    assert warnings
