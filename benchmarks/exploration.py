"""Exploration under top-p with mask replay: min_keep vs an entropy term vs an LR schedule, on many seeds.

What: guess_number (n=7, 3 turns, the demo's task) played by a *tabular* softmax policy:
one row of logits per conversation state (the guesses and answers so far) over 16 action
tokens (0..6 are guesses, 7..15 are junk: an invalid guess that still uses a turn),
initialised N(0, 1) like an untrained model's near-uniform output. It is trained in
process with the recipe's own functions, exactly as the trainer does: tokens drawn by
`sample_with_support` (temperature 1, top_k 64, top_p, min_keep), log p^S replayed over
each recorded support by `replay_logprobs`, GRPO advantages, `recipe_loss` (MIS + score
centering), AdamW. Sampling is on-policy here (no FP8, no staleness), so every
difference between variants comes from the support: this isolates the absorbing state
of issue 11 from everything else a full run adds, and runs in seconds per seed.

Variants (policies.RecipeConfig switches + the trainer's LR schedule):

* plain        min_keep 1: a state whose top token holds >= top_p of the mass gets a
               one-token support, replayed log p^S = 0, no gradient ever again
* min_keep     min_keep 2 (the recipe's default)
* entropy      min_keep 1 + entropy bonus over the replayed support (coef 0.01)
* lr_decay     min_keep 1 + linear LR decay to 0.1x over the run
* min_keep+decay   both of the above
* min_keep+floor   min_keep 2 + entropy floor 0.1 nats (coef 0.1): with two ids in every
               support the entropy term has a gradient everywhere, and the floor stops the
               runner-up's probability from vanishing (at the price of a policy that never
               becomes fully greedy: q(runner-up) stays near 2% where H would fall below 0.1)

Per variant: mean final reward (last 10 steps), how many seeds end >= 0.8 and >= 0.95,
the mean fraction of one-token supports over the last 10 steps, and steps whose gradient
was exactly zero. It runs each variant at top_p 0.97 (the recipe's default) and 0.99 (the demo's).

Why: issue 11 asks to choose the fix on evidence; full runs of the demo cost minutes of
CPU each on this shared machine, this costs seconds, with the same sampler and loss code.

Run:  .venv/bin/python benchmarks/exploration.py           (6 variants x 2 top_p x 20 seeds x 300 steps: long)
      .venv/bin/python benchmarks/exploration.py --seeds 8 --steps 200 --top-p 0.97   (the recorded table)
      .venv/bin/python benchmarks/exploration.py --quick   (4 seeds x 60 steps: too short to learn, a smoke test)
Options: --seeds, --steps, --lr, --top-p 0.97,0.99, --variants a,b, --prompts, --group.
Last line: JSON with per-variant figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

N, TURNS, VOCAB = 7, 3, 16
WINDOW = 10
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {"min_keep": 1},
    "min_keep": {"min_keep": 2},
    "entropy": {"min_keep": 1, "entropy_coef": 0.01},
    "lr_decay": {"min_keep": 1, "decay": True},
    "min_keep+decay": {"min_keep": 2, "decay": True},
    "min_keep+floor": {"min_keep": 2, "entropy_coef": 0.1, "entropy_floor": 0.1},
}


def train(
    variant: dict[str, Any], top_p: float, seed: int, steps: int, prompts: int, group: int, lr: float
) -> dict[str, float]:
    """Train one tabular policy; its reward curve figures."""
    import torch

    from policies import (
        RecipeConfig,
        SupportRecord,
        grpo_advantages,
        recipe_loss,
        replay_logprobs,
        sample_with_support,
    )

    cfg = RecipeConfig(
        top_p=top_p,
        min_keep=variant["min_keep"],
        entropy_coef=variant.get("entropy_coef", 0.0),
        entropy_floor=variant.get("entropy_floor"),
    )
    gen = torch.Generator().manual_seed(seed)
    table = torch.nn.Parameter(torch.randn(4096, VOCAB, generator=gen))
    opt = torch.optim.AdamW([table], lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    states: dict[tuple, int] = {}
    rng = torch.Generator().manual_seed(10_000 + seed)
    rewards_curve, one_token, zero_grad = [], [], 0

    def row(history: tuple) -> int:
        if history not in states:
            states[history] = len(states)
        return states[history]

    for step in range(steps):
        if variant.get("decay"):
            for g in opt.param_groups:
                g["lr"] = lr * (1.0 - 0.9 * step / max(1, steps - 1))
        b = prompts * group
        secrets = torch.randint(0, N, (prompts,), generator=rng).repeat_interleave(group).tolist()
        history = [() for _ in range(b)]
        done = [False] * b
        reward = [0.0] * b
        rows, tokens, supports, episode = [], [], [], []
        for _ in range(TURNS):
            live = [i for i in range(b) if not done[i]]
            if not live:
                break
            r = [row(history[i]) for i in live]
            with torch.no_grad():
                tok, sup = sample_with_support(
                    table[r].detach(),
                    temperature=cfg.temperature,
                    top_k=cfg.top_k,
                    top_p=cfg.top_p,
                    min_keep=cfg.min_keep,
                    generator=rng,
                )
            rows += r
            tokens.append(tok)
            supports.append(sup)
            episode += live
            for i, a in zip(live, tok.tolist(), strict=True):
                if a == secrets[i]:
                    reward[i], done[i] = 1.0, True
                    continue
                answer = "invalid" if a >= N else ("higher" if a < secrets[i] else "lower")
                history[i] = history[i] + ((a, answer),)
        support = SupportRecord.cat(supports)
        y = torch.cat(tokens)
        adv_ep = grpo_advantages(torch.tensor(reward), torch.arange(b) // group)
        adv = adv_ep[torch.tensor(episode)]
        rep = replay_logprobs(table[rows], support, y, cfg.temperature)
        loss, _ = recipe_loss(cfg, support, y, adv, replay=rep, num_loss_tokens=len(rows))
        opt.zero_grad()
        loss.backward()
        if not bool(table.grad.abs().sum() > 0):
            zero_grad += 1
        opt.step()
        rewards_curve.append(statistics.fmean(reward))
        one_token.append(float((support.counts() == 1).float().mean()))
    return {
        "final": statistics.fmean(rewards_curve[-WINDOW:]),
        "auc": statistics.fmean(rewards_curve),
        "one_token_fraction": statistics.fmean(one_token[-WINDOW:]),
        "zero_grad_steps": float(zero_grad),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 seeds x 60 steps (< 1 min)")
    p.add_argument("--seeds", type=int, help="seeds per variant (default 20; quick 4)")
    p.add_argument("--steps", type=int, help="steps per run (default 300; quick 60)")
    p.add_argument("--lr", type=float, default=0.1, help="AdamW learning rate of the logit table (default 0.1)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--group", type=int, default=8, help="rollouts per prompt (default 8)")
    p.add_argument("--top-p", default="0.97,0.99", help="comma-separated top_p values (default 0.97,0.99)")
    p.add_argument("--variants", help=f"comma-separated subset of {','.join(VARIANTS)}")
    args = p.parse_args()
    seeds = args.seeds or (4 if args.quick else 20)
    steps = args.steps or (60 if args.quick else 300)

    import torch
    from _runs import load_average

    torch.set_num_threads(1)
    load_before, t0 = load_average(), time.monotonic()
    results: dict[str, Any] = {}
    names = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    for top_p in (float(x) for x in args.top_p.split(",")):
        for name in names:
            variant = VARIANTS[name]
            runs = [train(variant, top_p, s, steps, args.prompts, args.group, args.lr) for s in range(seeds)]
            finals = [r["final"] for r in runs]
            results[f"{name}@{top_p}"] = {
                "top_p": top_p,
                **variant,
                "final_mean": round(statistics.fmean(finals), 4),
                "final_min": round(min(finals), 4),
                "seeds_final_ge_0_8": sum(f >= 0.8 for f in finals),
                "seeds_final_ge_0_95": sum(f >= 0.95 for f in finals),
                "auc": round(statistics.fmean(r["auc"] for r in runs), 4),
                "one_token_fraction": round(statistics.fmean(r["one_token_fraction"] for r in runs), 4),
                "zero_grad_steps": round(statistics.fmean(r["zero_grad_steps"] for r in runs), 2),
            }
            print(f"{name}@{top_p}: " + json.dumps(results[f'{name}@{top_p}']), file=sys.stderr, flush=True)
    total = time.monotonic() - t0
    print(
        f"\ntabular guess_number (n={N}, {TURNS} turns), {args.prompts} prompts x {args.group} rollouts per step, "
        f"AdamW lr {args.lr}, on-policy; {steps} steps, {seeds} seeds per variant; final = mean reward of the "
        f"last {WINDOW} steps; one-token = fraction of supports with one id over the last {WINDOW} steps"
    )
    print(f"load average before {load_before}, after {load_average()}; {total:.0f}s\n")
    print(
        "| variant | top_p | final reward (mean, min) | seeds >= 0.8 | seeds >= 0.95 | AUC | one-token supports "
        "| zero-gradient steps |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for key, r in results.items():
        print(
            f"| {key.split('@')[0]} | {r['top_p']} | {r['final_mean']:.3f}, {r['final_min']:.3f} | "
            f"{r['seeds_final_ge_0_8']}/{seeds} | {r['seeds_final_ge_0_95']}/{seeds} | {r['auc']:.3f} | "
            f"{r['one_token_fraction']:.3f} | {r['zero_grad_steps']:.1f} |"
        )
    print(
        json.dumps(
            {
                "benchmark": "exploration",
                "quick": args.quick,
                "seeds": seeds,
                "steps": steps,
                "lr": args.lr,
                "total_s": round(total, 1),
                "load_avg_before": load_before,
                "variants": results,
            }
        )
    )


if __name__ == "__main__":
    main()
