"""Does a supervised warm start shorten RL? Time to a 10-step mean reward of 0.8, SFT start vs random start.

What: for a task config (default examples/arithmetic.toml), a small script of this file
writes N examples from the task itself (each prompt's environment, its right answer as
the completion; every example is checked to earn reward 1), `flotilla sft` trains the
config's model on them (`orchestrator.entry.sft.run_sft`), and the same RL config runs
twice per seed: from the random init, and with `[model] path` = the SFT model. Per run it
reports the first step whose 10-step mean reward is >= 0.8 and the run clock there
(`wall_s`, as benchmarks/demo_seeds.py), plus the first step's reward. The last line is
JSON with `sft_speedup` = random-start time ÷ SFT-start time (the mean over seeds
where both reached 0.8; null when one never did, with `sft_speedup_lower_bound` =
random-start run clock at its last step ÷ SFT-start time when only the SFT start got
there), the same including the SFT's own wall time (`sft_speedup_with_sft_time`), and
the SFT figures (examples, steps, loss before and after, wall time).

Why: issue 32, item 5: real RL starts from a model that already produces the task's
format; the warm start's gain on time-to-0.8 is measured here, whatever it is.

Run:  .venv/bin/python benchmarks/sft.py                     (seed 0, the config's steps)
      .venv/bin/python benchmarks/sft.py --quick             (60 RL steps per start, 200 examples: a few minutes)
Options: --config PATH, --seeds 0,1, --steps N, --examples N, --epochs N (default 10),
--sft-lr X (default 3e-3).
On a shared machine the times are inflated by others' load: the JSON carries the load average.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from _runs import load_average, run_raw
from demo_seeds import reward_figures

ROOT = Path(__file__).resolve().parents[1]


def task_examples(raw: dict[str, Any], n: int, seed: int) -> list[dict[str, str]]:
    """`n` prompt/completion pairs from the config's task: each prompt's right answer,
    checked against the environment's own reward (single-turn tasks with a known answer)."""
    from actors.env import make_env
    from actors.types import TaskSpec

    task = raw.get("task", {})
    name, params = task.get("name", "guess_number"), dict(task.get("params", {}))
    out = []
    for i in range(n):
        spec = TaskSpec(
            task=name, prompt_id=f"sft{i}", group_id=f"sft{i}", seed=seed * 7_919 + 1_000_000 + i, params=params
        )
        env = make_env(spec)
        prompt = env.reset(spec)
        if hasattr(env, "answer"):
            ans = env.answer()
            completion = " ".join(map(str, ans)) if isinstance(ans, list) else str(ans)
        elif name == "arithmetic":
            completion = str(env.a + env.b)
        else:
            raise SystemExit(f"sft benchmark: no scripted answer for task {name!r} (use a single-turn built-in task)")
        reward = env.step(completion, []).reward
        if reward != 1.0:
            raise SystemExit(f"sft benchmark: the scripted answer {completion!r} to {prompt!r} earned {reward}")
        out.append({"prompt": prompt, "completion": completion})
    return out


def run_sft_stage(raw: dict[str, Any], data: Path, root: Path, epochs: int, lr: float | None) -> dict[str, Any]:
    from orchestrator.entry.sft import run_sft
    from orchestrator.state.config import load_config

    sft_raw = copy.deepcopy(raw)
    sft_raw["run_root"] = str(root)
    sft_raw["sft"] = {"data": str(data), "epochs": epochs, "batch_size": 32, **({"lr": lr} if lr else {})}
    out = run_sft(load_config(raw=sft_raw), quiet=True)
    return {
        "model_dir": str(out.model_dir),
        "steps": out.steps,
        "initial_loss": round(out.initial_loss, 4),
        "final_loss": round(out.final_loss, 4),
        "wall_s": round(out.wall_s, 1),
    }


def _rl(raw: dict[str, Any], seed: int, steps: int | None, model_path: str | None) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    r = copy.deepcopy(raw)
    r["seed"] = seed
    r.setdefault("model", {})["seed"] = seed
    r["name"] = f"{r.get('name', 'run')}-{'sft' if model_path else 'random'}-s{seed}"
    if steps is not None:
        r["steps"] = steps
    if model_path is not None:
        r["model"]["path"] = model_path
    t0 = time.monotonic()
    out = run_raw(r, keep_spans=False)
    fig = reward_figures(out.metrics)
    fig["first_reward"] = out.metrics[0]["reward_mean"]
    fig["last_wall_s"] = out.metrics[-1]["wall_s"]
    fig["total_s"] = round(time.monotonic() - t0, 1)
    fig["load_avg"] = load_average()
    return fig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "examples" / "arithmetic.toml")
    p.add_argument("--quick", action="store_true", help="60 RL steps per start, 200 examples (a few minutes)")
    p.add_argument("--seeds", default="0", help="comma-separated RL seeds (default 0)")
    p.add_argument("--steps", type=int, help="RL steps per run (default: the config's; 60 with --quick)")
    p.add_argument("--examples", type=int, help="SFT examples (default 300; 200 with --quick)")
    p.add_argument("--epochs", type=int, default=10, help="SFT epochs (default 10)")
    p.add_argument("--sft-lr", type=float, default=3e-3, help="SFT learning rate (default 3e-3)")
    args = p.parse_args()
    with open(args.config, "rb") as f:
        raw = tomllib.load(f)
    seeds = [int(s) for s in args.seeds.split(",")]
    steps = args.steps or (60 if args.quick else None)
    n_examples = args.examples or (200 if args.quick else 300)
    load_before = load_average()

    with tempfile.TemporaryDirectory(prefix="flotilla-sft-bench-") as tmp:
        data = Path(tmp) / "examples.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in task_examples(raw, n_examples, seed=0)))
        sft = run_sft_stage(raw, data, Path(tmp), args.epochs, args.sft_lr)
        print(
            f"sft: {n_examples} examples, {sft['steps']} steps, loss {sft['initial_loss']} -> "
            f"{sft['final_loss']} in {sft['wall_s']} s",
            flush=True,
        )
        rows: dict[int, dict[str, Any]] = {}
        for seed in seeds:
            rows[seed] = {"random": _rl(raw, seed, steps, None), "sft": _rl(raw, seed, steps, sft["model_dir"])}
            for start, fig in rows[seed].items():
                reach = (
                    f"step {fig['step_to_target']} at {fig['wall_to_target_s']:.0f} s"
                    if fig["step_to_target"]
                    else "never"
                )
                print(
                    f"seed {seed} {start} start: 0.8 {reach}; first reward {fig['first_reward']:.3f}; final "
                    f"{fig['final']:.3f}; {fig['steps']} steps; load {fig['load_avg']}",
                    flush=True,
                )

    both = [s for s in seeds if rows[s]["random"]["wall_to_target_s"] and rows[s]["sft"]["wall_to_target_s"]]
    speedup = speedup_sft = lower = None
    if both:
        speedup = statistics.fmean(
            rows[s]["random"]["wall_to_target_s"] / rows[s]["sft"]["wall_to_target_s"] for s in both
        )
        speedup_sft = statistics.fmean(
            rows[s]["random"]["wall_to_target_s"] / (rows[s]["sft"]["wall_to_target_s"] + sft["wall_s"]) for s in both
        )
    only_sft = [s for s in seeds if rows[s]["sft"]["wall_to_target_s"] and not rows[s]["random"]["wall_to_target_s"]]
    if only_sft:
        lower = min(rows[s]["random"]["last_wall_s"] / rows[s]["sft"]["wall_to_target_s"] for s in only_sft)
    print(
        json.dumps(
            {
                "benchmark": "sft",
                "config": str(args.config),
                "quick": args.quick,
                "seeds": seeds,
                "steps": steps or raw.get("steps"),
                "sft": {k: v for k, v in sft.items() if k != "model_dir"}
                | {"examples": n_examples, "epochs": args.epochs},
                "sft_speedup": None if speedup is None else round(speedup, 3),
                "sft_speedup_with_sft_time": None if speedup_sft is None else round(speedup_sft, 3),
                "sft_speedup_lower_bound": None if lower is None else round(lower, 3),
                "seeds_both_reaching": len(both),
                "per_seed": {
                    s: {
                        start: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in fig.items()}
                        for start, fig in r.items()
                    }
                    for s, r in rows.items()
                },
                "load_avg_before": load_before,
                "load_avg_after": load_average(),
            }
        )
    )


if __name__ == "__main__":
    main()
