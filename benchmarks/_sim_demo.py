"""The scale simulator checked against a real run of the demo (benchmarks/simulate.py).

Runs `flotilla run examples/guess_number.toml` for N steps in a subprocess (the real
controller, trainer, samplers and env actor), reads its metrics.jsonl and cost_report.json,
calibrates the simulator on part of the run and predicts the rest.

The steps after a warm-up are cut into blocks of a few steps, alternately calibration and
prediction blocks: other jobs' load on this machine drifts over minutes, and alternating
makes it weigh on both alike (a first-half / second-half split mostly measures that drift).

Calibrated, from the calibration blocks of this same run:
- each pool's decode speed: its tokens ÷ its busy seconds (`tokens_per_s_per_gpu`);
- the cost of the rollout path (controller, env actor and sampler turn overhead on this
  machine's shared cores), as wall seconds = c_rollout × rollouts + c_token × tokens: the
  ratio c_rollout ÷ c_token is the intercept ÷ slope of a least-squares line of the traced
  rollouts' durations against their tokens, and the blocks' wall time fixes the scale; the
  simulator serves this work on one core shared by the rollouts waiting for it, one token
  per turn (the demo's `max_new_tokens`);
- the traced rollouts' token counts (the rollouts trained in the calibration blocks) and the
  trainer's mean step time (`train_s`).
Taken from the run's config (not measured): pools, slots, prices, staleness budgets, batch and
how far ahead sampling may run (max_buffered_groups ÷ prompts_per_step). The weight update
is the trainer's parameter bytes over a 27 Gbit/s link (raw pyzmq over ipc ≈ 3.4 GB/s,
/work/shared/REFERENCES.md), which makes it negligible here.
Predicted, over the prediction blocks, and compared with the measured run (`ratio`,
simulated ÷ measured): tokens/s of the trained rollouts (rollouts trained × their traced
mean tokens, over the blocks' wall time); cost per million tokens, the cost report's figure (busy
billing: tokens ÷ calibrated speed × price against the run's measured busy seconds × price);
and the mean staleness of the trained rollouts. The blocks' absolute cost is also compared
(`cost_usd_ratio`) but is not a target: it carries the noise of how many tokens the run's
metrics happen to count between two step ends on a loaded machine (per step, 50 to 900 in one
40-step run), which tokens/s and cost per token divide out. The cost per token itself rests on
the samplers' busy seconds, which other jobs' load stretches unevenly (per step, 200 to 1,900
tokens per busy second in one run): `usd_per_mtok_rel_se` gives its relative standard error
over the calibration and the prediction blocks, the noise a 15% check sits on.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from hardware.fleetscale import ScalePool, ScaleResult, ScaleSim

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "guess_number.toml"
IPC_GBPS = 3.4 * 8  # raw pyzmq over ipc ≈ 3.4 GB/s (REFERENCES.md, measured on this machine kind)

__all__ = ["DEMO", "calibrate", "compare", "run_demo"]


def _rollout_tokens(traces: Path) -> list[tuple[int, int, float]]:
    """(step it was trained at, generated tokens, seconds from start to end) of each traced
    rollout the controller finished: trained at step policy_version + staleness + 1. Traces
    may be sampled: these are a sample."""
    out = []
    if not traces.exists():
        return out
    with open(traces) as f:
        for line in f:
            if '"rollout"' not in line or '"controller"' not in line:
                continue
            d = json.loads(line)
            a = d.get("attributes", {})
            if d.get("name") != "rollout" or d.get("service") != "controller" or a.get("failed"):
                continue
            if "policy_version" in a and "staleness" in a and "tokens" in a:
                step = int(a["policy_version"]) + int(a["staleness"]) + 1
                out.append((step, int(a["tokens"]), (d["end_ns"] - d["start_ns"]) / 1e9))
    return out


def run_demo(
    steps: int, run_root: Path
) -> tuple[list[dict[str, Any]], dict[str, Any], list[tuple[int, int, float]], float]:
    """Run the demo for `steps` steps under `run_root`; (metrics rows, cost report, traced
    rollouts as (train step, tokens, seconds), wall seconds)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "orchestrator", "run", str(DEMO), "--steps", str(steps), "--quiet"]
    cmd += ["--set", f"run_root={run_root}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the demo run failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    out = run_root / "guess-number"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    report = json.loads((out / "cost_report.json").read_text())
    return metrics, report, _rollout_tokens(out / "traces.jsonl"), wall


def blocks(steps: int, warmup: int, size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Steps (a, b] after `warmup`, cut into blocks of `size`: (calibration blocks, prediction
    blocks), alternating, so that load from other jobs on the machine, which drifts over
    minutes, weighs on both alike."""
    cal, pred = [], []
    a, n = warmup, 0
    while a + size <= steps:
        (cal if n % 2 == 0 else pred).append((a, a + size))
        a, n = a + size, n + 1
    return cal, pred


def _window(metrics: list[dict[str, Any]], spans: list[tuple[int, int]]) -> dict[str, Any]:
    """Measured figures over the steps (a, b] of each span: metrics rows are cumulative in
    wall_s, cost_usd and per-pool tokens/busy_s, per step in rollouts and staleness_mean."""
    pools: dict[str, dict[str, float]] = {name: {"tokens": 0.0, "busy_s": 0.0} for name in metrics[0]["pools"]}
    wall = cost = 0.0
    rows: list[dict[str, Any]] = []
    for a, b in spans:
        ra, rb = metrics[a - 1], metrics[b - 1]
        wall += rb["wall_s"] - ra["wall_s"]
        cost += rb["cost_usd"] - ra["cost_usd"]
        rows += metrics[a:b]
        for name, w in pools.items():
            w["tokens"] += rb["pools"][name]["tokens"] - ra["pools"][name]["tokens"]
            w["busy_s"] += rb["pools"][name]["busy_s"] - ra["pools"][name]["busy_s"]
    n = sum(r["rollouts"] for r in rows)
    return {
        "wall_s": wall,
        "tokens": sum(w["tokens"] for w in pools.values()),
        "cost_usd": cost,
        "rollouts": n,
        "staleness_mean": sum(r["staleness_mean"] * r["rollouts"] for r in rows) / n if n else 0.0,
        "train_s": sum(r["train_s"] for r in rows) / len(rows),
        "pools": pools,
    }


def cost_per_token_rel_se(metrics: list[dict[str, Any]], spans: list[tuple[int, int]]) -> float:
    """Relative standard error of the blocks' cost per token (Σ cost ÷ Σ tokens, a ratio
    estimate over the blocks): how far the cost per token of blocks like these may be from
    another set's by chance alone. NaN with fewer than two blocks."""
    pairs = []
    for a, b in spans:
        ra, rb = metrics[a - 1], metrics[b - 1]
        tokens = sum(rb["pools"][n]["tokens"] - ra["pools"][n]["tokens"] for n in rb["pools"])
        pairs.append((rb["cost_usd"] - ra["cost_usd"], tokens))
    k = len(pairs)
    total = sum(n for _, n in pairs)
    if k < 2 or total <= 0:
        return float("nan")
    r = sum(c for c, _ in pairs) / total
    var = sum((c - r * n) ** 2 for c, n in pairs) / (k * (k - 1))
    return var**0.5 / (total / k) / r if r > 0 else float("nan")


def _per_rollout_over_per_token(traced: list[tuple[int, float]]) -> float:
    """The rollout path's cost per rollout ÷ its cost per token, from a least-squares line of
    traced rollout durations against their tokens (shared cores: time ∝ work); 0 (all per
    token) when the traces cannot tell (one length only, or a line through negative costs)."""
    n = len(traced)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in traced) / n
    my = sum(y for _, y in traced) / n
    sxx = sum((x - mx) ** 2 for x, _ in traced)
    if sxx <= 0:
        return 0.0
    slope = sum((x - mx) * (y - my) for x, y in traced) / sxx
    intercept = my - slope * mx
    return intercept / slope if slope > 0 and intercept > 0 else 0.0


def calibrate(
    metrics: list[dict[str, Any]], traced: list[tuple[int, int, float]], cal_blocks: list[tuple[int, int]]
) -> tuple[ScaleSim, dict[str, Any]]:
    """A simulator of the demo's config, calibrated on the steps of `cal_blocks`."""
    with open(DEMO, "rb") as f:
        cfg = tomllib.load(f)
    n = len(metrics)
    cal = _window(metrics, cal_blocks)
    param_bytes = float(metrics[0].get("trainer_memory", {}).get("param_bytes", 0.0))
    pools = []
    for p in cfg["pools"]:
        w = cal["pools"][p["name"]]
        if w["busy_s"] <= 0 or w["tokens"] <= 0:
            raise SystemExit(f"pool {p['name']!r} did no work in the calibration window")
        price = p.get("price_per_gpu_hour")
        if price is None:
            from hardware import gpu_spec

            price = gpu_spec(p["gpu"]).price_per_hour
        pools.append(
            ScalePool(
                name=p["name"],
                provider="local",
                gpu=p["gpu"],
                count=p.get("count", 1),
                tokens_per_s_per_gpu=w["tokens"] / w["busy_s"],
                slots_per_gpu=p["max_concurrent_rollouts"] // p.get("count", 1),
                price_per_gpu_hour=price,
                link_gbps=IPC_GBPS,
                delta_bytes=param_bytes,
                keyframe_bytes=param_bytes,
                staleness_budget=p.get("staleness_budget", 2),
            )
        )
    ro = cfg["rollout"]
    traced_cal = [(tok, dur) for step, tok, dur in traced if any(a < step <= b for a, b in cal_blocks) and tok > 0]
    in_cal = [tok for tok, _ in traced_cal]
    # Tokens per trained rollout from the traces (exact per rollout, and a fair sample when
    # traces are sampled); the metrics' token counters are read at step ends while rollouts
    # are mid-flight, so their per-block differences are noisy. Without traces, the counters.
    mean_tokens = sum(in_cal) / len(in_cal) if in_cal else cal["tokens"] / cal["rollouts"]
    q = _per_rollout_over_per_token(traced_cal)
    # wall = c_rollout × rollouts + c_token × tokens, with c_rollout = q × c_token.
    s_per_token = cal["wall_s"] / (q * cal["rollouts"] + mean_tokens * cal["rollouts"])

    def rollout_tokens(rng: random.Random) -> float:
        return rng.choice(in_cal) if in_cal else mean_tokens

    sim = ScaleSim(
        pools,
        batch=ro["prompts_per_step"] * ro["group_size"],
        step_seconds=cal["train_s"],
        steps=n,
        rollout_tokens=rollout_tokens,
        max_ahead_steps=ro["max_buffered_groups"] / ro["prompts_per_step"],
        controller_s_per_rollout=q * s_per_token,
        controller_s_per_token=s_per_token,
        tokens_per_turn=1.0,
        billing="busy",
    )
    calibrated = {
        "blocks": cal_blocks,
        "tokens_per_s_per_gpu": {p.name: round(p.tokens_per_s_per_gpu, 1) for p in pools},
        "path_ms_per_token": round(s_per_token * 1e3, 4),
        "path_ms_per_rollout": round(q * s_per_token * 1e3, 4),
        "tokens_per_rollout": round(mean_tokens, 3),
        "traced_rollouts": len(in_cal),
        "train_s": round(cal["train_s"], 4),
    }
    return sim, calibrated


def _sim_window(r: ScaleResult, spans: list[tuple[int, int]]) -> dict[str, float]:
    tokens = trained = dt = cost = 0.0
    stale: list[float] = []
    for a, b in spans:
        la, lb = r.log[a - 1], r.log[b - 1]
        tokens += lb.tokens - la.tokens
        trained += lb.tokens_trained - la.tokens_trained
        dt += lb.t - la.t
        cost += lb.cost_usd - la.cost_usd
        stale += [s.staleness_mean for s in r.log[a:b]]
    return {
        "tokens_per_s": trained / dt if dt > 0 else 0.0,
        "usd_per_mtok": cost / tokens * 1e6 if tokens > 0 else 0.0,
        "staleness_mean": sum(stale) / len(stale),
        "cost_usd": cost,
    }


def compare(steps: int, warmup: int = 2, block: int = 2, keep: Path | None = None) -> dict[str, Any]:
    """Run the demo for `steps` steps, calibrate on alternate blocks of `block` steps after
    `warmup`, simulate the whole run, and compare the other blocks. The run's outputs are
    kept under `keep` when given, else removed."""
    cal_blocks, pred_blocks = blocks(steps, warmup, block)
    if not pred_blocks:
        raise SystemExit(f"need at least {warmup + 2 * block} steps to calibrate and predict, got {steps}")
    if keep is not None:
        metrics, report, traced, wall = run_demo(steps, keep)
    else:
        with tempfile.TemporaryDirectory(prefix="flotilla-sim-") as tmp:
            metrics, report, traced, wall = run_demo(steps, Path(tmp))
    if len(metrics) < steps:
        raise SystemExit(f"the demo logged {len(metrics)} of {steps} steps")
    sim, calibrated = calibrate(metrics, traced, cal_blocks)
    result = sim.run()
    real = _window(metrics, pred_blocks)
    in_pred = [tok for step, tok, _ in traced if any(a < step <= b for a, b in pred_blocks) and tok > 0]
    pred_tokens = real["rollouts"] * (sum(in_pred) / len(in_pred) if in_pred else real["tokens"] / real["rollouts"])
    measured = {
        "tokens_per_s": pred_tokens / real["wall_s"],
        "usd_per_mtok": real["cost_usd"] / real["tokens"] * 1e6,
        "staleness_mean": real["staleness_mean"],
        "cost_usd": real["cost_usd"],
    }
    simulated = _sim_window(result, pred_blocks)
    ratios = {k: simulated[k] / measured[k] if measured[k] else float("nan") for k in measured}
    cost_ratio = ratios.pop("cost_usd")
    return {
        "steps": steps,
        "run_wall_s": round(wall, 1),
        "calibrated": calibrated,
        "predicted_blocks": pred_blocks,
        "measured": {k: round(v, 6) for k, v in measured.items()},
        "simulated": {k: round(v, 6) for k, v in simulated.items()},
        "ratio": {k: round(v, 4) for k, v in ratios.items()},
        "within_15pct": all(abs(v - 1.0) <= 0.15 for v in ratios.values()),
        "cost_usd_ratio": round(cost_ratio, 4),
        "usd_per_mtok_rel_se": {
            "calibration": round(cost_per_token_rel_se(metrics, cal_blocks), 4),
            "prediction": round(cost_per_token_rel_se(metrics, pred_blocks), 4),
        },
        "cost_report_usd": round(report["totals"]["cost_usd"], 6),
        "cost_report_mean_staleness": report["totals"]["mean_staleness"],
        "sim_run_cost_usd": round(result.cost_usd, 6),
        "sim_run_mean_staleness": round(result.staleness_mean, 4),
    }
