"""Does a config learn on every seed? Runs it over seeds 0-4 and reports when each reaches 0.8.

What: runs CONFIG (e.g. examples/guess_number.toml) once per seed N with
`seed = N` and `model.seed = N` (the same as `flotilla run CONFIG --set seed=N
--set model.seed=N`), each in its own temporary run directory, one after another.
Per seed it prints the first step whose 10-step mean reward (steps s-9..s) is >= 0.8,
the run clock at that step (`wall_s` of metrics.jsonl: seconds since the controller
started, actors already up) and the same plus the run's start-up (process launch to
the controller's first step, measured here), the final 10-step mean and the final
entropy. The last line is JSON with `seeds`, `runs`, `runs_meeting_bar` (runs that
reached 0.8 within 300 s of run clock and ended >= 0.8: issue 32's bar), `seeds_reaching`
(runs whose 10-step mean reached 0.8), `worst_time_to_0_8_s` (run clock; null when a seed never reached
it), `worst_time_to_0_8_with_startup_s` and `worst_final` (lowest final 10-step
mean), plus the load average before and after and each run's CPU seconds (this
process and its actor processes: a load-independent measure of the run's cost).

Why: issue 11 asks that the demo and examples/arithmetic.toml reach a 10-step mean
reward >= 0.8 within 300 s on every seed 0-4 and end with their last 10 steps >= 0.8.
Timings on a shared machine are inflated by others' load: read them next to the load
average.

Run:  .venv/bin/python benchmarks/demo_seeds.py examples/guess_number.toml
      .venv/bin/python benchmarks/demo_seeds.py examples/arithmetic.toml --quick   (seed 0, 30 steps)
Options: --seeds 0,1,2 (a subset), --steps N, --set KEY=VALUE (repeatable, like
`flotilla run --set`), --repeats N (every seed N times: async runs are not
bit-reproducible, so a seed's outcome is a distribution; runs are keyed SEED.REPEAT), --jobs N (seeds in N processes at once: the reward figures are
the same kind, but each seed's wall time then includes the others' load).

Side by side: --compare KEY=VALUE (repeatable) runs every seed twice, as configured and
with these overrides (e.g. `--compare rollout.filter_zero_variance=true`), and the JSON
line then holds both sets of figures under `base` and `compared`, each with its sampler
tokens per trained token (every pool's generated tokens ÷ the tokens the trainer
trained on) and zero-variance groups dropped.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
import tomllib
from pathlib import Path
from typing import Any

from _runs import load_average, run_raw

TARGET = 0.8
WINDOW = 10
BAR_S = 300.0  # issue 32's bar: the 10-step mean reaches TARGET within this run clock, and ends >= TARGET


def reward_figures(metrics: list[dict[str, Any]], target: float = TARGET, window: int = WINDOW) -> dict[str, Any]:
    """First step whose trailing `window`-step mean reward is >= target (with its run clock),
    the final `window`-step mean, the final step's entropy, and the trailing mean every
    100 steps."""
    rewards = [m["reward_mean"] for m in metrics]
    if not rewards:
        raise SystemExit("demo_seeds: a run ended without a single step in metrics.jsonl")
    first_step = first_wall = None
    for i in range(window - 1, len(rewards)):
        if statistics.fmean(rewards[i - window + 1 : i + 1]) >= target:
            first_step, first_wall = metrics[i]["step"], metrics[i]["wall_s"]
            break
    return {
        "steps": len(metrics),
        "step_to_target": first_step,
        "wall_to_target_s": first_wall,
        "final": statistics.fmean(rewards[-window:]),
        "peak": max(
            (statistics.fmean(rewards[i - window + 1 : i + 1]) for i in range(window - 1, len(rewards))),
            default=statistics.fmean(rewards),
        ),
        "final_entropy": metrics[-1].get("entropy"),
        # the trailing mean every 100 steps: whether a run that missed was still rising
        "curve": {
            metrics[i]["step"]: round(statistics.fmean(rewards[max(0, i - window + 1) : i + 1]), 3)
            for i in range(len(rewards))
            if (i + 1) % 100 == 0
        },
    }


def token_figures(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Sampler tokens (every pool's, to the last step), trained tokens (summed over steps)
    and their ratio; zero-variance groups dropped by the last step."""
    last = metrics[-1]
    sampled = sum(int(p.get("tokens") or 0) for p in last.get("pools", {}).values())
    trained = sum(int(m.get("trained_tokens") or 0) for m in metrics)
    return {
        "sampler_tokens": sampled,
        "trained_tokens": trained,
        "sampler_per_trained_token": sampled / trained if trained else None,
        "zero_variance_groups": last.get("zero_variance_groups"),
    }


def _cpu_s() -> float:
    """CPU seconds of this process and of its waited-for children (the run's actors)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _parse_set(items: list[str]) -> list[tuple[list[str], Any]]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value  # a bare string
        out.append((key.split("."), parsed))
    return out


def build_raw(base: dict[str, Any], seed: int, steps: int | None, sets: list[tuple[list[str], Any]]) -> dict[str, Any]:
    """`base` with the seed overrides (run and model), optional steps and --set overrides."""
    import copy

    raw = copy.deepcopy(base)
    raw["seed"] = seed
    raw.setdefault("model", {})["seed"] = seed
    raw["name"] = f"{raw.get('name', 'run')}-s{seed}"
    if steps is not None:
        raw["steps"] = steps
    for path, value in sets:
        node = raw
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return raw


def run_seed(raw: dict[str, Any]) -> dict[str, Any]:
    """Run one config to completion; its reward figures, wall and CPU seconds, load."""
    import torch

    torch.set_num_threads(1)
    t0, cpu0 = time.monotonic(), _cpu_s()
    out = run_raw(raw, keep_spans=False)
    total, cpu = time.monotonic() - t0, _cpu_s() - cpu0
    fig = reward_figures(out.metrics) | token_figures(out.metrics)
    # Start-up: launch to the controller's clock zero; the run's own clock (wall_s)
    # ends at its last step, shutdown follows. total - last wall_s bounds both.
    last_wall = out.metrics[-1]["wall_s"] if out.metrics else 0.0
    fig["startup_and_shutdown_s"] = round(total - last_wall, 1)
    fig["total_s"] = round(total, 1)
    fig["cpu_s"] = round(cpu, 1)
    fig["load_avg"] = load_average()
    return fig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", type=Path, help="run config (TOML)")
    p.add_argument("--quick", action="store_true", help="seed 0 only, 30 steps (a smoke test, < 1 min)")
    p.add_argument("--seeds", help="comma-separated seeds (default 0,1,2,3,4)")
    p.add_argument("--steps", type=int, help="override the config's steps")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="also run every seed with this override and report both side by side (repeatable)",
    )
    p.add_argument(
        "--jobs", type=int, default=1, help="seeds run at once (default 1; more inflates each seed's wall time)"
    )
    p.add_argument("--repeats", type=int, default=1, help="runs per seed (default 1; async runs differ between runs)")
    args = p.parse_args()
    try:
        with open(args.config, "rb") as f:
            base = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SystemExit(f"demo_seeds: cannot read {args.config}: {e}") from None
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else ([0] if args.quick else list(range(5)))
    steps = args.steps or (30 if args.quick else None)
    sets = _parse_set(args.set)

    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    compare = _parse_set(args.compare)
    labels = ["base", "compared"] if compare else ["base"]
    load_before = load_average()
    # With --compare, each seed runs as configured and then compared, one after the other,
    # so both see about the same load. With --repeats, every seed once, then again.
    runs = [f"{seed}" if args.repeats == 1 else f"{seed}.{r}" for r in range(args.repeats) for seed in seeds]
    jobs = [(label, run) for run in runs for label in labels]
    raws = [
        build_raw(base, int(run.split(".")[0]), steps, sets + (compare if label == "compared" else []))
        for label, run in jobs
    ]
    if args.jobs == 1:
        results = map(run_seed, raws)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"))
        results = pool.map(run_seed, raws)
    rows: dict[str, dict[str, dict[str, Any]]] = {label: {} for label in labels}
    for (label, run), fig in zip(jobs, results, strict=True):
        rows[label][run] = fig
        total, cpu = fig["total_s"], fig["cpu_s"]
        reach = (
            f"step {fig['step_to_target']} at {fig['wall_to_target_s']:.0f} s "
            f"(+{fig['startup_and_shutdown_s']:.0f} s start-up/shutdown)"
            if fig["step_to_target"] is not None
            else "never"
        )
        ent = fig["final_entropy"]
        ratio = fig["sampler_per_trained_token"]
        print(
            f"{label + ' ' if compare else ''}seed {run}: 10-step mean >= {TARGET}: {reach}; final 10-step mean "
            f"{fig['final']:.3f} (peak {fig['peak']:.3f}); final entropy {ent if ent is None else round(ent, 3)}; "
            f"{fig['steps']} steps in {total:.0f} s ({cpu:.0f} CPU-s); sampler/trained tokens "
            f"{ratio if ratio is None else round(ratio, 3)}; load {fig['load_avg']}",
            flush=True,
        )
    load_after = load_average()
    out: dict[str, Any] = {
        "benchmark": "demo_seeds",
        "config": str(args.config),
        "quick": args.quick,
        "overrides": args.set,
        "steps": steps or base.get("steps"),
        "seeds": seeds,
        "repeats": args.repeats,
    }
    if compare:
        out["compare"] = args.compare
        out["base"] = summary(rows["base"])
        out["compared"] = summary(rows["compared"])
    else:
        out |= summary(rows["base"])
    out |= {"jobs": args.jobs, "load_avg_before": load_before, "load_avg_after": load_after}
    print(json.dumps(out))


def meets_bar(fig: dict[str, Any]) -> bool:
    """Issue 32's bar for one run: the 10-step mean reached TARGET within BAR_S of run
    clock, and the final 10-step mean is >= TARGET."""
    t = fig["wall_to_target_s"]
    return t is not None and t <= BAR_S and fig["final"] >= TARGET


def summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Figures over runs (keyed "SEED", or "SEED.REPEAT" with --repeats)."""
    reached = [s for s, r in rows.items() if r["step_to_target"] is not None]
    times = [r["wall_to_target_s"] for r in rows.values()]
    with_startup = [
        None if r["wall_to_target_s"] is None else r["wall_to_target_s"] + r["startup_and_shutdown_s"]
        for r in rows.values()
    ]
    ratios = [r["sampler_per_trained_token"] for r in rows.values() if r["sampler_per_trained_token"] is not None]
    return {
        "runs": len(rows),
        "runs_meeting_bar": sum(meets_bar(r) for r in rows.values()),
        "seeds_reaching": len(reached),
        "worst_time_to_0_8_s": None if None in times else max(times),
        "mean_time_to_0_8_s": round(statistics.fmean(t for t in times if t is not None), 1) if reached else None,
        "worst_time_to_0_8_with_startup_s": None if None in with_startup else round(max(with_startup), 1),
        "worst_final": round(min(r["final"] for r in rows.values()), 4),
        "mean_sampler_per_trained_token": round(statistics.fmean(ratios), 4) if ratios else None,
        "per_seed": {
            s: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for s, r in rows.items()
        },
    }


if __name__ == "__main__":
    main()
