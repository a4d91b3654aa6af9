"""Chaos: the demo under a fault schedule, and what it cost.

Runs `examples/guess_number.toml` (fewer steps) with the real controller and actor
processes, and, while it trains:

- SIGKILLs a sampler twice (one per pool, at random steps), an env actor once and the
  trainer once (with `[checkpoint] every_steps` set);
- injects 100 bad weight messages into a live sampler: corrupted payloads, forged
  versions and replays of an old keyframe;
- plays a task that raises in 10% of its steps (`benchmarks/chaos_tasks.py`);
- stops the run once as the first Ctrl-C does (`Controller.stop`: finish the step,
  checkpoint) and resumes it (`run_async(resume=True)`), as `flotilla run --resume` does.
  The real SIGINT path is covered by tests/integration.
- floods the env actor with 10,000 malformed wire messages (`benchmarks/_integrity.py`)
  while the run's console is captured, and afterwards damages copies of the run's real
  checkpoint in every way resume must refuse (bytes XORed, NaN bytes, a bad header, a
  corrupted newest beside a good older one, all corrupted).

It ends with one JSON line: `run_completed`, `prompts_lost` (prompts that entered and were
neither trained, still buffered, nor counted as skipped), `prompts_skipped`,
`steps_repeated_after_trainer_kill`, `recover_s_max` (fault -> next trained step),
`bad_weight_messages_accepted` (a corrupted or forged message applied, or a replayed
old keyframe that rolled the sampler back), `controller_cpu_while_trainer_dead` (cores),
`corrupt_checkpoints_loaded` (of the corruption cases, target 0) and
`log_lines_per_minute_max` (console lines per minute, the per-step progress line
excluded: the higher of the rate during the flood and the busiest 60 s of the faulted
run; target <= 60), with `log_line_chars_max`.

A second run (`_chaos_stalls`) freezes one of two pools' sampler (SIGSTOP, 60 s; 8 s with
--quick) and then kills the `flotilla host` of the other pool (down 30 s; 6 s), and adds
`normal_step_s`, `frozen_sampler_stall_s`, `frozen_detected_s`, `host_loss_stall_s`,
`host_reattached_s` and `log_lines_per_minute_max` (targets: both stalls at most twice
`normal_step_s`, detection within 10 s, at most 60 log lines a minute).

    python benchmarks/chaos.py            # 120 steps
    python benchmarks/chaos.py --quick    # 40 steps
    python benchmarks/chaos.py --quick --only-stalls   # the stall run alone
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from _chaos_stalls import run_stalls, run_stalls_apart
from _runs import ROOT, demo_raw, load_average


def _forgeries(
    keyframe: list[bytes], current: list[bytes], rng: random.Random, n: int
) -> list[tuple[str, list[bytes]]]:
    """`n` bad messages: a byte flipped in a payload chunk, a forged version in the
    metadata, or the old keyframe replayed as it was."""
    out = []
    for i in range(n):
        kind = ("corrupt", "forged", "replay")[i % 3]
        if kind == "replay":
            out.append((kind, list(keyframe)))
            continue
        frames = [bytearray(f) for f in current]
        if kind == "corrupt":
            j = rng.randrange(1, len(frames)) if len(frames) > 1 else 0
            k = rng.randrange(len(frames[j]))
            frames[j][k] ^= 1 << rng.randrange(8)
        else:
            meta = json.loads(frames[0])
            meta["version"] = int(meta["version"]) + rng.randint(1, 1000)
            frames[0] = bytearray(json.dumps(meta).encode())
        out.append((kind, [bytes(f) for f in frames]))
    return out


class Schedule:
    """Runs the faults from inside the run (`run_async(observer=...)`) and times recovery."""

    def __init__(self, steps: int, rng: random.Random, every_steps: int) -> None:
        pools_at = sorted(rng.sample(range(4, steps // 2), 2))
        self.kills = sorted(
            [
                (pools_at[0], "pool0"),
                (pools_at[1], "pool1"),
                (steps // 4 + 1, "env"),
                (every_steps * 2 + every_steps // 2, "trainer"),
            ]
        )
        self.inject_at = steps // 3
        self.stop_at = (steps * 2) // 3
        self.rng = rng
        self.keyframe: list[bytes] | None = None
        self.recoveries: list[tuple[str, float]] = []
        self.bad_accepted = 0
        self.bad_sent = 0
        self.repeated = 0
        self.cpu_while_dead: float | None = None
        self.stopped = False

    async def __call__(self, run: Any) -> None:
        import trio

        from orchestrator.runtime import ActorError

        ctl, meshes = run.controller, run.meshes
        pools = [k for k in meshes if k.startswith("pool:")]
        state = ctl.state
        while True:
            step = state.step
            if self.keyframe is None:
                self.keyframe = await meshes["trainer"][0].keyframe.call_one("bf16")
            if self.kills and step >= self.kills[0][0]:
                what = self.kills.pop(0)[1]
                mesh = (
                    meshes["trainer"]
                    if what == "trainer"
                    else meshes["env"]
                    if what == "env"
                    else meshes[pools[int(what[-1]) % len(pools)]]
                )
                pid = mesh.pids[0]
                t0, cpu0 = time.monotonic(), time.process_time()
                os.kill(pid, signal.SIGKILL)
                if what == "trainer":
                    while state.trainer_restarts == 0 or ctl.restoring_trainer:
                        await trio.sleep(0.02)
                    self.cpu_while_dead = (time.process_time() - cpu0) / (time.monotonic() - t0)
                    self.repeated = step - state.step  # the restore moved the step back
                target = state.step
                while state.step <= target:
                    await trio.sleep(0.02)
                self.recoveries.append((what, time.monotonic() - t0))
                continue
            if step >= self.inject_at and self.bad_sent == 0:
                pool = meshes[pools[0]]
                current = await meshes["trainer"][0].keyframe.call_one("bf16")
                for kind, frames in _forgeries(self.keyframe, current, self.rng, 100):
                    self.bad_sent += 1
                    held = await pool[0].version.call_one()
                    try:
                        now = await pool[0].apply_weights.call_one([frames])
                    except ActorError:
                        continue  # refused
                    # A corrupted or forged message must be refused outright. An old keyframe
                    # may be kept aside by a sampler that waits for one (never used unless
                    # deltas bring it past what it holds): accepted only if it rolled back.
                    if kind != "replay" or now < held:
                        self.bad_accepted += 1
            if step >= self.stop_at and not self.stopped:
                self.stopped = True
                ctl.stop()
                return
            await trio.sleep(0.05)


# -- corrupted checkpoints and log floods ------------------------------------------------------
# Self-contained (benchmarks/_integrity.py): an observer that floods the env actor, run
# beside the fault schedule; the corruption cases on a copy of the first run's checkpoint.


class Flood:
    """Observer: once the run has trained `at_step` steps, floods the env actor's address
    with malformed messages; `window` is when (monotonic seconds), for the console count."""

    def __init__(self, at_step: int, seconds: float) -> None:
        self.at_step, self.seconds = at_step, seconds
        self.window: tuple[float, float] | None = None
        self.info: dict[str, Any] = {}

    async def __call__(self, run: Any) -> None:
        import trio
        from _integrity import flood

        while run.controller.state.step < self.at_step:
            await trio.sleep(0.05)
        from orchestrator.runtime import ActorDied

        t0 = time.monotonic()
        env = run.meshes["env"]
        try:
            pid = env.pids[0]
            before = (await env[0].runtime_stats.call_one())["rejected_messages"]
            self.info = await flood(env.addresses[0], 10_000, self.seconds)
            self.window = (t0, time.monotonic())
            after = (await env[0].runtime_stats.call_one())["rejected_messages"]
            # What the env actor refused, unless the fault schedule replaced it meanwhile.
            self.info["flood_rejected"] = after - before if env.pids[0] == pid else None
        except ActorDied:
            self.window = self.window or (t0, time.monotonic())
            self.info["flood_rejected"] = None


def both(*observers: Any) -> Any:
    """One `run_async` observer running several side by side (each may return early)."""

    async def observe(run: Any) -> None:
        import trio

        async with trio.open_nursery() as n:
            for o in observers:
                n.start_soon(o, run)

    return observe


def integrity_results(
    console: Any, run_span: tuple[float, float], flood_obs: Flood, checkpoint: Path, work: Path
) -> dict[str, Any]:
    """`log_lines_per_minute_max`: the higher of the flood's rate and the busiest minute of
    the whole faulted run (console lines but the per-step progress line); then the
    corruption cases on `checkpoint`."""
    from _integrity import corrupt_checkpoint_cases

    out: dict[str, Any] = dict(flood_obs.info)
    run_rate = console.lines_per_minute_max(*run_span)
    out["run_log_lines_per_minute_max"] = run_rate
    if flood_obs.window is not None:
        start, end = flood_obs.window[0], flood_obs.window[1] + 2.0
        out["flood_log_lines"] = len(console.log_lines(start, end))
        out["flood_log_lines_per_minute"] = console.lines_per_minute_max(start, end)
        out["log_lines_per_minute_max"] = max(run_rate, out["flood_log_lines_per_minute"])
    else:
        out["log_lines_per_minute_max"] = None  # the run ended before the flood
    out["log_line_chars_max"] = console.longest_line(*run_span)
    t0 = time.monotonic()
    out.update(corrupt_checkpoint_cases(checkpoint, work))
    out["corrupt_checkpoint_cases_s"] = round(time.monotonic() - t0, 1)
    return out


# -- end of corrupted checkpoints and log floods ------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="40 steps instead of 120")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only-stalls", action="store_true", help="only the frozen-sampler and host-loss run")
    ap.add_argument(
        "--unresponsive-after-s",
        type=float,
        default=None,
        help="the stall run's [faults] unresponsive_after_s (default: the config's)",
    )
    args = ap.parse_args()
    if args.only_stalls:
        t0 = time.monotonic()
        stalls = run_stalls(args.quick, args.unresponsive_after_s)
        print(
            json.dumps(
                {
                    "benchmark": "chaos",
                    "quick": args.quick,
                    **stalls,
                    "wall_s": round(time.monotonic() - t0, 1),
                    "load_average": load_average(),
                }
            )
        )
        return
    steps = args.steps or (40 if args.quick else 120)
    every = 5 if args.quick else 10

    import trio

    from orchestrator.entry.runner import run_async
    from orchestrator.state.config import load_config
    from orchestrator.state.progress import Progress

    raw = demo_raw()
    tmp = Path(tempfile.mkdtemp(prefix="flotilla-chaos-"))
    raw.update(name="chaos", steps=steps, run_root=str(tmp))
    raw["checkpoint"] = {"every_steps": every, "max_restarts": 3}
    raw["task"]["name"] = "flaky_guess_number"
    raw["task"]["modules"] = [str(ROOT / "benchmarks" / "chaos_tasks.py")]
    raw["task"]["params"] = {**raw["task"]["params"], "fail_rate": 0.1}
    cfg = load_config(raw=raw)
    schedule = Schedule(steps, random.Random(args.seed), every)
    from _integrity import ConsoleCapture

    flood_obs = Flood(at_step=2, seconds=5.0 if args.quick else 30.0)
    t0 = time.monotonic()
    try:
        with ConsoleCapture() as console:
            first_start = time.monotonic()
            first = trio.run(lambda: run_async(cfg, progress=Progress(steps), observer=both(schedule, flood_obs)))
            run_span = (first_start, time.monotonic())
        shutil.copytree(cfg.run_dir / "checkpoint", tmp / "first-checkpoint")
        second = trio.run(lambda: run_async(cfg, resume=True, progress=Progress(steps)))
        rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
        integrity = integrity_results(console, run_span, flood_obs, tmp / "first-checkpoint", tmp / "corrupt")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    c = second.counts
    lost = c["groups_in"] - c["groups_trained"] - c["groups_buffered"] - c["groups_skipped"]
    result = {
        "benchmark": "chaos",
        "quick": args.quick,
        "steps": steps,
        "every_steps": every,
        "run_completed": second.steps_done == steps and [r["step"] for r in rows] == list(range(1, steps + 1)),
        "interrupted_at": first.steps_done,
        "prompts_lost": lost,
        "prompts_skipped": c["groups_skipped"],
        "dropped_failed": c["dropped_failed"],
        "steps_repeated_after_trainer_kill": schedule.repeated,
        "recover_s": {what: round(s, 2) for what, s in schedule.recoveries},
        "recover_s_max": round(max(s for _, s in schedule.recoveries), 2) if schedule.recoveries else None,
        "faults_injected": len(schedule.recoveries),
        "bad_weight_messages_sent": schedule.bad_sent,
        "bad_weight_messages_accepted": schedule.bad_accepted,
        "controller_cpu_while_trainer_dead": round(schedule.cpu_while_dead, 3)
        if schedule.cpu_while_dead is not None
        else None,
        **integrity,
        "final_reward_10": round(sum(r["reward_mean"] for r in rows[-10:]) / min(10, len(rows)), 3),
        **run_stalls_apart(args.quick, args.unresponsive_after_s),
        "wall_s": round(time.monotonic() - t0, 1),
        "load_average": load_average(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
