"""Shared helpers of the controller benchmarks (async_vs_sync.py, ablation.py).

Builds run configs as raw dicts from the demo config (examples/guess_number.toml),
runs one config to completion with the real controller (`orchestrator.entry.runner.run_async`:
trainer, sampler and environment processes), and reads back its metrics and spans.
Each run gets its own run_root under a temporary directory, removed afterwards.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

DEMO = ROOT / "examples" / "guess_number.toml"

__all__ = [
    "DEMO",
    "ROOT",
    "CpuWatch",
    "RunOutput",
    "config_hash",
    "demo_raw",
    "intervals_union",
    "load_average",
    "process_cpu_s",
    "run_raw",
    "run_variants",
]


def demo_raw() -> dict[str, Any]:
    """The demo config as a raw dict (a fresh copy each call)."""
    with open(DEMO, "rb") as f:
        return copy.deepcopy(tomllib.load(f))


SCHEDULE_FIELDS = ("lr_decay_steps", "lr_final_ratio")
DEFAULT_FINAL_RATIO = 0.1  # actors.trainer.TrainerConfig.lr_final_ratio (checked by a test;
# importing it here would load torch into every benchmark's parent process)


def config_hash(raw: dict[str, Any]) -> str:
    """A short hash of a raw run config (key order does not matter).

    Records made before the learning rate decayed over the run by default (2026-12-05) ran
    at a constant rate with no schedule in their configs. So a constant-rate config hashes
    without its schedule fields (as those records did), and a run config whose rate decays
    (the default now) hashes its schedule too: it never matches a constant-rate record."""
    trainer = raw.get("trainer") or {}
    ratio = trainer.get("lr_final_ratio", DEFAULT_FINAL_RATIO)
    if ratio >= 1.0:  # only an explicit [trainer] lr_final_ratio gets here
        raw = {**raw, "trainer": {k: v for k, v in trainer.items() if k not in SCHEDULE_FIELDS}}
    elif "steps" in raw:
        raw = {**raw, "lr_schedule": [trainer.get("lr_decay_steps", raw["steps"]), ratio]}
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class RunOutput:
    """What one run left behind, read before its directory was removed."""

    metrics: list[dict[str, Any]]
    """metrics.jsonl, one dict per step."""
    spans: list[dict[str, Any]]
    """traces.jsonl, one dict per span (every process of the run)."""
    counts: dict[str, int]
    """The rollout buffer's counters at the end (groups in/trained/buffered, drops)."""
    total_s: float
    """Wall time of the whole run, process start-up and shutdown included."""
    cpu: CpuWatch | None = None
    """CPU time and run-queue waits sampled during the run (when asked for)."""


def run_raw(raw: dict[str, Any], *, keep_spans: bool = True, watch_cpu: bool = False) -> RunOutput:
    """Run `raw` (a run config dict) in a fresh temporary run_root; return its outputs.

    The controller pins itself to `placement.sampler_cpus` when that is set; this
    process's CPU affinity is restored afterwards so that one run's placement does not
    leak into the next. Errors of the run propagate (ConfigError, ActorError).
    With `watch_cpu`, a CpuWatch samples this process tree while the run lasts.
    """
    import trio

    from orchestrator.entry.runner import run_async
    from orchestrator.state.config import load_config
    from orchestrator.state.progress import Progress

    tmp = Path(tempfile.mkdtemp(prefix="flotilla-bench-"))
    affinity = os.sched_getaffinity(0)
    try:
        raw = copy.deepcopy(raw)
        raw["run_root"] = str(tmp)
        cfg = load_config(raw=raw)
        watch = CpuWatch() if watch_cpu else None
        t0 = time.monotonic()
        if watch is not None:
            watch.start()
        try:
            result = trio.run(lambda: run_async(cfg, progress=Progress(cfg.steps, quiet=True)))
        finally:
            if watch is not None:
                watch.stop()
        total = time.monotonic() - t0
        metrics = _read_jsonl(cfg.run_dir / "metrics.jsonl")
        spans = _read_jsonl(cfg.run_dir / "traces.jsonl") if keep_spans else []
        return RunOutput(metrics=metrics, spans=spans, counts=dict(result.counts), total_s=total, cpu=watch)
    finally:
        os.sched_setaffinity(0, affinity)
        shutil.rmtree(tmp, ignore_errors=True)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a span line cut short when a process was stopped
                continue
    return out


def intervals_union(intervals: list[tuple[int, int]], lo: int, hi: int) -> int:
    """Total length of the union of [start, end) intervals, clipped to [lo, hi)."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (timings on a loaded machine are noisy)."""
    return [round(x, 2) for x in os.getloadavg()]


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, every thread) process `pid` has used so far, from
    /proc/<pid>/stat; None when it cannot be read (the process is gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _read_ints(path: str) -> list[int] | None:
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):  # the thread or process is gone
        return None


class CpuWatch:
    """Samples, every `period` seconds, the CPU time and run-queue wait of every thread of
    this process and its descendants (/proc/<pid>/task/<tid>/schedstat) and the machine's
    busy and steal time (/proc/stat), so a benchmark can tell how much CPU its processes got
    in a window and how much went to other work on the machine.

    Linux only; a sampling thread runs between `start()` and `stop()`. Counters of a thread
    that ends between two samples lose at most one period of its time.
    """

    def __init__(self, period: float = 0.25) -> None:
        self.period = period
        self.samples: list[tuple[int, int, int, dict[tuple[int, int], tuple[int, int]]]] = []
        """(time_ns, machine busy ns, machine steal ns, {(pid, tid): (cpu ns, wait ns)})."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-watch", daemon=True)
        self._tick_ns = 10**9 // os.sysconf("SC_CLK_TCK")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def _pids(self) -> list[int]:
        import psutil

        me = psutil.Process()
        try:
            return [me.pid] + [c.pid for c in me.children(recursive=True)]
        except psutil.Error:
            return [me.pid]

    def _sample(self) -> None:
        t = time.time_ns()
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal guest guest_nice (guest is inside user)
        busy = sum(fields[:8]) - fields[3] - fields[4] - fields[7]
        steal = fields[7]
        threads: dict[tuple[int, int], tuple[int, int]] = {}
        for pid in self._pids():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                v = _read_ints(f"/proc/{pid}/task/{tid}/schedstat")
                if v:
                    threads[(pid, int(tid))] = (v[0], v[1])
        self.samples.append((t, busy * self._tick_ns, steal * self._tick_ns, threads))

    def window(self, start_ns: int, end_ns: int) -> dict[str, Any]:
        """CPU seconds and run-queue wait seconds per pid in [start_ns, end_ns] (nearest
        samples), plus the machine's busy and steal seconds and everything not ours."""
        inside = [s for s in self.samples if start_ns <= s[0] <= end_ns]
        if len(inside) < 2:
            return {}
        first, last = inside[0], inside[-1]
        cpu: dict[int, float] = {}
        wait: dict[int, float] = {}
        seen: dict[tuple[int, int], tuple[int, int]] = {}
        for _, _, _, threads in inside:
            seen.update(threads)  # the last value each thread showed inside the window
        for key, (c, w) in seen.items():
            c0, w0 = first[3].get(key, (0, 0))
            cpu[key[0]] = cpu.get(key[0], 0.0) + (c - c0) / 1e9
            wait[key[0]] = wait.get(key[0], 0.0) + (w - w0) / 1e9
        machine_busy = (last[1] - first[1]) / 1e9
        ours = sum(cpu.values())
        return {
            "seconds": (last[0] - first[0]) / 1e9,
            "cpu_s": cpu,
            "wait_s": wait,
            "machine_busy_s": machine_busy,
            "steal_s": (last[2] - first[2]) / 1e9,
            "others_cpu_s": max(0.0, machine_busy - ours),
        }


def run_variants(
    names: list[str],
    n_seeds: int,
    steps: int,
    build: Callable[[str, int], dict[str, Any]],
    figures: Callable[[list[dict[str, Any]]], dict[str, float]],
    record: Path | None = None,
    run: bool = True,
) -> dict[str, list[dict[str, float]]]:
    """Run every variant in `names` over seeds 0..n_seeds-1 (`build(name, seed)` gives the
    raw config), one after another, seed by seed (every variant's seed 0 first, so a run
    stopped early still compares all variants); each run's `figures(metrics)`, per variant,
    in seed order. Progress goes to stderr with the load average after each run.

    With `record`, each finished run's figures are appended there as a JSON line
    (variant, seed, steps, config hash, figures) and runs already recorded with the same
    steps and config are not run again: a long comparison survives being stopped and
    resumes where it was. A recorded run whose config hash differs from the one `build`
    gives now (its benchmark's base config changed) is ignored and run again; lines
    without a hash predate it and are taken as recorded. With `run=False` only recorded
    runs are returned (variants without any are left out).
    """
    done: dict[tuple[str, int], tuple[str | None, dict[str, float]]] = {}
    if record is not None and record.is_file():
        for line in record.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                if r.get("steps") == steps:
                    done[(r["variant"], r["seed"])] = (r.get("config"), r["figures"])
    out: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    stale = legacy = 0
    for seed in range(n_seeds):
        for name in names:
            raw = build(name, seed)
            digest = config_hash(raw)
            if (name, seed) in done:
                recorded, figs = done[(name, seed)]
                if recorded in (None, digest):
                    legacy += recorded is None
                    out[name].append(figs)
                    continue
                stale += 1
            if not run:
                continue
            print(f"running {name} seed {seed}: {steps} steps ...", file=sys.stderr, flush=True)
            result = run_raw(raw, keep_spans=False)
            figs = figures(result.metrics)
            out[name].append(figs)
            if record is not None:
                line = {"variant": name, "seed": seed, "steps": steps, "config": digest, "figures": figs}
                with record.open("a") as f:
                    f.write(json.dumps(line) + "\n")
            print(
                f"  {name} seed {seed}: "
                + ", ".join(f"{k} {v:.4g}" for k, v in figs.items())
                + f" ({result.total_s:.0f}s, load {load_average()})",
                file=sys.stderr,
                flush=True,
            )
    if legacy:
        print(
            f"{record}: {legacy} recorded run(s) predate config hashes and are taken as recorded: "
            "their config is the one of the record's date",
            file=sys.stderr,
        )
    if stale:
        print(
            f"{record}: {stale} recorded run(s) with another config than this one ignored"
            + ("" if run else " (not rerun: --report)"),
            file=sys.stderr,
        )
    return {name: per_seed for name, per_seed in out.items() if per_seed}
