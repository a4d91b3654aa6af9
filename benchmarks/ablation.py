"""Recipe ablation under sampler mismatch: the full recipe vs plain GRPO vs each part removed.

What: the demo task (examples/guess_number.toml: guess_number, the tiny random-init
model, its batch shape and learning rate), trained asynchronously from an FP8 sampler
pool only (staleness budget 4), so every trajectory comes from weights that differ from
the trainer's fp32 master weights by FP8 quantisation and by up to 4 versions. Variants
(policies.RecipeConfig switches):

* full          mask_replay, importance "mis", score_centering (the recipe)
* plain_grpo    mask_replay false, importance "none", score_centering false
* no_replay     mask_replay false, score_centering false (RecipeConfig refuses centering
                without replay: the centering sum runs over the replayed support), "mis"
* no_is         importance "none" (replay and centering kept)
* no_centering  score_centering false (replay and MIS kept)

Each variant runs with 3 seeds (the run's `seed`, which drives tasks and sampling, and
`model.seed`, the random init). Per run: final reward (mean reward of the last 5 steps),
area under the reward curve (mean reward over all steps), max grad norm (before
clipping), mean mismatch KL (k3 estimate, over steps), mean masked fraction (MIS) and
mean staleness; per variant the mean over seeds and the spread (min..max) of the final
reward.

Why: docs/architecture.md (The recipe) claims each component of the recipe matters once
samples come from a mismatched, stale sampler. This is a small-scale check of that claim; there is no
target and at this scale (a ~90k-parameter model, a few dozen steps) the differences
may well be within seed noise. The table says what it shows.

Run:  .venv/bin/python benchmarks/ablation.py          (5 variants x 3 seeds x 30 steps, ~10-15 min on 2 cores)
      .venv/bin/python benchmarks/ablation.py --quick  (full and plain_grpo, 1 seed, 6 steps; < 60 s)
Options: --steps N, --seeds K, --variants a,b,..., --with-bf16 (add the demo's BF16 pool,
staleness budget 2, next to the FP8 one). Each run has its own temporary run directory,
removed afterwards. Last line: JSON with one entry per variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from _runs import demo_raw, load_average, run_variants

VARIANTS: dict[str, dict[str, Any]] = {
    "full": {"mask_replay": True, "importance": "mis", "score_centering": True},
    "plain_grpo": {"mask_replay": False, "importance": "none", "score_centering": False},
    "no_replay": {"mask_replay": False, "importance": "mis", "score_centering": False},
    "no_is": {"mask_replay": True, "importance": "none", "score_centering": True},
    "no_centering": {"mask_replay": True, "importance": "mis", "score_centering": False},
}
FP8_BUDGET = 4
LAST_STEPS = 5


def build_raw(variant: str, seed: int, steps: int, with_bf16: bool) -> dict[str, Any]:
    raw = demo_raw()
    raw.update(name=f"ablation-{variant}-s{seed}", mode="async", steps=steps, seed=seed)
    raw.setdefault("model", {})["seed"] = seed
    fp8 = [p for p in raw["pools"] if p["precision"] == "fp8"]
    bf16 = [p for p in raw["pools"] if p["precision"] == "bf16"]
    if not fp8:
        raise SystemExit(f"ablation: the demo config has no FP8 pool to ablate against ({raw['pools']})")
    fp8[0]["staleness_budget"] = FP8_BUDGET
    raw["pools"] = fp8[:1] + (bf16[:1] if with_bf16 else [])
    raw["recipe"] = {**raw.get("recipe", {}), **VARIANTS[variant]}
    return raw


def run_figures(metrics: list[dict[str, Any]], last: int) -> dict[str, float]:
    rewards = [m["reward_mean"] for m in metrics]
    kls = [m["mismatch_kl"] for m in metrics if m.get("mismatch_kl") is not None]
    masked = [m["masked_fraction"] for m in metrics if m.get("masked_fraction") is not None]
    return {
        "final_reward": statistics.fmean(rewards[-last:]),
        "auc_reward": statistics.fmean(rewards),
        "max_grad_norm": max(m["grad_norm"] for m in metrics),
        "mismatch_kl": statistics.fmean(kls) if kls else float("nan"),
        "masked_fraction": statistics.fmean(masked) if masked else float("nan"),
        "staleness_mean": statistics.fmean(m["staleness_mean"] for m in metrics),
        "dropped_stale": metrics[-1]["dropped_stale"],
    }


def summarize(per_seed: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in per_seed[0]:
        vals = [r[key] for r in per_seed]
        out[key] = round(max(vals) if key == "max_grad_norm" else statistics.fmean(vals), 5)
    finals = [r["final_reward"] for r in per_seed]
    out["final_reward_min"], out["final_reward_max"] = round(min(finals), 4), round(max(finals), 4)
    out["final_reward_per_seed"] = [round(f, 4) for f in finals]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="full vs plain_grpo, 1 seed, 6 steps (< 60 s)")
    p.add_argument("--steps", type=int, help="steps per run (default 30; quick 6)")
    p.add_argument("--seeds", type=int, help="seeds per variant (default 3; quick 1)")
    p.add_argument("--variants", help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--with-bf16", action="store_true", help="add the demo's BF16 pool next to the FP8 one")
    args = p.parse_args()
    steps = args.steps or (6 if args.quick else 30)
    n_seeds = args.seeds or (1 if args.quick else 3)
    names = args.variants.split(",") if args.variants else ["full", "plain_grpo"] if args.quick else list(VARIANTS)
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    last = min(LAST_STEPS, max(1, steps // 2))

    import torch

    torch.set_num_threads(1)
    load_before = load_average()
    t0 = time.monotonic()
    runs = run_variants(
        names,
        n_seeds,
        steps,
        lambda name, seed: build_raw(name, seed, steps, args.with_bf16),
        lambda metrics: run_figures(metrics, last),
    )
    results: dict[str, dict[str, Any]] = {
        name: {**VARIANTS[name], **summarize(per_seed)} for name, per_seed in runs.items()
    }
    total = time.monotonic() - t0
    load_after = load_average()

    demo = demo_raw()
    pools = f"FP8 pool (staleness budget {FP8_BUDGET})" + (" + BF16 pool (budget 2)" if args.with_bf16 else "")
    print(
        f"\nguess_number {demo['task'].get('params')}, {demo['rollout']['prompts_per_step']} prompts x "
        f"{demo['rollout']['group_size']} rollouts per step, lr {demo['trainer']['lr']}, async, {pools}; "
        f"{steps} steps, {n_seeds} seed(s) per variant; final = mean reward of the last {last} steps, "
        f"AUC = mean reward over all steps; means over seeds (max grad norm: max over seeds)"
    )
    print(f"load average before {load_before}, after {load_after}; {total:.0f}s\n")
    cols = ("final_reward", "auc_reward", "max_grad_norm", "mismatch_kl", "masked_fraction", "staleness_mean")
    print(
        "| variant | replay | IS | centering | final reward (min..max) | AUC | max grad norm | mismatch KL "
        "| masked | staleness |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['mask_replay']} | {r['importance']} | {r['score_centering']} | "
            f"{r['final_reward']:.3f} ({r['final_reward_min']:.3f}..{r['final_reward_max']:.3f}) | "
            + " | ".join(f"{r[c]:.4g}" for c in cols[1:])
            + " |"
        )
    print(
        json.dumps(
            {
                "benchmark": "ablation",
                "quick": args.quick,
                "steps": steps,
                "seeds": n_seeds,
                "final_last_steps": last,
                "pools": pools,
                "variants_run": names,
                "load_avg_before": load_before,
                "load_avg_after": load_after,
                "total_s": round(total, 1),
                "variants": results,
            }
        )
    )


if __name__ == "__main__":
    main()
