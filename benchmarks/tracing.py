"""Tracing benchmark: what the default trace sampling costs the shipped demo, and what it writes.

What: the demo (examples/guess_number.toml) runs several times with tracing off
(`[telemetry] traces = false`: no span is recorded) and with tracing at the default sample
rate (`[telemetry] trace_sample`, the config model's default unless `--sample` says
otherwise), alternating off/on (ABBA order: run r of each mode is next to run r of the
other), each run a fresh `flotilla run` process tree. Reported:

* `tracing_overhead`: the median over the `--repeats` pairs of on / off - 1 of the training
  phase's wall time (metrics' `wall_s`, first step to last: process start-up and the first
  keyframe excluded), each pair two neighbouring runs. Target <= 0.02. This machine's speed
  drifts by more than the target over minutes (a mode's 800-step runs spread by up to 25%,
  benchmarks/records/2026-12-07-tracing-full.md), so the full mode runs many short pairs
  rather than a few runs of the demo's length: a pair's two runs share the machine's phase.
  `tracing_overhead_pairs` lists every pair's ratio; `tracing_overhead_mean` and
  `tracing_overhead_se` (their standard error) say how far the median can be trusted.
* `tracing_overhead_side_by_side`: the same ratio from runs off and on at the same time
  (`--pairs` pairs of `--pair-steps` steps, two process trees sharing the machine, which
  start in turn), median over the pairs; `side_by_side` lists each pair's. One run keeps the
  2 cores of this machine 85-90% busy; two at once oversubscribe them, so this reads
  what tracing adds to the CPU of a machine with no core to spare (with the timing changes
  it causes: benchmarks/records/2026-12-08-tracing-pairs.md), not the wall time of a run
  that has the machine to itself.
* `tracing_cpu_overhead`: the same median of pairs for the CPU seconds (user + system) of
  every process of the run (the CLI and its actors, from `getrusage(RUSAGE_CHILDREN)`, start-up
  included). It counts the polls of actors and callers that spin for their next message
  (docs/runtime-tuning.md) as well as work, so it moves with a run's timing too.
* `tracing_cpu_share`: what tracing adds to a rollout's CPU, measured by replaying: the span
  tree of one sampled rollout from a traced run's file (the median one by span count: the
  controller's `rollout`, the env actor's `rollout`, `env.step` and `generate` spans, the
  samplers' `sampler.generate`, each with the attributes it was written with; a child in
  another process than its parent is opened as the runtime does across a call: the
  caller's `traceparent`, then `adopt_remote_parent` in the call's own context on the
  callee's side) is opened again in one fresh process many times over, with tracing at
  the default rate (`on`: the run's rules, spans of the sampled 1 in 100 written to a
  file) and with tracing not configured (`off`, as in a `traces = false` run), rounds of
  each alternating. `replay_us_per_rollout` holds the two medians; their difference over
  the off runs' CPU per rollout (every process's CPU seconds / the rollouts the metrics
  count) is the share. Side by side in one process, the difference resolves what whole
  runs cannot: run-to-run drift here is several percent. It counts the tracing calls a
  rollout makes, warm; not what they cost in cache misses on a busy machine, nor the
  spans kept whatever the rate (a few per step, against a rollout's dozen per rollout).
* `traces_mb`: size of `traces.jsonl` of a traced run of the shipped demo (MB, 10^6 bytes):
  in the full mode, one more run at the demo's own steps (`--traces-steps`; 800, where issue
  30 set the bound <= 10 for 500); with `--quick` (or `--traces-steps 0`), the median of the
  traced runs above, with no target. `traces_mb_per_step` and `spans` too, and
  `traces_not_written` (spans left out at `traces_max_mb`; 0 unless the cap was reached).

Why: issue 30's "telemetry that scales": tracing every span of the demo wrote hundreds of
MB and cost several percent of the wall time.

How: `python benchmarks/tracing.py [--quick] [--repeats N] [--steps N] [--sample R]
[--pairs N] [--pair-steps N] [--traces-steps N] [--save-tree FILE]`; `--replay-tree FILE`
(a tree saved by `--save-tree`) runs only the replay and prints its JSON line, e.g. to
compare two checkouts on the same tree.
Full mode: 8 pairs of 150-step runs, then 2 side-by-side pairs of 150 steps, then one
traced run of the demo as shipped (about 40 minutes here). `--quick`: 20 steps and half the
prompts per step, 2 pairs, no side-by-side pairs, no separate traced run (a few minutes on a
quiet machine).
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import contextvars
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


def _run_cmd(root: Path, name: str, steps: int, sets: list[str]) -> tuple[list[str], dict[str, str]]:
    cmd = [sys.executable, "-m", "orchestrator.entry.cli", "run", str(DEMO), "--steps", str(steps), "--quiet"]
    for s in [f'run_root="{root}"', f'name="{name}"', *sets]:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return cmd, env


def _one_run(root: Path, name: str, steps: int, sets: list[str]) -> dict[str, Any]:
    """One `flotilla run` of the demo in its own process tree; its timings and trace file."""
    cmd, env = _run_cmd(root, name, steps, sets)
    cpu0, t0 = _children_cpu_s(), time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    total_s, cpu_s = time.monotonic() - t0, _children_cpu_s() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"tracing benchmark: run {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"name": name, "total_s": total_s, "cpu_s": cpu_s, **_read_run(root / name)}


def _side_by_side(root: Path, r: int, steps: int, modes: dict[str, list[str]]) -> dict[str, Any]:
    """The demo with tracing off and on at the same time, two process trees sharing the
    machine: whatever slows the machine meanwhile slows both. Started in turn, off first
    in even pairs."""
    names = {m: f"{m}-pair{r}" for m in modes}
    procs, logs = {}, {m: root / f"{names[m]}.stderr" for m in modes}
    for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
        cmd, env = _run_cmd(root, names[mode], steps, modes[mode])
        with logs[mode].open("wb") as err:
            procs[mode] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    for m, p in procs.items():
        if p.wait() != 0:
            tail = logs[m].read_text(errors="replace")[-3000:]
            raise SystemExit(f"tracing benchmark: run {names[m]} failed ({p.returncode}):\n{tail}")
    return {m: _read_run(root / names[m]) for m in modes}


def _read_run(run_dir: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trace = run_dir / "traces.jsonl"
    size = trace.stat().st_size if trace.exists() else 0
    spans = sum(1 for _ in trace.open()) if trace.exists() else 0
    return {
        "name": run_dir.name,
        "steps": len(rows),
        "train_s": rows[-1]["wall_s"] - rows[0]["wall_s"],
        "traces_bytes": size,
        "spans": spans,
        "traces_not_written": max((r.get("traces_not_written", 0) for r in rows), default=0),
        # `rollouts` is each step's batch; `dropped_total` is the run's count so far.
        "rollouts": sum(r.get("rollouts", 0) for r in rows) + (rows[-1].get("dropped_total", 0) if rows else 0),
    }


def _rollout_tree(trace: Path) -> dict[str, Any] | None:
    """The span tree of the median sampled rollout in a traced run's file (by span count),
    as nested ``{"name", "service", "attributes", "children"}``; None when it has none."""
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for line in trace.read_text().splitlines():
        try:
            s = json.loads(line)
        except ValueError:  # a line cut off at the end of a run
            continue
        by_trace.setdefault(s["trace_id"], []).append(s)
    trees = []
    for spans in by_trace.values():
        roots = [s for s in spans if s["parent_span_id"] is None]
        if len(roots) != 1 or roots[0]["name"] != "rollout" or any(s.get("sampled") is False for s in spans):
            continue
        kids: dict[str, list[dict[str, Any]]] = {}
        for s in sorted(spans, key=lambda s: s["start_ns"]):
            kids.setdefault(s["parent_span_id"], []).append(s)
        trees.append((len(spans), _node(roots[0], kids)))
    if not trees:
        return None
    trees.sort(key=lambda t: t[0])
    return trees[len(trees) // 2][1]


def _node(s: dict[str, Any], kids: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        "name": s["name"],
        "service": s["service"].split("[")[0],
        "attributes": s["attributes"],
        "children": [_node(c, kids) for c in kids.get(s["span_id"], [])],
    }


def _replay(tree: dict[str, Any], mode: str, sample: float, count: int, rounds: int) -> list[float]:
    """Open ``tree``'s spans ``count`` times per round in this process; seconds per rollout of
    each round. ``on``: tracing configured as a run configures it, writing to a temporary file."""
    from orchestrator.runtime import configure_tracing, span
    from orchestrator.runtime._tracing import adopt_remote_parent, current_traceparent
    from orchestrator.state.telemetry import ALWAYS_KEPT, KEPT_IF_FAILED

    def open_(n: dict[str, Any], service: str) -> None:
        if n["service"] != service:  # across a call: the request carries the trace context
            call = contextvars.copy_context()  # as the runtime runs each call: in a copy of its own
            call.run(adopt_remote_parent, current_traceparent())
            call.run(open_, n, n["service"])
            return
        with span(n["name"], **n["attributes"]):
            for c in n["children"]:
                open_(c, service)

    with tempfile.TemporaryDirectory(prefix="flotilla-replay-") as tmp:
        if mode == "on":
            configure_tracing(
                Path(tmp) / "traces.jsonl", "replay", sample=sample, always=ALWAYS_KEPT, tail=KEPT_IF_FAILED
            )
        per = []
        for _ in range(rounds):
            t0 = time.process_time()
            for _ in range(count):
                open_(tree, tree["service"])
            per.append((time.process_time() - t0) / count)
    return per


def _count(tree: dict[str, Any]) -> int:
    return 1 + sum(_count(c) for c in tree["children"])


def _replay_pair(tree_file: Path, sample: float, count: int, rounds: int) -> dict[str, float]:
    """Median seconds per replayed rollout, ``off`` and ``on``, each mode in its own fresh
    process (tracing can be configured once per process), their rounds alternating."""
    per: dict[str, list[float]] = {"off": [], "on": []}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for r in range(rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            out = subprocess.run(
                [sys.executable, __file__, "--replay-child", str(tree_file), mode, str(sample), str(count)],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                raise SystemExit(f"tracing benchmark: the {mode} replay failed:\n{out.stderr[-3000:]}")
            per[mode] += json.loads(out.stdout.strip().splitlines()[-1])
    return {m: statistics.median(v) for m, v in per.items()}


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--replay-child":
        tree = json.loads(Path(sys.argv[2]).read_text())
        print(json.dumps(_replay(tree, sys.argv[3], float(sys.argv[4]), int(sys.argv[5]), rounds=3)))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="20 steps, half the prompts per step, 2 repeats")
    p.add_argument("--repeats", type=int, default=None, help="runs per mode (default 8; 2 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 150; 20 with --quick)")
    p.add_argument("--sample", type=float, default=None, help="trace_sample of the traced runs (default: the config's)")
    p.add_argument("--pairs", type=int, default=None, help="side-by-side pairs (default 2; 0 with --quick)")
    p.add_argument("--pair-steps", type=int, default=None, help="steps per side-by-side run (default: --steps)")
    p.add_argument(
        "--traces-steps",
        type=int,
        default=None,
        help="steps of the traced run that measures traces_mb (default: the demo's; 0 with --quick: none)",
    )
    p.add_argument("--save-tree", type=Path, help="write the replayed rollout's span tree here (JSON)")
    p.add_argument("--replay-tree", type=Path, help="only replay this saved tree (no runs); print its JSON line")
    p.add_argument(
        "--replay-count", type=int, default=None, help="rollouts per replay round (default 5000; 1000 quick)"
    )
    args = p.parse_args()
    count = args.replay_count or (1000 if args.quick else 5000)
    if args.replay_tree is not None:
        sample = TelemetrySection().trace_sample if args.sample is None else args.sample
        per = _replay_pair(args.replay_tree, sample, count, rounds=2 if args.quick else 4)
        print(
            json.dumps(
                {
                    "benchmark": "tracing-replay",
                    "tree": str(args.replay_tree),
                    "trace_sample": sample,
                    "replay_us_per_rollout": {m: round(v * 1e6, 2) for m, v in per.items()},
                    "tracing_us_per_rollout": round((per["on"] - per["off"]) * 1e6, 2),
                }
            )
        )
        return
    steps = args.steps or (20 if args.quick else 150)
    repeats = args.repeats or (2 if args.quick else 8)
    traces_steps = (
        args.traces_steps if args.traces_steps is not None else (0 if args.quick else int(demo_raw()["steps"]))
    )
    sample = TelemetrySection().trace_sample if args.sample is None else args.sample
    if steps < 2 or repeats < 1 or traces_steps < 0 or not 0.0 <= sample <= 1.0:
        raise SystemExit(
            "tracing benchmark: --steps must be >= 2, --repeats >= 1, --traces-steps >= 0, --sample within [0, 1]"
        )
    scale = ["rollout.prompts_per_step=8", "rollout.max_buffered_groups=8"] if args.quick else []
    modes = {"off": ["telemetry.traces=false", *scale], "on": [f"telemetry.trace_sample={sample}", *scale]}
    load_before = load_average()
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    tree: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="flotilla-tracing-") as tmp:
        for r in range(repeats):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                out = _one_run(Path(tmp), f"{mode}-{r}", steps, modes[mode])
                runs[mode].append(out)
                trace = Path(tmp) / out["name"] / "traces.jsonl"
                if tree is None and trace.exists():  # the first traced run's, read once
                    tree = _rollout_tree(trace)
                print(
                    f"{mode:>3} #{r}: {out['steps']} steps, training {out['train_s']:.1f} s, "
                    f"total {out['total_s']:.1f} s, cpu {out['cpu_s']:.1f} s, "
                    f"traces {out['traces_bytes'] / 1e6:.2f} MB ({out['spans']} spans)",
                    flush=True,
                )

        pairs = []
        n_pairs = args.pairs if args.pairs is not None else (0 if args.quick else 2)
        for r in range(n_pairs):
            pair = _side_by_side(Path(tmp), r, args.pair_steps or steps, modes)
            pairs.append(pair["on"]["train_s"] / pair["off"]["train_s"] - 1)
            print(
                f"side by side #{r}: training off {pair['off']['train_s']:.1f} s, on {pair['on']['train_s']:.1f} s "
                f"({pairs[-1]:+.2%}); rollouts off {pair['off']['rollouts']}, on {pair['on']['rollouts']}",
                flush=True,
            )

        traced = runs["on"]
        if traces_steps:
            traced = [_one_run(Path(tmp), "traces", traces_steps, modes["on"])]
            print(
                f"traced run: {traced[0]['steps']} steps, traces {traced[0]['traces_bytes'] / 1e6:.2f} MB "
                f"({traced[0]['spans']} spans)",
                flush=True,
            )

    on_bytes = statistics.median(r["traces_bytes"] for r in traced)
    traced_steps = traces_steps or steps

    def paired(key: str) -> list[float]:
        """on / off - 1 of `key` for each pair of neighbouring runs."""
        return [on[key] / off[key] - 1 for off, on in zip(runs["off"], runs["on"], strict=True)]

    ratios = paired("train_s")
    se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None
    if tree is None:
        raise SystemExit("tracing benchmark: no traced run wrote a sampled rollout to replay")
    with tempfile.TemporaryDirectory(prefix="flotilla-tree-") as tmp:
        tree_file = args.save_tree or Path(tmp) / "tree.json"
        tree_file.write_text(json.dumps(tree))
        replay = _replay_pair(tree_file, sample, count, rounds=2 if args.quick else 4)
    # Every process's CPU per rollout in the off runs, start-up taken out in proportion to
    # its share of the wall time (it uses less CPU than training, so this errs high).
    cpu_per_rollout = statistics.median(r["cpu_s"] * r["train_s"] / r["total_s"] / r["rollouts"] for r in runs["off"])
    tracing_s = replay["on"] - replay["off"]
    result = {
        "benchmark": "tracing",
        "quick": args.quick,
        "steps": steps,
        "repeats": repeats,
        "trace_sample": sample,
        "tracing_overhead": round(statistics.median(ratios), 4),
        "tracing_overhead_pairs": [round(x, 4) for x in ratios],
        "tracing_overhead_mean": round(statistics.fmean(ratios), 4),
        "tracing_overhead_se": None if se is None else round(se, 4),
        "tracing_overhead_side_by_side": round(statistics.median(pairs), 4) if pairs else None,
        "side_by_side": [round(x, 4) for x in pairs],
        "tracing_cpu_overhead": round(statistics.median(paired("cpu_s")), 4),
        "tracing_cpu_share": round(tracing_s / cpu_per_rollout, 4),
        "replay_us_per_rollout": {m: round(v * 1e6, 2) for m, v in replay.items()},
        "tracing_us_per_rollout": round(tracing_s * 1e6, 2),
        "cpu_us_per_rollout_off": round(cpu_per_rollout * 1e6, 1),
        "replay_spans": _count(tree),
        "traces_steps": traced_steps,
        "traces_mb": round(on_bytes / 1e6, 3),
        "traces_mb_per_step": round(on_bytes / 1e6 / traced_steps, 5),
        "spans": int(statistics.median(r["spans"] for r in traced)),
        "traces_not_written": max(r["traces_not_written"] for r in [*runs["on"], *traced]),
        "off_traces_bytes": max(r["traces_bytes"] for r in runs["off"]),
        "train_s": {m: [round(r["train_s"], 2) for r in runs[m]] for m in runs},
        "cpu_s": {m: [round(r["cpu_s"], 2) for r in runs[m]] for m in runs},
        "total_s": {m: [round(r["total_s"], 2) for r in runs[m]] for m in runs},
        "load_before": load_before,
        "load_after": load_average(),
        "targets": {"tracing_overhead": 0.02, "traces_mb": 10.0 if traced_steps >= 500 and not args.quick else None},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
