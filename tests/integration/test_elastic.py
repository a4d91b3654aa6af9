"""Elastic pools in the network rig (tests/netrig.py): a host listed in the pool's hosts
file while the run goes on joins (a keyframe, then its rollouts are trained), a host that
does not allow the controller's key is named and kept out, and a host that leaves (SIGTERM:
drained; SIGKILL: a partition that never heals) frees its place, which a host started
again takes back."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.integration.netruns import Run, remote_run_config, step_times

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _elastic_run(tmp: Path, rig, name: str, **faults: float) -> tuple[Run, Path]:
    hosts_file = tmp / "hosts.txt"
    hosts_file.write_text("# hosts that may join\n")
    remote = {"hosts": [], "keys": str(rig.keys), "elastic": True, "max_hosts": 1, "hosts_file": str(hosts_file)}
    cfg = (
        remote_run_config(tmp, name, remote, faults=faults or None) if faults else remote_run_config(tmp, name, remote)
    )
    return Run(cfg, tmp / "runs" / name), hosts_file


def _trained_remote_after(run: Run, n: int) -> bool:
    return any(r["pools"]["remote"]["rollouts"] > 0 for r in run.metrics()[n:])


def test_a_host_joins_a_running_run_and_a_refused_one_stays_out(tmp_path: Path, netrig) -> None:
    stranger = netrig.add_host("x", start=False)
    (stranger.keys / "allowed" / "controller.key").unlink()  # it does not allow our key
    stranger.start()
    joiner = netrig.add_host("j", start=False)
    run, hosts_file = _elastic_run(tmp_path, netrig, "join")
    try:
        run.wait(lambda r: len(r) >= 3, 300, "3 steps on the local pool")
        assert all(r["pools"]["remote"]["rollouts"] == 0 and r["pools"]["remote"]["hosts"] == 0 for r in run.metrics())
        hosts_file.write_text(f"{stranger.address}\n")
        run.wait_console("cannot join yet", timeout=60)
        t_start = time.time()
        joiner.start()
        hosts_file.write_text(f"{stranger.address}\n{joiner.address}  # the new one\n")
        n = len(run.metrics())
        run.wait(lambda r: _trained_remote_after(run, n), 120, "a rollout from the joined host trained")
    finally:
        code = run.stop()
    assert code == 0, run.tail()
    console = run.err.read_text()
    assert console.count(f"host {joiner.address} joins as sampler remote/0") == 1, console[-3000:]
    assert console.count(f"host {stranger.address} cannot join yet") == 1, console[-3000:]
    assert "CurveZMQ authentication failed" in console
    rows = run.metrics()
    assert rows[-1]["pools"]["remote"]["hosts"] == 1 and rows[-1]["prompts_skipped"] == 0
    times = step_times(run)
    first = next(r for r in rows[n:] if r["pools"]["remote"]["rollouts"] > 0)
    join_s = times[first["version"]] - t_start
    print(f"elastic_join_s={join_s:.2f}")
    assert join_s > 0
    (joined,) = run.spans("sampler.join")
    assert joined["attributes"]["host"] == joiner.address


@pytest.mark.parametrize("how", ["term", "kill"])
def test_a_host_that_leaves_frees_its_place_for_the_next(tmp_path: Path, netrig, how: str) -> None:
    host = netrig.add_host("l")
    # A drained host is let go as soon as it has stopped (not after a give-up time).
    run, hosts_file = _elastic_run(tmp_path, netrig, how, host_give_up_after_s=8.0 if how == "kill" else 120.0)
    hosts_file.write_text(f"{host.address}\n")
    try:
        run.wait(lambda r: len(r) >= 3 and r[-1]["pools"]["remote"]["rollouts"] > 0, 300, "the host's rollouts")
        if how == "term":
            assert host.terminate(timeout=30) == 0, host.log.read_text()[-2000:]
        else:
            host.kill(signal.SIGKILL)
        run.wait_console("left the run", "giving it up", timeout=90, more=lambda: host.log.read_text()[-3000:])
        n = len(run.metrics())
        run.wait(lambda r: len(r) >= n + 3, 120, "3 steps without the host")
        assert run.metrics()[-1]["pools"]["remote"]["hosts"] == 0
        host.start()  # the same host again: it takes its place back
        n = len(run.metrics())
        run.wait(lambda r: _trained_remote_after(run, n), 120, "a rollout from the host, back")
    finally:
        code = run.stop()
    assert code == 0, run.tail()
    console = run.err.read_text()
    if how == "term":
        assert console.count("left the run") == 1, console[-3000:]  # drained: no waiting for it
    else:
        assert console.count("giving it up") == 1, console[-3000:]
    assert console.count("joins as sampler remote/0") == 2, console[-3000:]
    rows = run.metrics()
    assert rows[-1]["prompts_skipped"] == 0 and rows[-1]["pools"]["remote"]["hosts"] == 1
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
