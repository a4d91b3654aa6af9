"""Runs of `flotilla run` against hosts of the network rig (tests/netrig.py): a config with
local pools beside a remote one, the run as a subprocess in the root namespace, and what its
run directory says over time."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.integration.conftest import read_jsonl, small_run_raw

ROOT = Path(__file__).resolve().parents[2]


def demo_shape() -> tuple[dict[str, Any], int]:
    """The demo's task, batch and learning rate (examples/guess_number.toml, read here) with
    the default trace sampling, as top-level overrides of the test run, and the rollouts the
    demo lets each pool run at once: the run the partition target speaks of. The tests' run
    is a quarter of that batch, every span traced."""
    demo = tomllib.loads((ROOT / "examples" / "guess_number.toml").read_text())
    raw = {k: demo[k] for k in ("task", "rollout", "trainer")} | {"telemetry": {}}
    return raw, demo["pools"][0]["max_concurrent_rollouts"]


def remote_run_config(
    tmp: Path, name: str, remote: dict[str, Any], *, steps: int = 10_000, in_flight: int = 16, **raw: Any
) -> Path:
    """The small test run (two local CPU pools) plus the pool ``remote`` (its ``hosts`` and
    ``keys`` set by the caller); ``in_flight`` rollouts at most per pool; ``raw`` overrides
    top-level sections."""
    cfg = small_run_raw(tmp, name=name, steps=steps)
    cfg["pools"] = [
        {**cfg["pools"][0], "max_concurrent_rollouts": in_flight},
        {
            "name": "remote",
            "gpu": "H100-SXM",
            "device": "cpu",
            "staleness_budget": 2,
            "max_concurrent_rollouts": in_flight,
            **remote,
        },
    ]
    cfg.update(raw)
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


class Run:
    """`flotilla run CONFIG` in a subprocess (stdout and stderr to files in ``tmp``)."""

    def __init__(self, config: Path, run_dir: Path, *args: str) -> None:
        self.run_dir = run_dir
        self.out = config.with_suffix(".out")
        self.err = config.with_suffix(".err")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator", "run", str(config), *args],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )

    def metrics(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        text = path.read_text()
        return [json.loads(line) for line in text.splitlines()[: text.count("\n")] if line.strip()]

    def wait(self, until, timeout: float, what: str) -> list[dict[str, Any]]:
        """Poll the metrics until ``until(rows)`` is true; AssertionError naming ``what`` and
        the run's output tail on timeout or exit."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.metrics()
            if until(rows):
                return rows
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"run: {what} did not happen (exit {self.proc.poll()}): {self.tail()}")

    def wait_console(self, *texts: str, timeout: float, more: Callable[[], str] = str) -> str:
        """Poll the run's console until one of ``texts`` is in it; the one found.
        AssertionError with the run's output tail (and ``more()``) on timeout or exit."""
        deadline = time.monotonic() + timeout
        while True:
            console = self.err.read_text()
            for text in texts:
                if text in console:
                    return text
            if time.monotonic() > deadline or self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise AssertionError(f"run: none of {texts} in its console (exit {self.proc.poll()}): {self.tail()}\n{more()}")

    def tail(self) -> str:
        return (self.out.read_text()[-3000:] + "\n--- stderr ---\n" + self.err.read_text()[-3000:]).strip()

    def stop(self, timeout: float = 120.0) -> int:
        """SIGINT (finish the step, checkpoint, reports), then wait; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"run did not stop within {timeout:g} s of SIGINT: {self.tail()}") from None

    def spans(self, name: str) -> list[dict[str, Any]]:
        return [s for s in read_jsonl(self.run_dir / "traces.jsonl") if s.get("name") == name]


def step_times(run: Run) -> dict[int, float]:
    """Wall-clock time (time.time()) at which each trained version's step ended, from the
    trainer's `train_step` spans (the newest span per version: a restored trainer repeats)."""
    out: dict[int, float] = {}
    for s in run.spans("train_step"):
        if s["attributes"].get("applied", True):
            out[int(s["attributes"]["version"])] = s["end_ns"] / 1e9
    return out


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest time without a step within [start, end] (its edges count as steps)."""
    inside = sorted(t for t in times if start <= t <= end)
    edges = [start, *inside, end]
    return max(b - a for a, b in itertools.pairwise(edges))


def median_gap(times: list[float]) -> float | None:
    """The median time between consecutive steps among `times` (sorted); None for fewer than 2."""
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    return round(gaps[len(gaps) // 2], 3) if gaps else None


def measure_partition(
    tmp: Path, rig: Any, *, cut_s: float, warm_steps: int = 5, demo: bool = False, **raw: Any
) -> dict[str, Any]:
    """One run with a remote pool on a rig host whose link is cut for `cut_s` seconds after
    `warm_steps` steps, then restored (the tests' run, or with `demo` the demo's batch and
    trace sampling, `demo_shape`); the run is stopped once a rollout from the host was
    trained again. Returns `partition_prompts_lost` (prompts skipped, plus any the run never
    trained), `partition_train_stall_s` (longest gap between train steps during the cut),
    `normal_step_s` (median step time over the `cut_s` seconds before the cut, every link
    up), `uncut_train_stall_s` (the longest gap between train steps over those seconds: the
    same statistic as the stall, without a cut), `cut_step_s` (median step time during the
    cut: the local pool alone fills each batch), `rejoin_s` (link restored -> end of
    the first step with a rollout from the host), `partition_hedges` and `partition_hedges_won`
    (straggling rollouts duplicated on another host, and duplicates kept, over the whole run),
    the console lines and the last metrics row."""
    host = rig.add_host("p")
    if demo:
        shape, in_flight = demo_shape()
        raw = {**shape, "in_flight": in_flight, **raw}
    cfg = remote_run_config(tmp, "partition", {"hosts": [host.address], "keys": str(rig.keys)}, **raw)
    run = Run(cfg, tmp / "runs" / "partition")
    try:
        run.wait(lambda r: len(r) >= warm_steps and r[-1]["pools"]["remote"]["rollouts"] > 0, 300, "warm-up")
        t_uncut = time.time()  # the control: as long as the cut, every link up
        time.sleep(cut_s)
        t_cut = time.time()
        host.cut()
        time.sleep(cut_s)
        host.restore()
        t_restore = time.time()
        n_restore = len(run.metrics())

        def remote_trained(rows: list[dict[str, Any]]) -> bool:
            return any(r["pools"]["remote"]["rollouts"] > 0 for r in rows[n_restore:])

        rows = run.wait(remote_trained, 120, "a rollout from the host trained after the link came back")
        code = run.stop()
    except BaseException:
        run.stop()
        raise
    assert code == 0, run.tail()
    rows = run.metrics()
    times = step_times(run)
    first_back = next(r for r in rows[n_restore:] if r["pools"]["remote"]["rollouts"] > 0)
    before = sorted(t for t in times.values() if t_uncut <= t < t_cut)
    during = sorted(t for t in times.values() if t_cut <= t <= t_restore)
    return {
        "partition_prompts_lost": rows[-1]["prompts_skipped"],
        "partition_train_stall_s": round(longest_gap(list(times.values()), t_cut, t_restore), 3),
        "uncut_train_stall_s": round(longest_gap(list(times.values()), t_uncut, t_cut), 3),
        "normal_step_s": median_gap(before),
        "cut_step_s": median_gap(during),
        "rejoin_s": round(times[first_back["version"]] - t_restore, 3),
        "cut_s": cut_s,
        "steps_during_cut": len(during),
        "partition_hedges": sum(p.get("hedges", 0) for p in rows[-1]["pools"].values()),
        "partition_hedges_won": sum(p.get("hedges_won", 0) for p in rows[-1]["pools"].values()),
        "console": run.err.read_text(),
        "last": rows[-1],
        "spans": run.spans("sampler.outage"),
    }


def measure_join(tmp: Path, rig: Any, **raw: Any) -> dict[str, Any]:
    """One run with an elastic remote pool and no host; once it trains on its local pool a
    rig host is started and listed in the pool's hosts file. Returns `elastic_join_s` (host
    started -> end of the first step with a rollout from it) and the console."""
    hosts_file = tmp / "join-hosts.txt"
    hosts_file.write_text("")
    remote = {"hosts": [], "keys": str(rig.keys), "elastic": True, "hosts_file": str(hosts_file)}
    run = Run(remote_run_config(tmp, "join", remote, **raw), tmp / "runs" / "join")
    host = rig.add_host("e", start=False)
    try:
        run.wait(lambda r: len(r) >= 3, 300, "3 steps on the local pool")
        t_start = time.time()
        host.start()
        hosts_file.write_text(f"{host.address}\n")
        n = len(run.metrics())
        run.wait(lambda r: any(x["pools"]["remote"]["rollouts"] > 0 for x in r[n:]), 180, "a rollout from the host")
    finally:
        code = run.stop()
    assert code == 0, run.tail()
    rows = run.metrics()
    first = next(r for r in rows[n:] if r["pools"]["remote"]["rollouts"] > 0)
    return {"elastic_join_s": round(step_times(run)[first["version"]] - t_start, 3), "console": run.err.read_text()}


def main() -> None:
    """`python -m tests.integration.netruns [--cut-s S] [--keep DIR] [--demo]` (root, iproute2): one
    partition run and one join run in the network rig; prints one JSON line with
    partition_prompts_lost, partition_train_stall_s, normal_step_s, uncut_train_stall_s,
    cut_step_s, rejoin_s,
    partition_hedges, partition_hedges_won and elastic_join_s."""
    import argparse
    import contextlib
    import tempfile

    from tests.netrig import NetRig, netrig_unavailable

    p = argparse.ArgumentParser(prog="python -m tests.integration.netruns")
    p.add_argument("--cut-s", type=float, default=30.0, help="seconds the link stays cut")
    p.add_argument("--keep", type=Path, help="put the runs in this (new) folder and keep them")
    p.add_argument("--demo", action="store_true", help="the partition run with the demo's batch (demo_shape)")
    args = p.parse_args()
    reason = netrig_unavailable()
    if reason:
        raise SystemExit(f"netruns: {reason}")
    if args.keep is not None:
        args.keep.mkdir(parents=True)
    with (
        contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory() as d,
        NetRig() as rig,
    ):
        part = measure_partition(Path(d), rig, cut_s=args.cut_s, demo=args.demo)
        join = measure_join(Path(d), rig)
    keys = (
        "partition_prompts_lost",
        "partition_train_stall_s",
        "normal_step_s",
        "uncut_train_stall_s",
        "cut_step_s",
        "rejoin_s",
        "cut_s",
        "partition_hedges",
        "partition_hedges_won",
    )
    print(json.dumps({**{k: part[k] for k in keys}, "elastic_join_s": join["elastic_join_s"]}))


if __name__ == "__main__":
    main()
