"""A pool placed on a `flotilla host` subprocess over loopback tcp + CurveZMQ, from the config;
and the same run with a key the host does not allow, which fails at start-up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import trio

from orchestrator.runtime import Curve
from tests.integration.conftest import read_jsonl, small_run_raw

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


async def _start_host(keys: Path) -> tuple[trio.Process, str]:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "orchestrator.entry.cli", "host", "--bind", "tcp://127.0.0.1:0", "--keys", str(keys)],
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


def _config(tmp_path: Path, address: str, keys: Path, name: str) -> Path:
    raw = small_run_raw(tmp_path, name=name, steps=2)
    raw["pools"] = [
        {
            "name": "remote-h100",
            "gpu": "H100-SXM",
            "device": "cpu",
            "staleness_budget": 2,
            "max_concurrent_rollouts": 16,
            "hosts": [address],
            "keys": str(keys),
        }
    ]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(raw))
    return path


def _controller_keys(path: Path, host_keys: Path, address: str) -> Path:
    Curve.from_dir(path)  # creates the key pair
    ip, _, port = address.removeprefix("tcp://").rpartition(":")
    (path / "hosts").mkdir()
    shutil.copy(host_keys / "id.key", path / "hosts" / f"{ip}_{port}.key")
    return path


async def test_run_with_a_pool_on_a_flotilla_host_and_a_refused_key(tmp_path: Path) -> None:
    host_keys = tmp_path / "host-keys"
    Curve.from_dir(host_keys)
    with trio.fail_after(280):
        host, address = await _start_host(host_keys)
        try:
            good = _controller_keys(tmp_path / "controller-keys", host_keys, address)
            (host_keys / "allowed").mkdir()
            shutil.copy(good / "id.key", host_keys / "allowed" / "controller.key")
            # The host reads allowed/ at start-up: restart it on the same port.
            host.terminate()
            await host.wait()
            port = address.rsplit(":", 1)[1]
            host = await trio.lowlevel.open_process(
                [
                    sys.executable,
                    "-m",
                    "orchestrator.entry.cli",
                    "host",
                    "--bind",
                    f"tcp://127.0.0.1:{port}",
                    "--keys",
                    str(host_keys),
                ],
                stdout=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL,
                env=ENV,
            )
            await trio.sleep(1.0)  # a connect before the host binds is retried by ZeroMQ

            samplers_on_host: set[int] = set()

            async def watch_host() -> None:
                while True:
                    for child in psutil.Process(host.pid).children():
                        try:
                            if "sampler-remote-h100" in " ".join(child.cmdline()):
                                samplers_on_host.add(child.pid)
                        except psutil.NoSuchProcess:
                            pass
                    await trio.sleep(0.2)

            cfg = _config(tmp_path, address, good, "remote")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_host)
                run = await trio.run_process(
                    [sys.executable, "-m", "orchestrator.entry.cli", "run", str(cfg), "--quiet"],
                    env=ENV,
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
                nursery.cancel_scope.cancel()
            assert run.returncode == 0, run.stderr.decode()[-3000:]
            assert samplers_on_host, "no sampler process ran on the host"
            metrics = read_jsonl(tmp_path / "runs" / "remote" / "metrics.jsonl")
            assert [m["step"] for m in metrics] == [1, 2]
            assert all(m["pools"]["remote-h100"]["rollouts"] > 0 for m in metrics)
            assert not any(
                psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in samplers_on_host
            ), "the host kept a sampler after the run"

            # A controller whose key the host does not allow fails before anything starts.
            bad = _controller_keys(tmp_path / "other-keys", host_keys, address)
            t0 = trio.current_time()
            run = await trio.run_process(
                [
                    sys.executable,
                    "-m",
                    "orchestrator.entry.cli",
                    "run",
                    str(_config(tmp_path, address, bad, "refused")),
                    "--quiet",
                ],
                env=ENV,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            err = run.stderr.decode()
            assert run.returncode == 2, err[-3000:]
            assert address in err and "CurveZMQ authentication failed" in err and "remote-h100" in err, err
            assert "Traceback" not in err
            assert trio.current_time() - t0 < 60
            assert not (tmp_path / "runs" / "refused").exists()
        finally:
            host.terminate()
            await host.wait()
