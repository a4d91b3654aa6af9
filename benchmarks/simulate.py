"""The fleet at internet scale, simulated; and the simulator checked against a real demo run.

What: (1) `hardware.fleetscale.ScaleSim` runs a 1,000-GPU fleet (5 GPU types, 3 providers:
Modal B200/H200/L40S on-demand, AWS H100 on-demand and spot, RunPod A100 on-demand and spot;
prices from `hardware.providers` with their sources) feeding one trainer through one
controller, with spot preemptions, each pool's link to the trainer (a weight delta's bytes ÷
bandwidth delay every update) and the controller's per-rollout CPU cost. The same run on a
homogeneous fleet of the dearest GPU (B200, on-demand) sized to the same nominal decode
capacity gives `saving_vs_homogeneous` = 1 − mixed $/Mtok ÷ homogeneous $/Mtok, per million
trained tokens over the steady state (after the first third of the steps: the initial fill
and what is in flight at the end are left out). Reports the
staleness distribution of trained rollouts and where the controller saturates (rollouts/s
ceiling = cores ÷ per-rollout cost; the fleet size at which nominal demand reaches it).
(2) Runs the demo (examples/guess_number.toml) for N steps with the real processes,
calibrates the simulator on alternate blocks of 2 steps and predicts the other blocks'
tokens/s, cost per Mtok and mean staleness (`sim_vs_measured`, simulated ÷ measured; what is
calibrated and what predicted: benchmarks/_sim_demo.py).

Per-GPU decode speeds are roofline estimates (hardware.throughput at the catalog's datasheet
figures, for a 35B-total / 3B-active MoE at 8k context, 64 rollouts per GPU), not
measurements. The trainer is sized to consume 1.1× the fleet's nominal rollout rate, so the
fleet (or the controller) bounds the run. Billing is rented: every GPU costs its price for the
whole simulated time. The controller's per-rollout cost defaults to 0.5 ms, a placeholder
until benchmarks/fleet.py measures it (`--controller-ms`).

How: `PYTHONPATH=$PWD python benchmarks/simulate.py [--quick] [--demo-steps N] [--steps S]`
(--quick: 40 demo steps and a shorter fleet run, a couple of minutes on 2 loaded cores).
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

from _sim_demo import compare

from hardware import CATALOG, ModelSpec, RooflineAssumptions, fit_batch_per_gpu, replica_gpus, roofline_tokens_per_s
from hardware.fleetscale import ScalePool, ScaleResult, ScaleSim
from hardware.providers import OFFERS, offers_markdown
from hardware.throughput import bytes_per_param

MODEL = ModelSpec(
    total_params=35e9,  # a 35B-total / 3B-active MoE like Qwen3.6-35B-A3B (as benchmarks/scheduling.py)
    active_params=3e9,
    shared_params=1e9,
    kv_bytes_per_token=32768,
    context_tokens=8192,
)
SLOTS_CAP = 64  # rollouts per GPU (hardware.pools.DEFAULT_ROLLOUTS_PER_GPU)
DELTA_COMPRESSION = 79.0  # PULSE's average raw / wire ratio for sparse bf16 deltas (providers P5)
# (name, offer, precision, spot, GPUs): 1,000 GPUs, 5 types, 3 providers.
FLEET = [
    ("modal-b200", "modal-b200", "bf16", False, 100),
    ("modal-h200-fp8", "modal-h200", "fp8", False, 150),
    ("modal-l40s-fp8", "modal-l40s", "fp8", False, 100),
    ("aws-h100-fp8", "aws-h100", "fp8", False, 100),
    ("aws-h100-fp8-spot", "aws-h100", "fp8", True, 300),
    ("runpod-a100", "runpod-a100", "bf16", False, 100),
    ("runpod-a100-spot", "runpod-a100", "bf16", True, 150),
]
MEAN_TOKENS, SIGMA, MIN_TOKENS, MAX_TOKENS = 2000.0, 0.8, 64, 16384
BATCH = 1024 * 8  # prompts × samples per step
BUDGET = 8
TRAINER_HEADROOM = 1.1


def rollout_tokens(rng: random.Random) -> float:
    mu = math.log(MEAN_TOKENS) - SIGMA**2 / 2
    return float(int(min(MAX_TOKENS, max(MIN_TOKENS, rng.lognormvariate(mu, SIGMA)))))


def gpu_speed(gpu: str, precision: str) -> tuple[float, int]:
    """(roofline tokens/s per GPU, slots per GPU) for MODEL at up to SLOTS_CAP rollouts per GPU."""
    spec = CATALOG[gpu]
    a = RooflineAssumptions()
    slots = min(SLOTS_CAP, fit_batch_per_gpu(spec, precision, MODEL, a))
    g = replica_gpus(spec, precision, MODEL, slots, a)
    if slots < 1 or g is None:
        raise SystemExit(f"{gpu} {precision}: the model does not fit")
    return roofline_tokens_per_s(spec, precision, MODEL, slots, a, replica=g), slots


def pool(name: str, offer: str, precision: str, spot: bool, count: int, preempt_rate: float) -> ScalePool:
    o = OFFERS[offer]
    tps, slots = gpu_speed(o.gpu, precision)
    weights = MODEL.total_params * bytes_per_param(precision)
    if spot and o.spot_per_hour is None:
        raise SystemExit(f"{offer} sells no spot capacity")
    return ScalePool(
        name=name,
        provider=o.provider,
        gpu=o.gpu,
        count=count,
        tokens_per_s_per_gpu=tps,
        slots_per_gpu=slots,
        price_per_gpu_hour=o.spot_per_hour if spot and o.spot_per_hour is not None else o.on_demand_per_hour,
        spot=spot,
        preemptions_per_gpu_hour=preempt_rate if spot else 0.0,
        link_gbps=o.link_gbps,
        delta_bytes=weights / DELTA_COMPRESSION,
        keyframe_bytes=weights,
        staleness_budget=BUDGET,
    )


def simulate(pools: list[ScalePool], args: argparse.Namespace, nominal_tps: float) -> ScaleResult:
    slots = sum(p.count * p.slots_per_gpu for p in pools)
    step_s = BATCH * MEAN_TOKENS / (TRAINER_HEADROOM * nominal_tps)
    sim = ScaleSim(
        pools,
        batch=BATCH,
        step_seconds=step_s,
        steps=args.steps,
        rollout_tokens=rollout_tokens,
        max_ahead_steps=math.ceil(slots / BATCH),
        controller_s_per_rollout=args.controller_ms / 1e3,
        controller_cores=args.controller_cores,
        seed=args.seed,
    )
    return sim.run()


def steady_from(steps: int) -> int:
    """The step after which the steady-state window starts (the first third is the fill)."""
    return max(1, steps // 3)


def summary(r: ScaleResult) -> dict[str, object]:
    return {
        "gpus": None,
        "usd_per_mtok_trained_steady": round(r.window_usd_per_mtok_trained(steady_from(r.steps)), 4),
        "usd_per_mtok": round(r.usd_per_mtok, 4),
        "usd_per_mtok_trained": round(r.usd_per_mtok_trained, 4),
        "tokens_per_s": round(r.tokens_per_s),
        "rollouts_per_s": round(r.rollouts_per_s, 1),
        "sim_seconds": round(r.sim_seconds, 1),
        "preemptions": r.preemptions,
        "rollouts_lost": r.rollouts_lost,
        "rollouts_dropped": r.rollouts_dropped,
        "staleness_mean": round(r.staleness_mean, 3),
        "staleness_p50": r.staleness_quantile(0.5),
        "staleness_p90": r.staleness_quantile(0.9),
        "staleness_p99": r.staleness_quantile(0.99),
        "staleness_max": max(r.staleness, default=0),
        "staleness_hist": {str(s): r.staleness[s] for s in sorted(r.staleness)},
        "controller_busy_fraction": round(r.controller_busy_fraction, 3),
        "trainer_idle_fraction": round(r.trainer_idle_fraction, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="40 demo steps, a shorter fleet run")
    ap.add_argument("--steps", type=int, default=None, help="trainer steps of the fleet run (default 30, quick 12)")
    ap.add_argument("--demo-steps", type=int, default=None, help="steps of the real demo run (default 160, quick 40)")
    ap.add_argument(
        "--controller-ms", type=float, default=None, help="controller CPU ms per rollout (default: a 0.5 placeholder)"
    )
    ap.add_argument("--controller-cores", type=int, default=1)
    ap.add_argument("--preemptions-per-gpu-hour", type=float, default=0.05, help="spot preemption rate (estimate)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-demo", action="store_true", help="skip the real demo run and its comparison")
    ap.add_argument("--keep-demo", type=Path, default=None, help="keep the demo run's outputs under this run_root")
    args = ap.parse_args()
    args.steps = args.steps or (12 if args.quick else 30)
    placeholder = args.controller_ms is None
    if placeholder:
        args.controller_ms = 0.5  # until benchmarks/fleet.py measures the controller's cost
    if args.controller_ms <= 0:
        raise SystemExit(f"--controller-ms must be > 0, got {args.controller_ms}")
    demo_steps = args.demo_steps or (40 if args.quick else 160)
    load_before = [round(x, 2) for x in os.getloadavg()]

    mixed = [pool(*row, args.preemptions_per_gpu_hour) for row in FLEET]
    nominal_tps = sum(p.count * p.tokens_per_s_per_gpu for p in mixed)
    dear = max(mixed, key=lambda p: OFFERS[next(r[1] for r in FLEET if r[0] == p.name)].on_demand_per_hour)
    b200_tps, _ = gpu_speed(dear.gpu, "bf16")
    homo_count = math.ceil(nominal_tps / b200_tps)
    homo = [pool("homogeneous-b200", "modal-b200", "bf16", False, homo_count, 0.0)]

    print(offers_markdown())
    print()
    print("| pool | provider | GPU | GPUs | $/GPU-h | tok/s/GPU (estimate) | slots | $/Mtok full | update s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for p in mixed + homo:
        print(
            f"| {p.name} | {p.provider} | {p.gpu} | {p.count} | {p.price_per_gpu_hour:.4f} | "
            f"{p.tokens_per_s_per_gpu:,.0f} | {p.slots_per_gpu} | {p.usd_per_mtok:.4f} | {p.update_s:.2f} |"
        )
    t0 = time.perf_counter()
    rm = simulate(mixed, args, nominal_tps)
    rh = simulate(homo, args, nominal_tps)
    sim_wall = time.perf_counter() - t0
    sm, sh = summary(rm), summary(rh)
    sm["gpus"], sh["gpus"] = sum(p.count for p in mixed), homo_count
    first = steady_from(args.steps)
    saving = 1.0 - rm.window_usd_per_mtok_trained(first) / rh.window_usd_per_mtok_trained(first)
    ceiling = rm.controller_ceiling_rollouts_per_s
    nominal_rps = nominal_tps / MEAN_TOKENS
    per_gpu_rps = nominal_rps / sum(p.count for p in mixed)
    controller = {
        "ms_per_rollout": args.controller_ms,
        "ms_is_placeholder": placeholder,
        "cores": args.controller_cores,
        "ceiling_rollouts_per_s": round(ceiling, 1),
        "fleet_nominal_rollouts_per_s": round(nominal_rps, 1),
        "saturates_at_gpus": round(ceiling / per_gpu_rps) if per_gpu_rps > 0 else None,
        "saturated": nominal_rps >= ceiling,
        "busy_fraction": sm["controller_busy_fraction"],
    }
    print()
    print(
        "| fleet | GPUs | $/Mtok trained (steady) | $/Mtok trained (all) | tok/s | stale mean | p50 | p90 | p99 | max | preempted | lost | dropped |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, s in (("mixed", sm), ("homogeneous B200", sh)):
        print(
            f"| {label} | {s['gpus']} | {s['usd_per_mtok_trained_steady']} | {s['usd_per_mtok_trained']} | {s['tokens_per_s']:,} | {s['staleness_mean']} "
            f"| {s['staleness_p50']} | {s['staleness_p90']} | {s['staleness_p99']} | {s['staleness_max']} "
            f"| {s['preemptions']} | {s['rollouts_lost']} | {s['rollouts_dropped']} |"
        )
    print(f"\nsaving vs homogeneous: {saving:.1%}; controller: {json.dumps(controller)}")

    demo = None
    if not args.no_demo:
        demo = compare(demo_steps, keep=args.keep_demo)
        print(f"\ndemo ({demo_steps} steps): {json.dumps(demo)}")
    out = {
        "bench": "simulate",
        "quick": args.quick,
        "sim.saving_vs_homogeneous": round(saving, 4),
        "sim.mixed": sm,
        "sim.homogeneous": sh,
        "sim.controller": controller,
        "sim.preemptions_per_gpu_hour": args.preemptions_per_gpu_hour,
        "sim.steps": args.steps,
        "sim.steady_from_step": first,
        "sim.wall_s": round(sim_wall, 1),
        "sim_vs_measured": demo["ratio"] if demo else None,
        "sim_vs_measured_within_15pct": demo["within_15pct"] if demo else None,
        "demo": demo,
        "load_average_before": load_before,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
