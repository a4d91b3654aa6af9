"""Fleet benchmark: the controller's ceiling, and whether it stays flat over a long run.

What: the real `Controller` (orchestrator.controller) drives a fleet of fake actors over real
ZeroMQ sockets (benchmarks/_fleet.py): sampler and environment actors that compute nothing
but send real messages (synthetic trajectories of `--tokens` generated tokens with support
rows of about `--support` ids), many ranks multiplexed into a few processes, and a trainer
that consumes batches at `--train-rate` rollouts/s. Episodes are short and capacity ample,
so the controller is what saturates. For each fleet size in `--ranks` (sampler ranks, spread
over `--pools` pools, one environment rank per sampler rank) it measures, after a warm-up:

- `rollouts_per_s`, `tokens_per_s`: episodes finished through the controller;
- `cpu_us_per_rollout`: the controller process's CPU (getrusage, every thread) per rollout;
- `bytes_per_rollout`, `bytes_ratio`: trajectory data through the controller per rollout
  (in from environments + out to the trainer; a held trajectory's ref counts as its JSON),
  over one trajectory's bytes;
- `cpu_bound_rollouts_per_s`: rollouts per second of controller CPU, the rate one core
  would sustain (on a machine shared with other jobs the controller may not get its core,
  and `rollouts_per_s` then says more about the machine than about the controller);
- `steps_per_s`, `train_call_s`: train steps, and the train step call's wall time (the
  controller's recent average: the fake trainer's fetch of held trajectories and its
  consuming time); a period (1 / `steps_per_s`) close to `train_call_s` means the trainer's
  side bounds the rate, not the producer;
- `actors_cpu_util`: the fake actors' processes' CPU over the same window, in cores, per
  mesh (`trainer`, `samplers`, `envs`): with `cpu_util`, how much of the machine the run
  took (on a small machine the fakes and the controller share the cores);
- `pings_per_s`: liveness pings the controller sent (a rank that answered an episode or a
  weight update since its last ping needs none);
- `rss_mb`, `in_flight_mean`: the controller's resident memory and rollouts in flight;
- `decision_us_p50/p99`: the producer's placement decisions (slot -> pool, rank, env rank),
  wall time (on a machine shared with other jobs the tail counts their time slices too).

The headline keys are those of the largest fleet; `growth` divides each of its figures by
the smallest fleet's. The controller runs in this process, pinned to one core
(`os.sched_setaffinity`) after the actor processes started, so they keep the other cores.
`--profile FILE` writes a cProfile of the controller's measured window.

`--soak N` instead runs N train steps of small batches (`benchmarks/_soak.py`), sampling the
controller's RSS, open file descriptors and per-step time, and checks that metrics and
checkpoints keep their size bounds.

How: `python benchmarks/fleet.py [--quick] [--tokens 1024] [--support 16] [--ranks 8,256]`,
`python benchmarks/fleet.py --soak 10000`. The last line of output is one JSON object.
Unless `--no-compare`, the largest fleet runs a second time with `[rollout] hold_trajectories
= false` (every trajectory's tensors through the controller, env -> controller -> trainer);
its figures are `through_controller` beside the held path's headline.
Targets (issue 30): rollouts_per_s >= 2000 (1k tokens, 256 ranks, one core),
decision_us_p99 <= 100, controller_bytes_ratio <= 0.05; soak.rss_growth <= 0.05.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import resource
import statistics
import sys
import time
from typing import Any

import trio
from _runs import load_average, process_cpu_s

from hardware import CostLedger, ModelSpec, Scheduler, ThroughputModel
from orchestrator.controller import Controller, ControllerState, Links
from orchestrator.runtime import open_mesh
from orchestrator.state.config import RunConfig
from orchestrator.state.progress import Progress


def rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def proc_cpu_s(pids: list[int | None]) -> float:
    """CPU seconds (user + system, every thread) of the live processes among ``pids``."""
    return sum(c for pid in pids if pid is not None and (c := process_cpu_s(pid)) is not None)


def fleet_config(
    ranks: int, pools: int, batch: int, group: int, steps: int, per_rank: int, hold: bool = True
) -> RunConfig:
    pools = max(1, min(pools, ranks))
    sizes = [ranks // pools + (i < ranks % pools) for i in range(pools)]
    gpus = ["H100-SXM", "H200", "A100-80GB", "L40S", "B200"]
    raw: dict[str, Any] = {
        "steps": steps,
        "rollout": {
            "prompts_per_step": batch // group,
            "group_size": group,
            "max_buffered_groups": batch // group,
            "hold_trajectories": hold,
        },
        "pools": [
            {
                "name": f"pool{i}",
                "gpu": gpus[i % len(gpus)],
                "count": n,
                "staleness_budget": 2,
                "max_concurrent_rollouts": per_rank * n,
            }
            for i, n in enumerate(sizes)
        ],
        "faults": {"unresponsive_after_s": 30.0, "give_up_after_s": 600.0},
    }
    return RunConfig.model_validate(raw)


class Metrics:
    """Step records, kept only as a count and the last one (the sink of a benchmark)."""

    def __init__(self) -> None:
        self.steps = 0
        self.last: dict[str, Any] | None = None
        self.step_times: list[float] = []

    def write(self, record: dict[str, Any]) -> None:
        self.steps += 1
        self.last = record
        self.step_times.append(time.perf_counter())

    def truncate(self, last_step: int) -> None:
        pass


class GcWatch:
    """CPU seconds the collecting thread spent in the cyclic garbage collector while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._t


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


async def measure_all(args: argparse.Namespace, sizes: list[int]) -> list[dict[str, Any]]:
    """One set of actor processes for every fleet size (they host any number of ranks)."""
    from _fleet import FleetEnv, FleetSampler, FleetTrainer

    runs = []
    async with (
        open_mesh(FleetTrainer, args.train_rate, procs=1, name="trainer") as tmesh,
        open_mesh(FleetSampler, procs=args.procs, name="samplers") as smesh,
        open_mesh(FleetEnv, 128, args.tokens, args.support, args.episode_s, 0, procs=args.procs, name="envs") as emesh,
    ):
        for n in sizes:
            r = await measure(args, n, tmesh, smesh, emesh, hold=not args.through_controller)
            print(json.dumps(r), flush=True)
            runs.append(r)
        if args.compare:  # the largest fleet again, every trajectory through the controller
            r = await measure(args, sizes[-1], tmesh, smesh, emesh, hold=False)
            print(json.dumps(r), flush=True)
            runs.append(r)
    return runs


async def measure(
    args: argparse.Namespace, ranks: int, tmesh: Any, smesh: Any, emesh: Any, hold: bool
) -> dict[str, Any]:
    from _fleet import DataMeter, FleetEnvs, FleetPool, FleetTrainerLink

    cfg = fleet_config(ranks, args.pools, args.batch, args.group, 10**9, args.per_rank, hold)
    meter = DataMeter()
    links = Links(
        trainer=FleetTrainerLink(tmesh, meter, emesh),
        pools={pc.name: FleetPool(pc, smesh, pc.count, meter) for pc in cfg.pools},
        envs=FleetEnvs(emesh, ranks, meter),
    )
    scheduler = Scheduler(
        cfg.pools,
        ThroughputModel(cfg.pools, ModelSpec(total_params=8e9, active_params=8e9)),
        mean_rollout_tokens=args.tokens,
    )
    metrics = Metrics()
    controller = Controller(
        cfg,
        links,
        ControllerState(version=await links.trainer.version()),
        scheduler=scheduler,
        ledger=CostLedger(cfg.pools),
        metrics=metrics,
        progress=Progress(cfg.steps, quiet=True),
        handle_sigint=False,
    )
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    result: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(controller.run)
        await trio.sleep(args.warmup_s)
        ctx = controller.ctx
        ctx.decision_ns.clear()
        gcw = GcWatch()
        gc.callbacks.append(gcw)
        meshes = {"trainer": tmesh, "samplers": smesh, "envs": emesh}
        a0 = {k: proc_cpu_s(m.pids) for k, m in meshes.items()}
        m0, c0, t0, s0 = meter.snapshot(), cpu_s(), time.perf_counter(), metrics.steps
        prof = cProfile.Profile() if args.profile else None
        if prof:
            prof.enable()
        in_flight: list[int] = []
        rss: list[float] = []
        end = t0 + args.window_s
        while time.perf_counter() < end:
            await trio.sleep(0.25)
            in_flight.append(ctx.buffer.in_flight)
            rss.append(rss_mb())
        if prof:
            prof.disable()
            prof.dump_stats(f"{args.profile}.{ranks}")
        m1, c1, t1, s1 = meter.snapshot(), cpu_s(), time.perf_counter(), metrics.steps
        a1 = {k: proc_cpu_s(m.pids) for k, m in meshes.items()}
        gc.callbacks.remove(gcw)
        decisions = [d / 1000 for d in ctx.decision_ns]
        train_call_s = ctx.train_s_ewma
        nursery.cancel_scope.cancel()
    os.sched_setaffinity(0, range(os.cpu_count() or 1))
    n = m1[2] - m0[2]
    wall = t1 - t0
    traj_b = (m1[3] - m0[3]) / max(n, 1)
    trained = m1[4] - m0[4]
    # In per arrived trajectory + out per trained one (steps are coarser than episodes).
    through = (m1[0] - m0[0]) / max(n, 1) + ((m1[1] - m0[1]) / trained if trained else traj_b)
    result = {
        "ranks": ranks,
        "hold_trajectories": hold,
        "rollouts_per_s": round(n / wall, 1),
        "tokens_per_s": round(n * args.tokens / wall),
        "steps_per_s": round((s1 - s0) / wall, 2),
        "train_call_s": round(train_call_s, 3),
        "cpu_us_per_rollout": round((c1 - c0) / max(n, 1) * 1e6, 1),
        "cpu_bound_rollouts_per_s": round(n / (c1 - c0), 1) if c1 > c0 else None,
        "cpu_util": round((c1 - c0) / wall, 3),
        # The fakes' processes over the same window (cores, summed over a mesh's processes):
        # with the controller's, how much of the machine the run took.
        "actors_cpu_util": {k: round((a1[k] - a0[k]) / wall, 3) for k in meshes},
        "pings_per_s": round((m1[5] - m0[5]) / wall, 1),
        "gc_share": round(gcw.seconds / max(c1 - c0, 1e-9), 3),
        "bytes_per_rollout": round(through),
        "trajectory_bytes": round(traj_b),
        "bytes_ratio": round(through / traj_b, 3) if traj_b else None,
        "rss_mb": round(max(rss), 1),
        "in_flight_mean": round(statistics.fmean(in_flight), 1),
        "decision_us_p50": round(_pct(decisions, 0.5), 1),
        "decision_us_p99": round(_pct(decisions, 0.99), 1),
        "decisions": len(decisions),
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="under a minute, same keys")
    ap.add_argument("--tokens", type=int, default=1024, help="generated tokens per trajectory")
    ap.add_argument("--support", type=int, default=16, help="mean ids per support row")
    ap.add_argument("--ranks", default="8,32,256", help="fleet sizes (sampler ranks), comma-separated")
    ap.add_argument("--pools", type=int, default=4)
    ap.add_argument("--procs", type=int, default=2, help="processes hosting the sampler and env ranks")
    ap.add_argument("--per-rank", type=int, default=4, help="rollouts in flight per sampler rank")
    ap.add_argument("--batch", type=int, default=1024, help="rollouts per train step")
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--episode-s", type=float, default=0.02)
    ap.add_argument("--train-rate", type=float, default=1e5, help="rollouts/s the fake trainer consumes")
    ap.add_argument("--warmup-s", type=float, default=6.0)
    ap.add_argument("--window-s", type=float, default=15.0)
    ap.add_argument("--core", type=int, default=0, help="core to pin the controller to (-1: none)")
    ap.add_argument("--profile", default=None, help="cProfile of the measured window to FILE.<ranks>")
    ap.add_argument("--soak", type=int, default=0, help="run the soak: this many train steps")
    ap.add_argument(
        "--through-controller",
        action="store_true",
        help="every fleet size with [rollout] hold_trajectories = false (tensors through the controller)",
    )
    ap.add_argument(
        "--no-compare",
        dest="compare",
        action="store_false",
        help="skip the largest fleet's second run with every trajectory through the controller",
    )
    args = ap.parse_args()
    if args.core is not None and args.core < 0:
        args.core = None
    if args.soak:
        from _soak import soak

        out = {"bench": "fleet.soak", "load_avg": load_average(), "soak": trio.run(soak, args)}
        print(json.dumps(out))
        return
    if args.quick:
        args.ranks, args.warmup_s, args.window_s = "8,256", 4.0, 8.0
    try:
        sizes = sorted({int(x) for x in args.ranks.split(",")})
    except ValueError:
        sys.exit(f"--ranks: expected comma-separated integers, got {args.ranks!r}")
    if not sizes or sizes[0] < 1:
        sys.exit(f"--ranks: every fleet size must be >= 1, got {args.ranks!r}")
    load0 = load_average()
    runs = trio.run(measure_all, args, sizes)
    through = runs.pop() if args.compare else None
    big, small = runs[-1], runs[0]
    growth = {
        k: round(big[k] / small[k], 2) if small[k] else None
        for k in ("rollouts_per_s", "cpu_us_per_rollout", "bytes_per_rollout", "rss_mb", "decision_us_p99")
    }
    out = {
        "bench": "fleet",
        "quick": args.quick,
        "tokens": args.tokens,
        "support": args.support,
        "batch": args.batch,
        "ranks": big["ranks"],
        "rollouts_per_s": big["rollouts_per_s"],
        "tokens_per_s": big["tokens_per_s"],
        "cpu_us_per_rollout": big["cpu_us_per_rollout"],
        "cpu_bound_rollouts_per_s": big["cpu_bound_rollouts_per_s"],
        "controller_bytes_per_rollout": big["bytes_per_rollout"],
        "controller_bytes_ratio": big["bytes_ratio"],
        "rss_mb": big["rss_mb"],
        "in_flight_mean": big["in_flight_mean"],
        "decision_us_p99": big["decision_us_p99"],
        "growth": growth,
        "hold_trajectories": big["hold_trajectories"],
        "through_controller": None
        if through is None
        else {
            k: through[k]
            for k in (
                "rollouts_per_s",
                "cpu_us_per_rollout",
                "cpu_bound_rollouts_per_s",
                "bytes_ratio",
                "decision_us_p99",
            )
        },
        "by_ranks": runs if through is None else [*runs, through],
        "load_avg": [load0, load_average()],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
