"""Recipe stability where the mismatch bites: each component removed, over several seeds, run to a plateau.

What: the demo task and model (examples/guess_number.toml: its batch shape, learning
rate, sampling settings including `min_keep`), trained asynchronously from a single FP8
pool with staleness budget `--budget` (default 4; the demo's FP8 pool has 4 too), so
every trajectory comes from block-FP8 weights up to 4 versions behind the trainer's
fp32 master weights. (The tiny model's matrices are at most 128 wide on one side,
so block FP8 with 128x128 blocks is close to per-tensor FP8 here: already coarse.)
Variants (policies.RecipeConfig switches, as in benchmarks/ablation.py):

* onpolicy      the reference: one BF16 pool, `mode = "sync"` (generate, train, sync:
                staleness 0; the only mismatch is BF16 rounding), full recipe
* full          mask_replay, importance "mis", score_centering (the recipe)
* plain_grpo    no replay, no importance weights, no centering
* no_replay     no replay (and so no centering), MIS kept
* no_is         importance "none" (replay and centering kept)
* no_centering  score_centering false (replay and MIS kept)

Per run: final reward (mean of the last 10 steps), AUC (mean reward over all steps),
peak 10-step mean, drawdown (the largest fall of the 10-step mean below an earlier
peak of it), collapse (drawdown > 0.2), max grad norm (before clipping) and mean
mismatch KL (k3 estimate). Per variant: means over seeds (max grad norm: the max),
final-reward spread, and the number of collapsed runs. The table goes in a dated record
under benchmarks/records/.

Why: docs/architecture.md (The recipe) claims each component matters once samples come from
a mismatched, stale sampler. benchmarks/ablation.py checks that over a few dozen steps; this runs long
enough for the full recipe to plateau (default: the demo's own step count) and counts
collapses, which short runs cannot show. Seeds are `seed` and `model.seed` together.

Run:  .venv/bin/python benchmarks/stability.py            (6 variants x 3 seeds x the demo's steps; about 90 min on 2 quiet cores at 800 steps)
      .venv/bin/python benchmarks/stability.py --quick    (6 variants x 1 seed x 4 steps: a smoke test of the pipeline)
Options: --steps N, --seeds K, --variants a,b,..., --budget B (FP8 staleness budget),
--record FILE (append each run's figures; runs already there are skipped, so a stopped
comparison resumes), --report (with --record: the table of what is recorded, no runs).
Runs go seed by seed (all variants' seed 0 first).
Sweep:  .venv/bin/python benchmarks/stability.py --sweep [--levels bf16:0,fp8:4,...] [--plot FILE]
      the mismatch-tolerance curve (benchmarks/_sweep.py): every level of sampler precision
      (bf16, fp8, int4, int3, int2) x staleness budget (0, 2, 4, 8, 16) with the variants full,
      plain_grpo, tis, icepop, seq_mask, no_replay, no_centering, and the on-policy
      reference; 3 seeds x 300 steps by default (hours: use --record). --sweep --quick:
      level int4:4, 1 seed, 2 steps (a smoke test of the pipeline, same keys). Its last line:
      JSON with `full_tolerance_ratio` (and `full_tolerance_lower_bound` /
      `full_tolerance_upper_bound` when one variant never dropped), `collapses` per
      variant and the cell table.
Last line (without --sweep): JSON with `onpolicy_final`, `full_final`, `plain_grpo_final`, `no_replay_final`,
`no_is_final`, `no_centering_final`, `full_collapses`, `plain_grpo_collapses` and
per-variant details.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import _sweep
from _runs import demo_raw, load_average, run_variants
from ablation import FP8_BUDGET, VARIANTS
from ablation import build_raw as ablation_raw

from policies.config import RecipeConfig

WINDOW = 10
COLLAPSE_DROP = 0.2
ORDER = ["onpolicy", "full", "plain_grpo", "no_replay", "no_is", "no_centering"]


def build_raw(variant: str, seed: int, steps: int, budget: int) -> dict[str, Any]:
    """The run config of one (variant, seed): ablation.py's FP8-only config with `budget`,
    or, for `onpolicy`, the demo's BF16 pool alone in sync mode."""
    if variant != "onpolicy":
        raw = ablation_raw(variant, seed, steps, with_bf16=False)
        for pool in raw["pools"]:
            pool["staleness_budget"] = budget
        raw["name"] = f"stability-{variant}-s{seed}"
        return raw
    raw = demo_raw()
    raw.update(name=f"stability-onpolicy-s{seed}", mode="sync", steps=steps, seed=seed)
    raw.setdefault("model", {})["seed"] = seed
    bf16 = [p for p in raw["pools"] if p["precision"] == "bf16"]
    if not bf16:
        raise SystemExit(f"stability: the demo config has no BF16 pool for the on-policy reference ({raw['pools']})")
    raw["pools"] = bf16[:1]
    return raw


def trailing_means(rewards: list[float], window: int = WINDOW) -> list[float]:
    """Mean of steps max(0, i-window+1)..i for each step i (shorter at the start)."""
    return [statistics.fmean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]


def run_figures(metrics: list[dict[str, Any]], window: int = WINDOW) -> dict[str, float]:
    """Final/AUC/peak/drawdown/collapse/grad norm/mismatch KL of one run's metrics."""
    rewards = [m["reward_mean"] for m in metrics]
    means = trailing_means(rewards, window)[window - 1 :] or trailing_means(rewards, window)[-1:]
    peak, drawdown = float("-inf"), 0.0
    for m in means:
        peak = max(peak, m)
        drawdown = max(drawdown, peak - m)
    kls = [m["mismatch_kl"] for m in metrics if m.get("mismatch_kl") is not None]
    grad_norms = [m["grad_norm"] for m in metrics if m.get("grad_norm") is not None]
    return {
        "final_reward": statistics.fmean(rewards[-window:]),
        "auc_reward": statistics.fmean(rewards),
        "peak_reward": max(means),
        "drawdown": drawdown,
        "collapsed": float(drawdown > COLLAPSE_DROP),
        "max_grad_norm": max(grad_norms) if grad_norms else float("nan"),
        "mismatch_kl": statistics.fmean(kls) if kls else float("nan"),
        "zero_grad_steps": float(sum(1 for g in grad_norms if g == 0.0)),
    }


def summarize(per_seed: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in per_seed[0]:
        vals = [r[key] for r in per_seed]
        if key == "max_grad_norm":
            out[key] = round(max(vals), 5)
        elif key == "collapsed":
            out["collapses"] = int(sum(vals))
        else:
            out[key] = float(f"{statistics.fmean(vals):.4g}")  # 4 significant digits (KL can be ~1e-7)
    finals = [r["final_reward"] for r in per_seed]
    out["final_reward_min"], out["final_reward_max"] = round(min(finals), 4), round(max(finals), 4)
    out["final_reward_per_seed"] = [round(f, 4) for f in finals]
    out["drawdown_per_seed"] = [round(r["drawdown"], 4) for r in per_seed]
    return out


def describe(name: str) -> tuple[str, str, str, str]:
    """(pool, replay, IS, centering) columns of the table."""
    if name == "onpolicy":
        return "BF16, sync", "True", "mis", "True"
    v = VARIANTS[name]
    return "FP8, async", str(v["mask_replay"]), v["importance"], str(v["score_centering"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="every variant, 1 seed, 4 steps (a smoke test)")
    p.add_argument("--steps", type=int, help="steps per run (default: the demo's steps; quick 4)")
    p.add_argument("--seeds", type=int, help="seeds per variant (default 3; quick 1)")
    p.add_argument("--variants", help=f"comma-separated subset of {','.join(ORDER)}")
    p.add_argument("--budget", type=int, default=FP8_BUDGET, help=f"FP8 pool staleness budget (default {FP8_BUDGET})")
    p.add_argument(
        "--record",
        type=Path,
        help="append each finished run's figures to this JSON-lines file and skip runs it "
        "already has (same --steps): the full comparison can be stopped and resumed",
    )
    p.add_argument(
        "--report", action="store_true", help="with --record: print the table of the recorded runs, run nothing"
    )
    p.add_argument("--sweep", action="store_true", help="the mismatch-tolerance sweep (see the module docstring)")
    p.add_argument("--levels", help="--sweep: comma-separated PRECISION:BUDGET levels (default: the whole grid)")
    p.add_argument("--plot", type=Path, help="--sweep: write the final-reward-against-KL plot (PNG) here")
    args = p.parse_args()
    if args.report and args.record is None:
        p.error("--report needs --record")
    if args.sweep:
        sweep_main(p, args)
        return
    demo = demo_raw()
    steps = args.steps or (4 if args.quick else int(demo["steps"]))
    n_seeds = args.seeds or (1 if args.quick else 3)
    names = args.variants.split(",") if args.variants else ORDER
    unknown = [v for v in names if v not in ORDER]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {ORDER}")
    if args.budget < 0:
        p.error(f"--budget must be >= 0, got {args.budget}")

    import torch

    torch.set_num_threads(1)
    load_before = load_average()
    t0 = time.monotonic()
    runs = run_variants(
        names,
        n_seeds,
        steps,
        lambda name, seed: build_raw(name, seed, steps, args.budget),
        run_figures,
        record=args.record,
        run=not args.report,
    )
    if not runs:
        raise SystemExit(f"stability: no runs recorded in {args.record} with {steps} steps")
    results: dict[str, dict[str, Any]] = {name: summarize(per_seed) for name, per_seed in runs.items()}
    total = time.monotonic() - t0
    load_after = load_average()

    rec = {**RecipeConfig().model_dump(), **demo.get("recipe", {})}  # the demo's, over the defaults
    print(
        f"\nguess_number {demo['task'].get('params')}, {demo['rollout']['prompts_per_step']} prompts x "
        f"{demo['rollout']['group_size']} rollouts per step, lr {demo['trainer']['lr']}, top_p {rec.get('top_p')}, "
        f"min_keep {rec.get('min_keep', 'default')}; FP8 pool staleness budget {args.budget}; {steps} steps, "
        f"up to {n_seeds} seed(s) per variant (the collapses column says how many ran); final = mean reward of the last {WINDOW} steps, AUC = mean reward over "
        f"all steps, collapse = the {WINDOW}-step mean fell > {COLLAPSE_DROP} below its earlier peak; means over "
        f"seeds (max grad norm: max over seeds)"
    )
    print(f"load average before {load_before}, after {load_after}; {total:.0f}s\n")
    print(
        "| variant | pool | replay | IS | centering | final reward (min..max) | AUC | peak | collapses "
        "| max grad norm | mismatch KL |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        pool, replay, isw, cent = describe(name)
        print(
            f"| {name} | {pool} | {replay} | {isw} | {cent} | {r['final_reward']:.3f} "
            f"({r['final_reward_min']:.3f}..{r['final_reward_max']:.3f}) | {r['auc_reward']:.3f} | "
            f"{r['peak_reward']:.3f} | {r['collapses']}/{len(runs[name])} | {r['max_grad_norm']:.3g} | "
            f"{r['mismatch_kl']:.3g} |"
        )

    def fig(name: str, key: str) -> Any:
        return results[name][key] if name in results else None

    print(
        json.dumps(
            {
                "benchmark": "stability",
                "quick": args.quick,
                "steps": steps,
                "seeds": n_seeds,
                "fp8_staleness_budget": args.budget,
                "variants_run": list(results),
                "seeds_run": {name: len(per_seed) for name, per_seed in runs.items()},
                **{f"{n}_final": fig(n, "final_reward") for n in ORDER},
                "full_collapses": fig("full", "collapses"),
                "plain_grpo_collapses": fig("plain_grpo", "collapses"),
                "load_avg_before": load_before,
                "load_avg_after": load_after,
                "total_s": round(total, 1),
                "variants": results,
            }
        )
    )


def sweep_main(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--sweep`: run (or, with --report, read) the sweep and print its table and JSON line."""
    steps = args.steps or (2 if args.quick else 300)
    n_seeds = args.seeds or (1 if args.quick else 3)
    levels = (
        args.levels.split(",") if args.levels else list(_sweep.QUICK_LEVELS) if args.quick else _sweep.default_levels()
    )
    for lv in levels:
        try:
            _sweep.parse_level(lv)
        except ValueError as exc:
            p.error(f"--levels: {exc}")
    variants = args.variants.split(",") if args.variants else list(_sweep.SWEEP_VARIANTS)
    unknown = [v for v in variants if v not in _sweep.SWEEP_VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(_sweep.SWEEP_VARIANTS)}")

    import torch

    torch.set_num_threads(1)
    load_before = load_average()
    t0 = time.monotonic()
    runs = run_variants(
        _sweep.run_names(levels, variants),
        n_seeds,
        steps,
        lambda name, seed: _sweep.build_sweep_raw(name, seed, steps),
        run_figures,
        record=args.record,
        run=not args.report,
    )
    if not runs:
        raise SystemExit(f"stability --sweep: no runs recorded in {args.record} with {steps} steps")
    table = _sweep.cells(runs)
    total = time.monotonic() - t0
    load_after = load_average()
    tol = _sweep.tolerance(table, levels)
    plotted = _sweep.plot(table, levels, variants, args.plot) if args.plot else False

    print(
        f"\nmismatch sweep: guess_number, {steps} steps, up to {n_seeds} seed(s) per cell; cell = final reward "
        f"(mean measured mismatch KL, collapsed runs/seeds); on-policy reference (BF16, sync) "
        f"{tol['onpolicy_final']}"
    )
    print(f"load average before {load_before}, after {load_after}; {total:.0f}s\n")
    print(_sweep.markdown_table(table, levels, variants))
    print(
        json.dumps(
            {
                "benchmark": "stability_sweep",
                "quick": args.quick,
                "steps": steps,
                "seeds": n_seeds,
                "levels": levels,
                "variants_run": variants,
                **tol,
                "collapses": _sweep.collapses_by_variant(table, levels, variants),
                "full_fewer_collapses_than_plain_grpo": _sweep.full_fewer_collapses(table, levels),
                "cells_run": len(table),
                "plot": str(args.plot) if plotted else None,
                "load_avg_before": load_before,
                "load_avg_after": load_after,
                "total_s": round(total, 1),
                "cells": table,
            }
        )
    )


if __name__ == "__main__":
    main()
