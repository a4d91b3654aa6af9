"""Tracing benchmark: what the default trace sampling costs the shipped demo, and what it writes.

What: the demo (examples/guess_number.toml) runs several times with tracing off
(`[telemetry] traces = false`: no span is recorded) and with tracing at the default sample
rate (`[telemetry] trace_sample`, the config model's default unless `--sample` says
otherwise), alternating off/on (ABBA order, so drift in the machine's load falls on both),
each run a fresh `flotilla run` process tree. Reported, medians over the repeats:

* `tracing_overhead` = on / off - 1 of the training phase's wall time (metrics' `wall_s`,
  first step to last: process start-up and the first keyframe excluded). Target <= 0.02.
* `tracing_cpu_overhead`: the same ratio of the CPU seconds (user + system) of every
  process of the run (the CLI and its actors, from `getrusage(RUSAGE_CHILDREN)`), which a
  machine shared with other work disturbs less than wall time.
* `traces_mb`: size of `traces.jsonl` of a traced run (MB, 10^6 bytes). Target <= 10 for
  the shipped demo (the full mode runs its own 800 steps; issue 30 set the bound for 500).
  `traces_mb_per_step` and `spans` too, and `traces_not_written` (spans left out at
  `traces_max_mb`; 0 unless the cap was reached).

Why: issue 30's "telemetry that scales": tracing every span of the demo wrote hundreds of
MB and cost several percent of the wall time.

How: `python benchmarks/tracing.py [--quick] [--repeats N] [--steps N] [--sample R]`.
Full mode: the demo as shipped (its config's steps), 3 repeats per mode. `--quick`: 20
steps and half the prompts per step, 2 repeats per mode (a few minutes on a quiet machine).
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _runs import DEMO, ROOT, demo_raw, load_average

from orchestrator.state.sections import TelemetrySection


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _one_run(root: Path, name: str, steps: int, sets: list[str]) -> dict[str, Any]:
    """One `flotilla run` of the demo in its own process tree; its timings and trace file."""
    cmd = [sys.executable, "-m", "orchestrator.entry.cli", "run", str(DEMO), "--steps", str(steps), "--quiet"]
    for s in [f'run_root="{root}"', f'name="{name}"', *sets]:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cpu0, t0 = _children_cpu_s(), time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    total_s, cpu_s = time.monotonic() - t0, _children_cpu_s() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"tracing benchmark: run {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    run_dir = root / name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trace = run_dir / "traces.jsonl"
    size = trace.stat().st_size if trace.exists() else 0
    spans = sum(1 for _ in trace.open()) if trace.exists() else 0
    return {
        "name": name,
        "steps": len(rows),
        "train_s": rows[-1]["wall_s"] - rows[0]["wall_s"],
        "total_s": total_s,
        "cpu_s": cpu_s,
        "traces_bytes": size,
        "spans": spans,
        "traces_not_written": max((r.get("traces_not_written", 0) for r in rows), default=0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="20 steps, half the prompts per step, 2 repeats")
    p.add_argument("--repeats", type=int, default=None, help="runs per mode (default 3; 2 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: the demo's; 20 with --quick)")
    p.add_argument("--sample", type=float, default=None, help="trace_sample of the traced runs (default: the config's)")
    args = p.parse_args()
    steps = args.steps or (20 if args.quick else int(demo_raw()["steps"]))
    repeats = args.repeats or (2 if args.quick else 3)
    sample = TelemetrySection().trace_sample if args.sample is None else args.sample
    if steps < 2 or repeats < 1 or not 0.0 <= sample <= 1.0:
        raise SystemExit("tracing benchmark: --steps must be >= 2, --repeats >= 1, --sample within [0, 1]")
    scale = ["rollout.prompts_per_step=8", "rollout.max_buffered_groups=8"] if args.quick else []
    modes = {"off": ["telemetry.traces=false", *scale], "on": [f"telemetry.trace_sample={sample}", *scale]}
    load_before = load_average()
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="flotilla-tracing-") as tmp:
        for r in range(repeats):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                out = _one_run(Path(tmp), f"{mode}-{r}", steps, modes[mode])
                runs[mode].append(out)
                print(
                    f"{mode:>3} #{r}: {out['steps']} steps, training {out['train_s']:.1f} s, "
                    f"total {out['total_s']:.1f} s, cpu {out['cpu_s']:.1f} s, "
                    f"traces {out['traces_bytes'] / 1e6:.2f} MB ({out['spans']} spans)",
                    flush=True,
                )

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    on_bytes = med("on", "traces_bytes")
    result = {
        "benchmark": "tracing",
        "quick": args.quick,
        "steps": steps,
        "repeats": repeats,
        "trace_sample": sample,
        "tracing_overhead": round(med("on", "train_s") / med("off", "train_s") - 1, 4),
        "tracing_cpu_overhead": round(med("on", "cpu_s") / med("off", "cpu_s") - 1, 4),
        "traces_mb": round(on_bytes / 1e6, 3),
        "traces_mb_per_step": round(on_bytes / 1e6 / steps, 5),
        "spans": int(med("on", "spans")),
        "traces_not_written": max(r["traces_not_written"] for r in runs["on"]),
        "off_traces_bytes": max(r["traces_bytes"] for r in runs["off"]),
        "train_s": {m: [round(r["train_s"], 2) for r in runs[m]] for m in runs},
        "cpu_s": {m: [round(r["cpu_s"], 2) for r in runs[m]] for m in runs},
        "total_s": {m: [round(r["total_s"], 2) for r in runs[m]] for m in runs},
        "load_before": load_before,
        "load_after": load_average(),
        "targets": {"tracing_overhead": 0.02, "traces_mb": 10.0 if steps >= 500 and not args.quick else None},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
