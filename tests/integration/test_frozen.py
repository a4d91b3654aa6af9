"""Frozen and lost actors in a real run, each in its own process: SIGSTOP of one pool's
sampler (the other pool keeps training, steps are written while it is stopped, and it
rejoins after SIGCONT), SIGSTOP of the env actor and of the trainer (the console names
each), and SIGKILL of a
`flotilla host` holding one pool while a local pool trains beside it (training goes on, the
host is named lost once and back once when restarted on its port). Every stopped process is
continued or killed in a finally."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from orchestrator.entry.runner import RunHandles, run_async
from orchestrator.runtime import Curve
from orchestrator.state.config import load_config
from orchestrator.state.progress import Progress
from tests.integration.conftest import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
FAULTS = {"unresponsive_after_s": 3.0, "ping_every_s": 0.5}


async def _until(cond, what: str, limit_s: float = 240.0) -> None:
    with trio.fail_after(limit_s):
        while not cond():
            await trio.sleep(0.05)


def _progress(cfg) -> tuple[Progress, io.StringIO]:
    out = io.StringIO()
    return Progress(cfg.steps, stream=out), out


async def test_a_stopped_sampler_does_not_stall_the_other_pool(small_raw):
    raw = small_raw(name="frozen-sampler", steps=80)
    raw["faults"] = FAULTS
    cfg = load_config(raw=raw)
    progress, out = _progress(cfg)
    seen: dict[str, int] = {}

    async def freeze(run: RunHandles) -> None:
        state = run.controller.state
        await _until(lambda: state.step >= 2, "step 2")
        pid = run.meshes["pool:h100-fp8"].pids[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            seen["at_stop"] = state.step
            await _until(lambda: "sampler h100-fp8/0 is unresponsive" in out.getvalue(), "named")
            await _until(lambda: state.step >= seen["at_stop"] + 4, "steps while stopped")
            seen["at_cont"] = state.step
        finally:
            os.kill(pid, signal.SIGCONT)

    with trio.fail_after(550):
        result = await run_async(cfg, progress=progress, observer=freeze)
    text = out.getvalue()
    assert result.steps_done == 80
    assert seen.get("at_cont", -1) >= seen["at_stop"] + 4, text  # trained while it was stopped
    assert text.count("sampler h100-fp8/0 is unresponsive") == 1, text
    assert "sampler h100-fp8/0 answers again" in text, text
    assert "giving up" not in text
    rows = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 81))
    # Four steps into the freeze, the batch is the other pool's alone (older ones are stale).
    assert rows[seen["at_cont"] - 1]["pools"]["h100-fp8"]["rollouts"] == 0
    c = result.counts
    assert c["groups_in"] == c["groups_trained"] + c["groups_buffered"] + c["groups_skipped"]


async def test_a_stopped_env_actor_and_a_stopped_trainer_are_named(small_raw):
    raw = small_raw(name="frozen-env", steps=8)
    raw["faults"] = FAULTS
    cfg = load_config(raw=raw)
    progress, out = _progress(cfg)
    seen: dict[str, float] = {}

    async def freeze(run: RunHandles) -> None:
        state = run.controller.state
        for at, key, label in ((2, "env", "environment actor 0"), (4, "trainer", "trainer")):
            await _until(lambda at=at: state.step >= at, f"step {at}")
            pid = run.meshes[key].pids[0]
            os.kill(pid, signal.SIGSTOP)
            try:
                t0 = trio.current_time()
                await _until(lambda label=label: f"{label} is unresponsive" in out.getvalue(), "named", 120)
                seen[key] = trio.current_time() - t0
            finally:
                os.kill(pid, signal.SIGCONT)

    with trio.fail_after(550):
        result = await run_async(cfg, progress=progress, observer=freeze)
    text = out.getvalue()
    assert result.steps_done == 8
    for label in ("environment actor 0", "trainer"):
        assert text.count(f"{label} is unresponsive") == 1, text
        assert f"{label} answers again" in text, text
    assert "giving up" not in text
    # Named by the liveness watcher, not found by chance later: within a few detection times.
    assert max(seen.values()) < 10 * FAULTS["unresponsive_after_s"]
    assert result.counts["groups_in"] == (
        result.counts["groups_trained"] + result.counts["groups_buffered"] + result.counts["groups_skipped"]
    )


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


async def _host(keys: Path, bind: str) -> tuple[trio.Process, str]:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "orchestrator.entry.cli", "host", "--bind", bind, "--keys", str(keys)],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=ENV,
    )
    assert proc.stdout is not None
    out = b""
    while out.count(b"\n") < 2:
        chunk = await proc.stdout.receive_some()
        assert chunk, f"host exited early: {out!r}"
        out += chunk
    return proc, out.decode().splitlines()[1].rsplit(" ", 1)[1]


async def test_a_killed_host_does_not_stall_the_local_pool(small_raw, tmp_path: Path):
    host_keys, keys = tmp_path / "host-keys", tmp_path / "controller-keys"
    Curve.from_dir(host_keys)
    Curve.from_dir(keys)
    (host_keys / "allowed").mkdir()
    shutil.copy(keys / "id.key", host_keys / "allowed" / "controller.key")
    host, address = await _host(host_keys, "tcp://127.0.0.1:0")
    ip, _, port = address.removeprefix("tcp://").rpartition(":")
    (keys / "hosts").mkdir()
    shutil.copy(host_keys / "id.key", keys / "hosts" / f"{ip}_{port}.key")
    raw = small_raw(name="host-loss", steps=400)  # stopped once the host's sampler trains again
    raw["faults"] = {**FAULTS, "respawn_backoff_max_s": 4.0}
    raw["pools"][1] = {
        "name": "remote-h100",
        "gpu": "H100-SXM",
        "device": "cpu",
        "staleness_budget": 2,
        "max_concurrent_rollouts": 16,
        "hosts": [address],
        "keys": str(keys),
    }
    cfg = load_config(raw=raw)
    progress, out = _progress(cfg)
    seen: dict[str, int] = {}
    procs = [host]

    async def lose_host(run: RunHandles) -> None:
        state = run.controller.state
        await _until(lambda: state.step >= 2, "step 2")
        procs[0].kill()
        await procs[0].wait()
        seen["at_kill"] = state.step
        await _until(lambda: "sampler remote-h100/0 is unresponsive" in out.getvalue(), "loss seen")
        await _until(lambda: state.step >= seen["at_kill"] + 4, "local steps while the host is down")
        seen["at_restart"] = state.step
        procs[0], _ = await _host(host_keys, address)  # the same port: the pool re-attaches
        await _until(lambda: "sampler remote-h100/0 is back" in out.getvalue(), "rejoin seen")
        seen["at_back"] = state.step
        metrics = cfg.run_dir / "metrics.jsonl"
        await _until(
            lambda: any(r["pools"]["remote-h100"]["rollouts"] for r in read_jsonl(metrics)[seen["at_back"] :]),
            "a rollout of the restarted host trained",
        )
        run.controller.stop()  # as the first Ctrl-C: finish the step, checkpoint

    try:
        with trio.fail_after(550):
            result = await run_async(cfg, progress=progress, observer=lose_host)
    finally:
        for p in procs:
            p.kill()
            await p.wait()
    text = out.getvalue()
    assert seen["at_back"] < result.steps_done < 400
    assert seen["at_restart"] >= seen["at_kill"] + 4
    assert text.count("sampler remote-h100/0 is unresponsive") == 1, text
    assert text.count("sampler remote-h100/0 is back") == 1, text
    rows = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, result.steps_done + 1))
    # the restarted host's sampler trains again
    assert sum(r["pools"]["remote-h100"]["rollouts"] for r in rows[seen["at_back"] :]) > 0
