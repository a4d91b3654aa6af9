"""The chaos benchmark's stall phase: a frozen sampler and a lost host, in one run.

One run of the demo with its FP8 pool placed on a `flotilla host` subprocess (loopback
tcp + CurveZMQ) and its BF16 pool local. While it trains:

1. steps before any fault give `normal_step_s` (median time between steps);
2. the BF16 sampler is SIGSTOPped for `freeze_s` while the FP8 pool goes on:
   `frozen_sampler_stall_s` is the longest time without a step in that window,
   `frozen_detected_s` the time until the console names the sampler unresponsive;
3. the host is SIGKILLed (its sampler goes with it) and started again on the same port
   after `host_down_s`: `host_loss_stall_s` is the longest time without a step while it is
   down, `host_reattached_s` the time from its restart to the console saying the sampler
   is back;
4. `log_lines_per_minute_max`: the most console lines (stderr of the controller, the host
   and every actor, per-step progress lines excepted) in any 60 s during those faults.

`run_stalls(quick)` returns these keys; chaos.py adds them to its JSON line, measured in
a process of its own (`run_stalls_apart`): a process's telemetry belongs to its first run.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from itertools import pairwise
from pathlib import Path
from typing import Any, Self

from _runs import ROOT, demo_raw

__all__ = ["run_stalls", "run_stalls_apart"]

STEP_LINE = "step "  # the progress line each step prints (not a log line)


class ConsoleTap:
    """Every line written to this process's fd 2, and so to its children's (they inherit
    it), timestamped and passed on to the real stderr."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self._saved = -1
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        sys.stderr.flush()
        r, w = os.pipe()
        self._saved = os.dup(2)
        os.dup2(w, 2)
        os.close(w)
        self._thread = threading.Thread(target=self._pump, args=(r,), daemon=True)
        self._thread.start()
        return self

    def _pump(self, r: int) -> None:
        buf = b""
        with os.fdopen(r, "rb", buffering=0) as src:
            while chunk := src.read(65536):
                os.write(self._saved, chunk)
                buf += chunk
                *done, buf = buf.split(b"\n")
                now = time.monotonic()
                self.lines.extend((now, ln.decode(errors="replace")) for ln in done)

    def __exit__(self, *exc: object) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)  # the pipe closes once the last child holding it exits
        if self._thread is not None:
            self._thread.join(timeout=10)

    def first(self, text: str, after: float) -> float | None:
        return next((t for t, ln in self.lines if t >= after and text in ln), None)

    def max_per_minute(self, windows: list[tuple[float, float]]) -> int:
        """The most log lines (progress lines excepted) in any 60 s inside `windows`."""
        times = sorted(
            t
            for t, ln in self.lines
            if ln.strip() and not ln.startswith(STEP_LINE) and any(a <= t <= b for a, b in windows)
        )
        best, lo = 0, 0
        for hi, t in enumerate(times):
            while t - times[lo] > 60.0:
                lo += 1
            best = max(best, hi - lo + 1)
        return best


TRACE_VARS = ("FLOTILLA_TRACE_FILE", "FLOTILLA_SERVICE_NAME")
"""Where a process's spans go, inherited by processes it starts: a host (and the samplers it
spawns) and the stall run must not write into an earlier run's directory."""


def _fresh_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TRACE_VARS}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _start_host(keys: Path, bind: str) -> tuple[subprocess.Popen[bytes], str]:
    env = _fresh_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.entry.cli", "host", "--bind", bind, "--keys", str(keys)],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    assert proc.stdout is not None
    lines = [proc.stdout.readline().decode() for _ in range(2)]
    if not lines[1]:
        raise RuntimeError(f"flotilla host did not start: {lines!r}")
    return proc, lines[1].split()[-1]


def _keys(tmp: Path) -> tuple[Path, Path]:
    """Host and controller key directories, each allowing the other."""
    from orchestrator.runtime import Curve

    host, ctl = tmp / "host-keys", tmp / "controller-keys"
    Curve.from_dir(host)
    Curve.from_dir(ctl)
    (host / "allowed").mkdir()
    shutil.copy(ctl / "id.key", host / "allowed" / "controller.key")
    (ctl / "hosts").mkdir()
    return host, ctl


def _longest_gap(steps: list[float], lo: float, hi: float) -> float:
    points = [lo, *(t for t in steps if lo < t < hi), hi]
    return max(b - a for a, b in pairwise(points))


class StallSchedule:
    """The faults of the stall phase, run from inside the run (`run_async(observer=...)`)."""

    def __init__(
        self,
        tap: ConsoleTap,
        host: list[Any],
        host_keys: Path,
        address: str,
        *,
        warm: int,
        normal: int,
        freeze_s: float,
        host_down_s: float,
        reattach_wait_s: float,
    ) -> None:
        self.tap, self.host, self.host_keys, self.address = tap, host, host_keys, address
        self.warm, self.normal, self.freeze_s, self.host_down_s = warm, normal, freeze_s, host_down_s
        self.reattach_wait_s = reattach_wait_s
        self.step_t: list[float] = []
        self.marks: dict[str, float] = {}

    async def __call__(self, run: Any) -> None:
        import trio

        state = run.controller.state

        async def record() -> None:
            seen = state.step
            while True:
                if state.step != seen:
                    seen = state.step
                    self.step_t.append(time.monotonic())
                await trio.sleep(0.01)

        async def steps(n: int) -> None:
            target = state.step + n
            while state.step < target:
                await trio.sleep(0.02)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(record)
            await steps(self.warm)
            self.marks["normal_from"] = time.monotonic()
            await steps(self.normal)
            pid = run.meshes["pool:b200-bf16"].pids[0]
            self.marks["freeze"] = time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            try:
                await trio.sleep(self.freeze_s)
            finally:
                os.kill(pid, signal.SIGCONT)
            self.marks["thaw"] = time.monotonic()
            await steps(5)
            self.marks["kill"] = time.monotonic()
            self.host[0].kill()
            await trio.to_thread.run_sync(self.host[0].wait)
            await trio.sleep(self.host_down_s)
            self.marks["restart"] = time.monotonic()
            self.host[0], _ = await trio.to_thread.run_sync(_start_host, self.host_keys, self.address)
            with trio.move_on_after(self.reattach_wait_s):
                while self.tap.first("sampler h100-fp8/0 is back", self.marks["restart"]) is None:
                    await trio.sleep(0.1)
            self.marks["back"] = time.monotonic()
            await steps(3)
            self.marks["end"] = time.monotonic()
            run.controller.stop()
            nursery.cancel_scope.cancel()

    def results(self) -> dict[str, Any]:
        m, st = self.marks, self.step_t
        normal = [b - a for a, b in pairwise(st) if m["normal_from"] <= a and b <= m["freeze"]]
        detected = self.tap.first("sampler b200-bf16/0 is unresponsive", m["freeze"])
        back = self.tap.first("sampler h100-fp8/0 is back", m["restart"])
        windows = [(m["freeze"], m["kill"]), (m["kill"], m["end"])]
        if os.environ.get("FLOTILLA_STALLS_DEBUG"):
            print(
                "DEBUG",
                {k: round(v - m["freeze"], 2) for k, v in m.items()},
                [round(t - m["freeze"], 2) for t in st],
                file=sys.stderr,
            )
        return {
            "normal_step_s": round(statistics.median(normal), 3),
            "frozen_sampler_stall_s": round(_longest_gap(st, m["freeze"], m["thaw"]), 3),
            "frozen_detected_s": round(detected - m["freeze"], 2) if detected is not None else None,
            "frozen_s": self.freeze_s,
            "host_loss_stall_s": round(_longest_gap(st, m["kill"], m["restart"]), 3),
            "host_down_s": self.host_down_s,
            "host_reattached_s": round(back - m["restart"], 2) if back is not None else None,
            "log_lines_per_minute_max": self.tap.max_per_minute(windows),
        }


def run_stalls(quick: bool, unresponsive_after_s: float | None = None) -> dict[str, Any]:
    """The stall phase (see the module docstring); quick: shorter faults;
    `unresponsive_after_s`: the run's `[faults]` setting (None: its default)."""
    import trio

    from orchestrator.entry.runner import run_async
    from orchestrator.state.config import load_config
    from orchestrator.state.progress import Progress

    tmp = Path(tempfile.mkdtemp(prefix="flotilla-stalls-"))
    host_keys, keys = _keys(tmp)
    host = [None]
    try:
        with ConsoleTap() as tap:
            host[0], address = _start_host(host_keys, "tcp://127.0.0.1:0")
            ip, _, port = address.removeprefix("tcp://").rpartition(":")
            shutil.copy(host_keys / "id.key", keys / "hosts" / f"{ip}_{port}.key")
            raw = demo_raw()
            raw.update(name="stalls", steps=10_000, run_root=str(tmp))
            raw["checkpoint"] = {"every_steps": None}
            if unresponsive_after_s is not None:
                raw["faults"] = {"unresponsive_after_s": unresponsive_after_s}
            raw["pools"][1].update(hosts=[address], keys=str(keys))
            cfg = load_config(raw=raw)
            schedule = StallSchedule(
                tap,
                host,
                host_keys,
                address,
                warm=3,
                normal=6 if quick else 15,
                freeze_s=8.0 if quick else 60.0,
                host_down_s=6.0 if quick else 30.0,
                reattach_wait_s=30.0 if quick else 120.0,
            )
            trio.run(lambda: run_async(cfg, progress=Progress(cfg.steps), observer=schedule))
    finally:
        if host[0] is not None:
            host[0].kill()
            host[0].wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return {**schedule.results(), "unresponsive_after_s": cfg.faults.unresponsive_after_s}


def run_stalls_apart(quick: bool, unresponsive_after_s: float | None = None) -> dict[str, Any]:
    """`run_stalls` in a fresh process (`chaos.py --only-stalls`); its keys from the JSON
    line it prints. Its console passes through."""
    import json

    cmd = [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--only-stalls"] + (["--quick"] if quick else [])
    if unresponsive_after_s is not None:
        cmd += ["--unresponsive-after-s", str(unresponsive_after_s)]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, check=True, env=_fresh_env())
    line = json.loads(out.stdout.decode().strip().splitlines()[-1])
    return {k: v for k, v in line.items() if k not in ("benchmark", "quick", "wall_s", "load_average")}
