"""`flotilla report RUN_DIR`: a run's cost report and training summary, and its report.html.

The cost report is written by the run itself (`cost_report.json` + `.md`); this
command re-renders the Markdown from the JSON and prints it with a short summary
of `metrics.jsonl` (steps, reward at the start and the end, drops, wall time, and the
first and last held-out evaluation when `[eval]` ran).
It also rebuilds `report.html` (orchestrator.entry.report), also for a run that has no
cost report yet (still running, or killed), and says what the page lacks.
`flotilla compare RUN_DIR ...` writes one page overlaying several runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hardware import CostReport

__all__ = ["compare_runs", "print_report", "training_summary"]


def training_summary(run_dir: Path) -> str:
    from orchestrator.entry.report import read_metrics

    # training lines and evaluation lines; damaged ones left out
    rows, evals = read_metrics(run_dir / "metrics.jsonl", [])
    if not rows:
        return "no training steps recorded"
    k = min(5, len(rows))
    first = sum(r["reward_mean"] for r in rows[:k]) / k
    last = sum(r["reward_mean"] for r in rows[-k:]) / k
    end = rows[-1]
    return (
        f"steps {rows[0]['step']}..{end['step']} in {end['wall_s']:.0f}s of the last session | "
        f"reward {first:.3f} (first {k}) -> {last:.3f} (last {k}) | "
        f"dropped stale {end['dropped_stale']}, failed {end['dropped_failed']} | "
        f"cost ${end['cost_usd']:.4f}" + _eval_summary(evals)
    )


def _eval_summary(evals: list[dict]) -> str:
    if not evals:
        return ""
    first, last = evals[0], evals[-1]
    return (
        f"\neval reward {first['eval_reward']:.3f} (step {first['step']}) -> "
        f"{last['eval_reward']:.3f} (step {last['step']}, version {last['eval_version']}), "
        f"{len(evals)} evaluations"
    )


def print_report(run_dir: str | Path) -> int:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        print(f"flotilla: {run_dir} is not a run directory", file=sys.stderr)
        return 2
    html = _write_html(run_dir)
    path = run_dir / "cost_report.json"
    if not path.exists():
        print(f"flotilla: {path} not found (is {run_dir} a run directory of a finished run?)", file=sys.stderr)
        return 2 if html is None else 0
    report = CostReport.model_validate_json(path.read_text())
    markdown = report.to_markdown()
    (run_dir / "cost_report.md").write_text(markdown)
    print(markdown)
    print(training_summary(run_dir))
    return 0


def _write_html(run_dir: Path) -> Path | None:
    from orchestrator.entry.report import load_run, write_report

    data = load_run(run_dir)
    path = write_report(run_dir, data=data)
    print(f"report: {path}")
    for line in data.missing:
        print(f"  missing: {line}")
    return path


def compare_runs(run_dirs: list[str], out: str) -> int:
    """`flotilla compare`: write the comparison page; 2 when an argument is not a directory."""
    from orchestrator.entry.report import write_compare

    bad = [d for d in run_dirs if not Path(d).is_dir()]
    if bad:
        print(f"flotilla: {bad[0]} is not a run directory", file=sys.stderr)
        return 2
    print(f"comparison of {len(run_dirs)} runs: {write_compare(run_dirs, out)}")
    return 0
