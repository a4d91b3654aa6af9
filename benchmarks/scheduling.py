"""Cost-aware rollout placement vs round-robin vs a homogeneous B200 fleet, in simulation.

What: a discrete-event simulation (hardware.simulate.FleetSim) of sampler pools like the
heterogeneous fleet of Modal's run (B200 BF16, H100 BF16, H200 BF16, H200 FP8, A100 BF16)
feeding an async trainer that takes 128 prompts × 8 rollouts per step. Three placements:
homogeneous (the same number of GPUs, all B200 BF16), round-robin over the mixed pools, and
Flotilla's cost-aware scheduler over the mixed pools. Reports cost per million generated
tokens, total cost, trainer idle fraction and dropped (too stale) rollouts for each, the same
at other trainer speeds, then the mean cost of one placement decision with 100 pools.
Billing is one rule for all three: busy GPU-seconds × price, rollouts packed onto as few
replicas as hold them, a GPU with one sequence billed like a full one, idle GPUs free
(per-second serverless billing).

Why: the claim that cost-aware placement makes tokens cheaper without starving the trainer,
and that a decision is cheap enough (≤ 50 µs with 100 pools) to sit on the rollout path.

How: `.venv/bin/python benchmarks/scheduling.py [--quick] [--steps N] [--seed S]`.
Pure Python, no GPU. The last line printed is one JSON object with the figures.
Speeds are roofline estimates, not measurements; the assumptions are printed with the table.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

from hardware import (
    CATALOG,
    FleetSim,
    ModelSpec,
    PoolConfig,
    RooflineAssumptions,
    Scheduler,
    SimResult,
    ThroughputModel,
    fit_batch_per_gpu,
    replica_gpus,
)

MODEL = ModelSpec(
    total_params=35e9,  # a 35B-total / 3B-active MoE like Qwen3.6-35B-A3B
    active_params=3e9,
    shared_params=1e9,  # attention + embeddings + shared parts read by every token
    kv_bytes_per_token=32768,  # 32 KiB: e.g. 16 full-attention layers × 4 KV heads × 128 × K,V × 2 B
    context_tokens=8192,  # mean context of a decoding agentic rollout
)
GPUS_PER_POOL = 4
MIXED = [
    ("b200-bf16", "B200", "bf16"),
    ("h100-bf16", "H100-SXM", "bf16"),
    ("h200-bf16", "H200", "bf16"),
    ("h200-fp8", "H200", "fp8"),
    ("a100-bf16", "A100-80GB", "bf16"),
]
PROMPTS, SAMPLES = 128, 8
MEAN_TOKENS, SIGMA, MIN_TOKENS, MAX_TOKENS = 2000.0, 0.8, 64, 16384
# Trainer step time from its FLOPs: 6 · active params · tokens, on 10 B200s (two inference
# GPUs per training GPU for the 20-GPU mixed fleet) at 35% of dense BF16 peak.
TRAIN_GPUS, TRAIN_MFU, TRAIN_TOKENS_PER_ROLLOUT = 10, 0.35, 10_000
SWEEP_HEADROOMS = (1.1, 1.5, 2.0, 3.0)  # mixed-fleet roofline capacity ÷ trainer consumption
SYNC_DELAY_S = 10.0
BUDGET = 8
MAX_AHEAD_STEPS = 3
OBSERVE_EVERY_S = 10.0


def pool(name: str, gpu: str, precision: str, count: int) -> PoolConfig:
    per_gpu = fit_batch_per_gpu(CATALOG[gpu], precision, MODEL)
    return PoolConfig(
        name=name,
        gpu=gpu,
        count=count,
        precision=precision,
        device="cuda",
        staleness_budget=BUDGET,
        max_concurrent_rollouts=per_gpu * count,
    )


def rollout_tokens(rng: random.Random) -> int:
    mu = math.log(MEAN_TOKENS) - SIGMA**2 / 2  # lognormal with mean MEAN_TOKENS before clipping
    return int(min(MAX_TOKENS, max(MIN_TOKENS, rng.lognormvariate(mu, SIGMA))))


def simulate(pools: list[PoolConfig], policy: str, step_s: float, steps: int, seed: int) -> SimResult:
    tp = ThroughputModel(pools, MODEL)
    sched = Scheduler(pools, tp, policy=policy, mean_rollout_tokens=MEAN_TOKENS)
    sim = FleetSim(
        pools,
        MODEL,
        sched,
        batch=PROMPTS * SAMPLES,
        step_seconds=step_s,
        steps=steps,
        rollout_tokens=rollout_tokens,
        sync_delay_s=SYNC_DELAY_S,
        observe_every_s=OBSERVE_EVERY_S,
        max_ahead_steps=MAX_AHEAD_STEPS,
        seed=seed,
    )
    return sim.run()


def decision_us(n_pools: int = 100, decisions: int = 20000, seed: int = 0) -> tuple[float, float]:
    """Mean µs per `place()` with `n_pools` pools of mixed types and prices (each big enough to
    hold a replica of MODEL): (the cheapest half full, all but the dearest full). The trainer
    waits for more than the fleet can make, so every decision walks to the first pool with
    room, sums the supply of all pools and prices the spill candidates."""
    rng = random.Random(seed)
    a = RooflineAssumptions()
    kinds = [(g, p) for g in CATALOG if g != "cpu" for p in ("bf16", "fp8") if p == "bf16" or CATALOG[g].has_fp8]
    pools = []
    for i in range(n_pools):
        g, prec = kinds[i % len(kinds)]
        need = replica_gpus(CATALOG[g], prec, MODEL, 64, a) or 8
        count = max(need, rng.choice([1, 2, 4, 8]))
        price = CATALOG[g].price_per_hour * rng.uniform(0.6, 1.4)
        pools.append(
            PoolConfig(
                name=f"pool-{i:03d}",
                gpu=g,
                precision=prec,
                count=count,
                device="cuda",
                price_per_gpu_hour=price,
                max_concurrent_rollouts=64 * count,
                staleness_budget=2,
            )
        )
    tp = ThroughputModel(pools, MODEL)
    results = []
    for full_fraction in (0.5, 1.0):
        sched = Scheduler(pools, tp, mean_rollout_tokens=MEAN_TOKENS)
        ranking = [s.name for s in sched.states() if math.isfinite(s.usd_per_mtok)]
        n_full = int(len(ranking) * full_fraction) - (1 if full_fraction == 1.0 else 0)
        sched.set_trainer(0, 10**9, 0.0)
        for name in ranking[:n_full]:
            for _ in range(sched.capacity(name)):
                assert sched.place() == name
        sched.set_trainer(0, 10**9, 5.0, consume_per_s=40.0, batch=1024)
        total = 0
        perf = time.perf_counter_ns
        for _ in range(decisions):
            t0 = perf()
            name = sched.place()
            total += perf() - t0
            assert name is not None
            sched.complete(name)  # back to the same state: the next decision takes the same path
        results.append(total / decisions / 1e3)
    return results[0], results[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer trainer steps (< 60 s)")
    ap.add_argument("--steps", type=int, default=None, help="trainer steps per policy (default 40, quick 12)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    steps = args.steps or (12 if args.quick else 40)

    mixed = [pool(n, g, p, GPUS_PER_POOL) for n, g, p in MIXED]
    homogeneous = [pool("b200-bf16", "B200", "bf16", GPUS_PER_POOL * len(MIXED))]
    tp = ThroughputModel(mixed, MODEL)
    fleet_tps = sum(p.count * tp.roofline(p.name) for p in mixed)
    train_flops = 6 * MODEL.active_params * PROMPTS * SAMPLES * TRAIN_TOKENS_PER_ROLLOUT
    step_s = train_flops / (TRAIN_GPUS * CATALOG["B200"].bf16_tflops * 1e12 * TRAIN_MFU)
    headroom = fleet_tps / (PROMPTS * SAMPLES * MEAN_TOKENS / step_s)

    t0 = time.perf_counter()
    runs = {
        "homogeneous": simulate(homogeneous, "cost", step_s, steps, args.seed),
        "round_robin": simulate(mixed, "round_robin", step_s, steps, args.seed),
        "cost_aware": simulate(mixed, "cost", step_s, steps, args.seed),
    }
    sweep = {}
    for hr in SWEEP_HEADROOMS:
        sw_step = PROMPTS * SAMPLES * MEAN_TOKENS / (fleet_tps / hr)
        sweep[hr] = {
            name: simulate(
                homogeneous if name == "homogeneous" else mixed,
                "round_robin" if name == "round_robin" else "cost",
                sw_step,
                steps,
                args.seed,
            )
            for name in ("homogeneous", "round_robin", "cost_aware")
        }
    sim_wall = time.perf_counter() - t0
    half_us, nearly_full_us = decision_us(decisions=5000 if args.quick else 20000)

    a = RooflineAssumptions()
    print("Assumptions")
    print(
        f"  model: {MODEL.total_params / 1e9:.0f}B total / {MODEL.active_params / 1e9:.0f}B active MoE, "
        f"{MODEL.shared_params / 1e9:.0f}B shared, KV {MODEL.kv_bytes_per_token / 1024:.0f} KiB/token, "
        f"mean context {MODEL.context_tokens:.0f} tokens; KV in BF16 on every pool"
    )
    print(
        f"  roofline: {a.bandwidth_efficiency:.0%} of peak bandwidth, {a.compute_efficiency:.0%} of dense peak "
        f"FLOPS, {a.gpu_step_overhead_s * 1e3:.0f} ms overhead per decode step, {a.memory_fraction:.0%} of memory "
        "usable; batch per GPU = what the KV cache fits beside the weights (cap 256); no prefill, no env time"
    )
    print(
        f"  pools: {len(MIXED)} mixed pools × {GPUS_PER_POOL} GPUs; homogeneous = "
        f"{GPUS_PER_POOL * len(MIXED)} × B200 BF16 (same GPU count, "
        f"{sum(p.count * ThroughputModel(homogeneous, MODEL).roofline(p.name) for p in homogeneous) / fleet_tps:.2f}"
        f" × the mixed fleet's roofline); catalog (Modal list) prices"
    )
    print(
        "  billing, same for all: busy GPU-seconds × price; n rollouts on a pool keep ceil(n / slots per "
        "replica) replicas busy, a GPU with one sequence costs as much as a full one, idle GPUs cost nothing"
    )
    print(
        f"  trainer: {PROMPTS} prompts × {SAMPLES} rollouts per step, step {step_s:.1f} s = 6 × active params × "
        f"{TRAIN_TOKENS_PER_ROLLOUT} tokens per rollout on {TRAIN_GPUS} B200 at {TRAIN_MFU:.0%} MFU (mixed fleet "
        f"roofline = {headroom:.2f} × consumption), {steps} steps; rollout length lognormal "
        f"mean {MEAN_TOKENS:.0f} tokens, sigma {SIGMA}, clipped [{MIN_TOKENS}, {MAX_TOKENS}]"
    )
    print(
        f"  staleness budget {BUDGET} on every pool, weight sync {SYNC_DELAY_S:.0f} s after each step, "
        f"controller keeps ≤ {1 + MAX_AHEAD_STEPS} steps of rollouts outstanding, throughput observed "
        f"every {OBSERVE_EVERY_S:.0f} s; the scheduler is told the batch, demand, horizon and consumption, "
        f"and learns the rollout length online from a prior of {MEAN_TOKENS:.0f} tokens"
    )
    print()
    print("Pools (roofline at full batch)")
    print(f"  {'pool':<12} {'GPU':<10} {'prec':<5} {'GPUs':>4} {'slots/GPU':>9} {'tok/s/GPU':>10} {'$/Mtok':>7}")
    for p in mixed:
        print(
            f"  {p.name:<12} {p.gpu:<10} {p.precision:<5} {p.count:>4} {p.capacity // p.count:>9} "
            f"{tp.roofline(p.name):>10,.0f} {tp.usd_per_token(p.name) * 1e6:>7.3f}"
        )
    print()
    print(
        f"  {'policy':<12} {'$/Mtok':>8} {'total $':>9} {'Mtokens':>8} {'idle':>6} {'dropped':>7}"
        "   rollouts per pool ($/Mtok)"
    )
    for name, r in runs.items():
        share = ", ".join(
            f"{k}={v.completed} ({v.cost_usd / v.tokens * 1e6:.3f})" if v.tokens else f"{k}=0"
            for k, v in r.pools.items()
        )
        print(
            f"  {name:<12} {r.usd_per_mtok:>8.4f} {r.cost_usd:>9.2f} "
            f"{r.tokens / 1e6:>8.1f} {r.trainer_idle_fraction:>6.1%} {r.rollouts_dropped:>7}   {share}"
        )
    ca, rr, ho = runs["cost_aware"], runs["round_robin"], runs["homogeneous"]
    saving = 100 * (1 - ca.usd_per_mtok / ho.usd_per_mtok)
    print()
    print(
        f"  cost-aware vs homogeneous B200: {saving:.1f}% cheaper per token; vs round-robin: "
        f"{100 * (1 - ca.usd_per_mtok / rr.usd_per_mtok):.1f}% cheaper"
    )
    print()
    print("Sensitivity: trainer step set so the mixed fleet's roofline is H × its consumption ($/Mtok, idle)")
    print(f"  {'H':>4} {'step s':>7}  {'homogeneous':>16} {'round-robin':>16} {'cost-aware':>16}")
    for hr, rs in sweep.items():
        cells = "".join(f" {r.usd_per_mtok:>8.4f} {r.trainer_idle_fraction:>6.1%} " for r in rs.values())
        print(f"  {hr:>4} {PROMPTS * SAMPLES * MEAN_TOKENS / (fleet_tps / hr):>7.1f} {cells}")
    print(
        f"  decision with 100 pools, trainer short so each one sums supply and prices the spill: "
        f"{half_us:.1f} µs (cheapest half full), {nearly_full_us:.1f} µs (all but the dearest full); "
        f"simulated runs took {sim_wall:.1f} s"
    )
    print(
        json.dumps(
            {
                "cost_aware_usd_per_mtok": round(ca.usd_per_mtok, 5),
                "round_robin_usd_per_mtok": round(rr.usd_per_mtok, 5),
                "homogeneous_usd_per_mtok": round(ho.usd_per_mtok, 5),
                "cost_aware_trainer_idle": round(ca.trainer_idle_fraction, 4),
                "round_robin_trainer_idle": round(rr.trainer_idle_fraction, 4),
                "homogeneous_trainer_idle": round(ho.trainer_idle_fraction, 4),
                "cost_aware_total_usd": round(ca.cost_usd, 2),
                "round_robin_total_usd": round(rr.cost_usd, 2),
                "homogeneous_total_usd": round(ho.cost_usd, 2),
                "saving_vs_homogeneous_pct": round(saving, 2),
                "decision_us": round(max(half_us, nearly_full_us), 2),
                "decision_us_half_full": round(half_us, 2),
                "decision_us_nearly_full": round(nearly_full_us, 2),
                "sweep_usd_per_mtok": {
                    str(hr): {k: round(r.usd_per_mtok, 5) for k, r in rs.items()} for hr, rs in sweep.items()
                },
                "sweep_trainer_idle": {
                    str(hr): {k: round(r.trainer_idle_fraction, 4) for k, r in rs.items()} for hr, rs in sweep.items()
                },
                "steps": steps,
                "trainer_step_s": round(step_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
