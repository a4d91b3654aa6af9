"""`flotilla report RUN_DIR`: a run's cost report and training summary.

The cost report is written by the run itself (`cost_report.json` + `.md`); this
command re-renders the Markdown from the JSON and prints it with a short summary
of `metrics.jsonl` (steps, reward at the start and the end, drops, wall time, and the
first and last held-out evaluation when `[eval]` ran).
"""

from __future__ import annotations

import sys
from pathlib import Path

from hardware import CostReport
from orchestrator.telemetry import MetricsLog

__all__ = ["print_report", "training_summary"]


def training_summary(run_dir: Path) -> str:
    lines = MetricsLog.read(run_dir / "metrics.jsonl")
    rows = [r for r in lines if "reward_mean" in r]   # training steps; eval lines apart
    evals = [r for r in lines if "eval_reward" in r]
    if not rows:
        return "no training steps recorded"
    k = min(5, len(rows))
    first = sum(r["reward_mean"] for r in rows[:k]) / k
    last = sum(r["reward_mean"] for r in rows[-k:]) / k
    end = rows[-1]
    return (f"steps {rows[0]['step']}..{end['step']} in {end['wall_s']:.0f}s of the last session | "
            f"reward {first:.3f} (first {k}) -> {last:.3f} (last {k}) | "
            f"dropped stale {end['dropped_stale']}, failed {end['dropped_failed']} | "
            f"cost ${end['cost_usd']:.4f}" + _eval_summary(evals))


def _eval_summary(evals: list[dict]) -> str:
    if not evals:
        return ""
    first, last = evals[0], evals[-1]
    return (f"\neval reward {first['eval_reward']:.3f} (step {first['step']}) -> "
            f"{last['eval_reward']:.3f} (step {last['step']}, version {last['eval_version']}), "
            f"{len(evals)} evaluations")


def print_report(run_dir: str | Path) -> int:
    run_dir = Path(run_dir)
    path = run_dir / "cost_report.json"
    if not path.exists():
        print(f"flotilla: {path} not found (is {run_dir} a run directory of a finished run?)",
              file=sys.stderr)
        return 2
    report = CostReport.model_validate_json(path.read_text())
    markdown = report.to_markdown()
    (run_dir / "cost_report.md").write_text(markdown)
    print(markdown)
    print(training_summary(run_dir))
    return 0
