"""End-to-end runs of the controller with real actor processes (trainer, two sampler pools,
an environment actor), a tiny random-init model and the guess_number task."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import trio

from orchestrator.entry.runner import run_async
from orchestrator.state.config import load_config
from orchestrator.state.progress import Progress
from tests.integration.conftest import read_jsonl

pytestmark = pytest.mark.timeout(300)


async def test_end_to_end_run_writes_outputs_and_one_trace_spans_three_processes(small_raw):
    cfg = load_config(raw=small_raw(name="e2e"))
    with trio.fail_after(240):
        result = await run_async(cfg, progress=Progress(cfg.steps, quiet=True))
    run_dir = cfg.run_dir
    assert result.steps_done == 3 and result.version == 3 and not result.interrupted
    for name in ("config.json", "metrics.jsonl", "traces.jsonl", "cost_report.json", "cost_report.md"):
        assert (run_dir / name).is_file(), name

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["version"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert 0.0 <= m["reward_mean"] <= 1.0
        assert m["rollouts"] == 16
        assert set(m["pools"]) == {"b200-bf16", "h100-fp8"}

    spans = read_jsonl(run_dir / "traces.jsonl")
    by_trace: dict[str, list[dict]] = defaultdict(list)
    for s in spans:
        by_trace[s["trace_id"]].append(s)
    rollouts = [s for s in spans if s["name"] == "rollout" and "staleness" in s["attributes"]]
    assert rollouts
    best = max(rollouts, key=lambda r: len({s["pid"] for s in by_trace[r["trace_id"]]}))
    family = by_trace[best["trace_id"]]
    assert len({s["pid"] for s in family}) >= 3, family
    assert {"policy_version", "pool", "staleness"} <= set(best["attributes"])
    services = {s["service"] for s in family}
    assert "controller" in services
    names = {s["name"] for s in family}
    assert "sampler.generate" in names

    # Samplers start with no weights: their first keyframe came in parts, into their own snapshot.
    parts = [s for s in spans if s["name"] == "weights.part"]
    assert {s["attributes"]["pool"] for s in parts} == {"b200-bf16", "h100-fp8"}
    assert any(
        s["name"] == "weights.apply" and s["service"] == "controller" and s["attributes"].get("keyframe") for s in spans
    )

    report = (run_dir / "cost_report.md").read_text()
    assert "b200-bf16" in report and "h100-fp8" in report
    train_spans = [s for s in spans if s["name"] == "train_step" and s["service"] == "controller"]
    assert len(train_spans) == 3
    assert all("mismatch_kl" in s["attributes"] for s in train_spans)


async def test_zero_budget_pool_never_trains_stale_and_no_prompt_is_lost(small_raw):
    raw = small_raw(name="budget0", steps=4)
    raw["pools"][1]["staleness_budget"] = 0
    cfg = load_config(raw=raw)
    with trio.fail_after(240):
        result = await run_async(cfg, progress=Progress(cfg.steps, quiet=True))
    metrics = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert len(metrics) == 4
    for m in metrics:
        pool = m["pools"]["h100-fp8"]
        if pool["rollouts"]:
            assert pool["staleness_max"] == 0, m
    c = result.counts
    assert c["groups_in"] == c["groups_trained"] + c["groups_buffered"] + c["groups_skipped"]
    assert c["groups_trained"] == 4 * cfg.rollout.prompts_per_step
    assert c["groups_skipped"] == 0
    dropped_spans = [s for s in read_jsonl(cfg.run_dir / "traces.jsonl") if s["name"] == "rollout.dropped"]
    assert len([s for s in dropped_spans if s["attributes"]["reason"] == "stale"]) == c["dropped_stale"]
    assert all(s["attributes"]["staleness"] > 0 for s in dropped_spans if s["attributes"]["pool"] == "h100-fp8")


def _flotilla(*args: str, cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_sigint_checkpoints_and_resume_continues_without_repeating_or_skipping(small_raw, tmp_path):
    import json
    import tomllib  # noqa: F401 - the config below is written as JSON, which load_config reads too

    raw = small_raw(name="resume", steps=6)
    config = tmp_path / "run.json"
    config.write_text(json.dumps(raw))
    run_dir = Path(raw["run_root"]) / "resume"
    metrics = run_dir / "metrics.jsonl"

    proc = _flotilla("run", str(config), cwd=tmp_path)
    try:
        # Wait (bounded) until two steps are logged, then interrupt like Ctrl-C.
        deadline = 240.0
        import time

        t0 = time.monotonic()
        while not (metrics.exists() and len(read_jsonl(metrics)) >= 2):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() - t0 < deadline, "no progress"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "interrupt" in out
    first = read_jsonl(metrics)
    stopped_at = first[-1]["step"]
    assert 2 <= stopped_at < 6
    state = json.loads((run_dir / "checkpoint" / "controller_state.json").read_text())
    assert state["step"] == stopped_at and state["version"] == stopped_at
    assert f"interrupted at step {stopped_at} of 6" in (run_dir / "report.html").read_text()
    # The prompts buffered at the stop are saved, to be played first after the resume.
    buffered = {t["prompt_id"] for t in state["buffered"]}
    assert buffered
    b = state["buffer"]
    assert b["groups_in"] == b["groups_trained"] + len(state["buffered"]) + b["groups_skipped"]
    resumed_at_ns = time.time_ns()

    proc = _flotilla("run", "--resume", str(run_dir), cwd=tmp_path)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    rows = read_jsonl(metrics)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["version"] for r in rows] == list(range(1, 7))
    replayed = {
        s["attributes"]["prompt_id"]
        for s in read_jsonl(run_dir / "traces.jsonl")
        if s["name"] == "rollout" and s["service"] == "controller" and s["start_ns"] >= resumed_at_ns
    }
    assert buffered <= replayed  # no prompt buffered at the stop was lost
    assert (run_dir / "cost_report.json").is_file()
    assert "finished: 6 of 6 steps" in (run_dir / "report.html").read_text()
