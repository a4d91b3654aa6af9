"""Async vs sync: wall time of the same run in both controller modes, against the ideal overlap.

What: one config, derived from the demo (examples/guess_number.toml), runs for a fixed
number of steps with `mode = "sync"` (generate a batch, train on it, sync the weights, in
turn, on-policy) and with `mode = "async"` (sampling overlaps training within the pool's
staleness budget), same seed. Reported:

* `sync_s`, `async_s`: wall time of the training phase, from the metrics' `wall_s`:
  `wall_s[last step] - wall_s[step 1]`, i.e. steps 2..N. Process start-up, the first
  keyframe and the first step (pipeline fill, allocator warm-up) are excluded in both
  modes; the rollouts the async run generated beyond the last step are wasted work it
  still pays for.
* `t_gen`, `t_train` (seconds per step, from the sync run's traces, means over its steps):
  t_gen = first `rollout` span start → last `rollout` span end of the step's batch (the
  batch is complete); t_train = the controller's `train_step` span (batch transfer,
  forward/backward, optimizer, publishing the new version) + weight sync (train_step end →
  last `weights.apply` end). `t_sync` alone and `overhead` (sync step time not in either)
  are printed too.
* `speedup = sync_s / async_s`, `ideal_speedup = (t_gen + t_train) / max(t_gen, t_train)`,
  `efficiency = speedup / ideal_speedup`. Target: efficiency ≥ 0.8.

Separate devices are emulated the same way in both modes ([placement]): the trainer
process on core 0, the sampler, the environment actor and the controller on core 1, one
compute thread per actor. The batch shape and model size are chosen so that t_gen and
t_train are comparable (ideal near 2): a wider model than the demo's (hidden 640,
intermediate 2560, ~10 M parameters) so that both phases are compute-bound, two guesses
per episode (`max_turns = 2`: each turn is one more batched prefill of the whole prompt,
which brings t_gen close to t_train), one BF16 pool (the demo's first) and a small learning rate (1e-4) so that the workload
(episode lengths) stays the same across steps and modes. Everything chosen is printed
and in the JSON.

Diagnostics, to explain an efficiency below target: in the async run, the trainer's busy
fraction and its mean wait between steps (the batch was not ready: generation-bound),
its mean step time against the sync run's (slower: the trainer competes for CPU), the
sampler pool's busy fraction, staleness and drops; and, for both runs, the CPU time and
run-queue wait (/proc schedstat) of the trainer and of the core-1 processes, and the CPU
time other processes on the machine took in the same window. On a shared machine the
sync run gives away its idle core to other work, the async run cannot, so load from
elsewhere costs async more than sync. `cpu_projection` turns the CPU times into what
the two modes would take with nothing else on the machine (see `cpu_projection()`):
an estimate for a noisy machine, not a substitute for a quiet one.

Run:  .venv/bin/python benchmarks/async_vs_sync.py            (16 steps per mode, ~2-4 min)
      .venv/bin/python benchmarks/async_vs_sync.py --quick    (hidden 256, 8 prompts, 4 steps; < 60 s)
Options: --steps N, --seed S, --hidden H, --intermediate I, --max-turns T, --prompts P,
--group G, --lr LR, --repeats R (R sync/async pairs run alternately, their timed steps
pooled: sums of the times, means of the per-step figures; repeat to average out a noisy
machine). Needs Linux (CPU affinity, /proc) and 2 cores. Last line: JSON with sync_s,
async_s, speedup, ideal_speedup, efficiency, t_gen, t_train, steps (and the rest).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any

from _runs import RunOutput, demo_raw, intervals_union, load_average, run_raw


def build_raw(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    raw = demo_raw()
    raw.update(name=f"async-vs-sync-{mode}", mode=mode, steps=args.steps, seed=args.seed)
    raw["pools"] = raw["pools"][:1]  # one sampler "device"
    raw["model"] = {
        "seed": args.seed,
        "overrides": {"hidden_size": args.hidden, "intermediate_size": args.intermediate},
    }
    raw["task"]["params"] = {**raw["task"].get("params", {}), "max_turns": args.max_turns}
    raw["rollout"].update(
        prompts_per_step=args.prompts, group_size=args.group, max_buffered_groups=args.prompts
    )  # at most one batch ahead
    raw.setdefault("trainer", {})["lr"] = args.lr
    raw["placement"] = {"trainer_cpus": [0], "sampler_cpus": [1], "threads_per_actor": 1}
    return raw


def _spans(out: RunOutput, name: str, service: str = "controller") -> list[dict[str, Any]]:
    return sorted((s for s in out.spans if s["name"] == name and s["service"] == service), key=lambda s: s["start_ns"])


def _dur(s: dict[str, Any]) -> float:
    return (s["end_ns"] - s["start_ns"]) / 1e9


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def sync_phases(out: RunOutput) -> dict[str, float]:
    """Per-step phase times of a sync run (means over steps 2..N; sync after steps 1..N-1)."""
    trains = _spans(out, "train_step")
    applies = _spans(out, "weights.apply")
    rollouts = _spans(out, "rollout")
    gen, train, sync = [], [], []
    for k in range(1, len(trains)):
        lo, hi = trains[k - 1]["end_ns"], trains[k]["start_ns"]
        batch = [r for r in rollouts if lo < r["start_ns"] < hi]
        if batch:
            gen.append((max(r["end_ns"] for r in batch) - min(r["start_ns"] for r in batch)) / 1e9)
        train.append(_dur(trains[k]))
        first_rollout = min((r["start_ns"] for r in batch), default=hi)
        synced = [a["end_ns"] for a in applies if lo <= a["start_ns"] < first_rollout]
        if synced:
            sync.append((max(synced) - lo) / 1e9)
    return {
        "t_gen": _mean(gen),
        "t_train_step": _mean(train),
        "t_sync": _mean(sync),
        "t_train": _mean(train) + (_mean(sync) if sync else 0.0),
    }


def _phase_s(out: RunOutput) -> float:
    m = out.metrics
    return m[-1]["wall_s"] - m[0]["wall_s"]


def _roles(out: RunOutput) -> dict[int, str]:
    roles = {os.getpid(): "controller"}
    for s in out.spans:
        svc = s["service"]
        roles.setdefault(
            s["pid"],
            "trainer"
            if svc.startswith("trainer")
            else "sampler"
            if svc.startswith("sampler")
            else "env"
            if svc.startswith("env")
            else svc,
        )
    return roles


def cpu_figures(out: RunOutput) -> dict[str, float]:
    """CPU and run-queue wait in the measured window (train_step 1 end → train_step N end)."""
    trains = _spans(out, "train_step")
    if out.cpu is None or len(trains) < 2:
        return {}
    w = out.cpu.window(trains[0]["end_ns"], trains[-1]["end_ns"])
    if not w:
        return {}
    roles = _roles(out)
    fig: dict[str, float] = {"window_s": w["seconds"], "others_cpu_s": w["others_cpu_s"], "steal_s": w["steal_s"]}
    for key, group in (
        ("trainer", {"trainer"}),
        ("core1", {"controller", "sampler", "env"}),
        ("controller", {"controller"}),
        ("sampler", {"sampler"}),
        ("env", {"env"}),
    ):
        fig[f"{key}_cpu_s"] = sum(v for p, v in w["cpu_s"].items() if roles.get(p) in group)
        fig[f"{key}_wait_s"] = sum(v for p, v in w["wait_s"].items() if roles.get(p) in group)
    return {k: round(v, 3) for k, v in fig.items()}


def cpu_projection(cpu: dict[str, dict[str, float]], steps: int) -> dict[str, float]:
    """What the runs would give if each "device" did only its own work: the CPU seconds
    per step of the trainer (a) and of the core-1 processes (b), without the run-queue
    waits. Sync: a + b in sequence; async: max(a, b), with async's own a and b (its extra
    work, such as stale rollouts dropped and weights applied beside generation, included).
    Idle gaps of the pipeline are not modelled: an estimate, not a measurement."""
    s, a = cpu.get("sync", {}), cpu.get("async", {})
    if not s or not a:
        return {}
    sa, sb = s["trainer_cpu_s"] / steps, s["core1_cpu_s"] / steps
    aa, ab = a["trainer_cpu_s"] / steps, a["core1_cpu_s"] / steps
    speedup = (sa + sb) / max(aa, ab)
    ideal = (sa + sb) / max(sa, sb)
    return {
        "sync_trainer_cpu_per_step": sa,
        "sync_core1_cpu_per_step": sb,
        "async_trainer_cpu_per_step": aa,
        "async_core1_cpu_per_step": ab,
        "sync_step_s": sa + sb,
        "async_step_s": max(aa, ab),
        "speedup": speedup,
        "ideal_speedup": ideal,
        "efficiency": speedup / ideal,
    }


def async_figures(out: RunOutput) -> dict[str, float]:
    trains = _spans(out, "train_step")
    lo, hi = trains[0]["end_ns"], trains[-1]["end_ns"]
    window = (hi - lo) / 1e9
    steps = trains[1:]
    gaps = [(b["start_ns"] - a["end_ns"]) / 1e9 for a, b in itertools.pairwise(trains)]
    applies = [a for a in _spans(out, "weights.apply") if lo <= a["start_ns"] < hi]
    rollouts = [r for r in _spans(out, "rollout") if lo <= r["end_ns"] < hi]
    m = out.metrics
    busy = sum(p["busy_s"] for p in m[-1]["pools"].values()) - sum(p["busy_s"] for p in m[0]["pools"].values())
    return {
        "trainer_busy_frac": intervals_union([(s["start_ns"], s["end_ns"]) for s in steps], lo, hi) / 1e9 / window,
        "trainer_wait_per_step_s": _mean(gaps),
        "train_step_s": _mean([_dur(s) for s in steps]),
        "sampler_busy_frac": busy / window,
        "weights_apply_s": _mean([_dur(a) for a in applies]),
        "rollouts_done": len(rollouts),
        "rollouts_trained": sum(x["rollouts"] for x in m[1:]),
        "staleness_mean": _mean([x["staleness_mean"] for x in m[1:]]),
        "dropped_stale": m[-1]["dropped_stale"],
    }


def pair_figures(runs: dict[str, RunOutput]) -> dict[str, Any]:
    """Everything the report needs from one sync run and one async run."""
    ph = sync_phases(runs["sync"])
    sync_s, async_s = _phase_s(runs["sync"]), _phase_s(runs["async"])
    ideal = (ph["t_gen"] + ph["t_train"]) / max(ph["t_gen"], ph["t_train"])
    return {
        "sync_s": sync_s,
        "async_s": async_s,
        "phases": ph,
        "async": async_figures(runs["async"]),
        "cpu": {mode: cpu_figures(out) for mode, out in runs.items()},
        "speedup": sync_s / async_s,
        "ideal_speedup": ideal,
        "efficiency": sync_s / async_s / ideal,
    }


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small model and batch, 4 steps (< 60 s)")
    p.add_argument("--steps", type=int, help="steps per mode (default 16; quick 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, help="model hidden_size (default 640; quick 256)")
    p.add_argument("--intermediate", type=int, help="model intermediate_size (default 4 x hidden)")
    p.add_argument("--max-turns", type=int, default=2, help="guess_number turns per episode")
    p.add_argument("--prompts", type=int, help="prompts (GRPO groups) per step (default 16; quick 8)")
    p.add_argument("--group", type=int, default=8, help="rollouts per prompt")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument(
        "--repeats", type=int, default=1, help="sync/async pairs, run alternately; their timed steps are pooled"
    )
    args = p.parse_args()
    args.steps = args.steps or (4 if args.quick else 16)
    args.hidden = args.hidden or (256 if args.quick else 640)
    args.intermediate = args.intermediate or 4 * args.hidden
    args.prompts = args.prompts or (8 if args.quick else 16)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.steps < 3:
        p.error("--steps must be >= 3 (step 1 is excluded from the timing)")
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        p.error("needs cores 0 and 1 (trainer on 0, samplers on 1)")

    import torch

    torch.set_num_threads(1)
    load_before = load_average()
    t0 = time.monotonic()
    n = args.steps - 1
    pairs = []
    for rep in range(args.repeats):
        runs: dict[str, RunOutput] = {}
        for mode in ("sync", "async"):
            print(f"running {mode} ({rep + 1}/{args.repeats}): {args.steps} steps ...", file=sys.stderr, flush=True)
            runs[mode] = run_raw(build_raw(args, mode), watch_cpu=True)
        pairs.append(pair_figures(runs))
        del runs  # spans of a long run take memory; the figures are all that is kept
    total = time.monotonic() - t0
    load_after = load_average()

    # Several repeats pool their timed steps: times add up, per-step figures average.
    sync_s, async_s = sum(f["sync_s"] for f in pairs), sum(f["async_s"] for f in pairs)
    ph = {k: statistics.fmean(f["phases"][k] for f in pairs) for k in pairs[0]["phases"]}
    t_gen, t_train = ph["t_gen"], ph["t_train"]
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    speedup = sync_s / async_s
    efficiency = speedup / ideal
    sync_step, async_step = sync_s / (n * args.repeats), async_s / (n * args.repeats)
    af = {k: statistics.fmean(f["async"][k] for f in pairs) for k in pairs[0]["async"]}
    cpu = {
        mode: {k: round(sum(f["cpu"][mode].get(k, 0.0) for f in pairs), 3) for k in pairs[0]["cpu"][mode]}
        for mode in ("sync", "async")
    }
    proj = {k: round(v, 3) for k, v in cpu_projection(cpu, n * args.repeats).items()}
    params = _param_count(args)

    print(
        f"\nconfig: guess_number n={demo_raw()['task']['params'].get('n')} max_turns={args.max_turns}, "
        f"{args.prompts} prompts x {args.group} rollouts per step, model hidden {args.hidden} / "
        f"intermediate {args.intermediate} ({params / 1e6:.1f} M params), lr {args.lr}, one BF16 pool "
        f"(staleness budget {build_raw(args, 'async')['pools'][0]['staleness_budget']}), trainer on "
        f"core 0, sampler+env+controller on core 1, 1 thread each; {args.steps} steps, steps 2..{args.steps} timed, "
        f"{args.repeats} sync/async pair(s)"
    )
    print(f"load average before {load_before}, after {load_after}\n")
    print("| phase (sync run, per step) | seconds |\n|---|---|")
    for k in ("t_gen", "t_train_step", "t_sync", "t_train"):
        print(f"| {k} | {ph[k]:.3f} |")
    print(f"| overhead (step − t_gen − t_train) | {sync_step - t_gen - t_train:.3f} |")
    print(
        "\n| mode | timed s | s/step | trainer cpu s | trainer wait s | core-1 cpu s | core-1 wait s | others' cpu s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, secs in (("sync", sync_s), ("async", async_s)):
        c = cpu[mode]
        print(
            f"| {mode} | {secs:.2f} | {secs / (n * args.repeats):.3f} | {c.get('trainer_cpu_s', '-')} | {c.get('trainer_wait_s', '-')} "
            f"| {c.get('core1_cpu_s', '-')} | {c.get('core1_wait_s', '-')} | {c.get('others_cpu_s', '-')} |"
        )
    print("\nasync run: " + ", ".join(f"{k} {_fmt(v)}" for k, v in af.items()))
    bound = "generation" if af["trainer_busy_frac"] < 0.9 else "training"
    print(
        f"speedup {speedup:.3f}, ideal {ideal:.3f}, efficiency {efficiency:.3f}; async step "
        f"{async_step:.3f}s vs max(t_gen, t_train) {max(t_gen, t_train):.3f}s; the async trainer was busy "
        f"{af['trainer_busy_frac']:.0%} of the time ({bound}-bound); its step took "
        f"{af['train_step_s']:.3f}s vs {ph['t_train_step']:.3f}s in the sync run"
    )
    if args.repeats > 1:
        for i, f in enumerate(pairs):
            print(
                f"repeat {i + 1}: sync {f['sync_s']:.2f}s, async {f['async_s']:.2f}s, speedup {f['speedup']:.3f}, "
                f"ideal {f['ideal_speedup']:.3f}, efficiency {f['efficiency']:.3f}; others' cpu s: sync "
                f"{f['cpu']['sync'].get('others_cpu_s', '-')}, async {f['cpu']['async'].get('others_cpu_s', '-')}"
            )
    if proj:
        print(
            f"CPU-time projection without other load (each device busy only with its own work): "
            f"sync {proj['sync_step_s']:.3f}s/step, async {proj['async_step_s']:.3f}s/step, speedup "
            f"{proj['speedup']:.3f}, ideal {proj['ideal_speedup']:.3f}, efficiency {proj['efficiency']:.3f}"
        )
    print(f"total wall {total:.1f}s (start-up and shutdown included)", file=sys.stderr)
    print(
        json.dumps(
            {
                "benchmark": "async_vs_sync",
                "quick": args.quick,
                "steps": args.steps,
                "timed_steps": n,
                "repeats": args.repeats,
                "sync_s": round(sync_s, 3),
                "async_s": round(async_s, 3),
                "speedup": round(speedup, 3),
                "ideal_speedup": round(ideal, 3),
                "efficiency": round(efficiency, 3),
                "t_gen": round(t_gen, 3),
                "t_train": round(t_train, 3),
                "t_train_step": round(ph["t_train_step"], 3),
                "t_sync": round(ph["t_sync"], 3),
                "sync_step_s": round(sync_step, 3),
                "async_step_s": round(async_step, 3),
                "async": {k: round(v, 3) if isinstance(v, float) else v for k, v in af.items()},
                "per_repeat": [
                    {
                        **{k: round(f[k], 3) for k in ("sync_s", "async_s", "speedup", "ideal_speedup", "efficiency")},
                        "others_cpu_s": {m: f["cpu"][m].get("others_cpu_s") for m in ("sync", "async")},
                    }
                    for f in pairs
                ]
                if args.repeats > 1
                else None,
                "cpu": cpu,
                "cpu_projection": proj,
                "load_avg_before": load_before,
                "load_avg_after": load_after,
                "total_s": round(total, 1),
                "config": {
                    "hidden_size": args.hidden,
                    "intermediate_size": args.intermediate,
                    "params": params,
                    "max_turns": args.max_turns,
                    "prompts_per_step": args.prompts,
                    "group_size": args.group,
                    "lr": args.lr,
                    "seed": args.seed,
                    "pools": 1,
                    "trainer_cpus": [0],
                    "sampler_cpus": [1],
                    "threads_per_actor": 1,
                },
            }
        )
    )


def _param_count(args: argparse.Namespace) -> int:
    from actors.models import build_model, default_model_config
    from actors.tokenizer import VOCAB_SIZE

    conf = default_model_config(vocab_size=VOCAB_SIZE)
    conf.update(hidden_size=args.hidden, intermediate_size=args.intermediate)
    return sum(p.numel() for p in build_model(conf, seed=0).parameters())


if __name__ == "__main__":
    main()
