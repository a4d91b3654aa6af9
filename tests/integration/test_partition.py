"""Partitions of a remote pool's link, in the network rig (tests/netrig.py): the run keeps
training on its local pool while the link is cut, loses no prompt, and the host's sampler
rejoins once the link is back; a host that never comes back (its link cut for good, or the
host SIGKILLed) is given up after `[faults] host_give_up_after_s`, with one line, and the
run goes on."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.integration.netruns import Run, measure_partition, remote_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_a_cut_link_heals_and_its_sampler_rejoins(tmp_path: Path, netrig) -> None:
    m = measure_partition(tmp_path, netrig, cut_s=15.0)
    console = m["console"]
    assert m["partition_prompts_lost"] == 0, m["last"]
    assert m["steps_during_cut"] >= 3, m  # training went on without the remote pool
    assert m["rejoin_s"] > 0
    lost = [line for line in console.splitlines() if "sampler remote/0 is unresponsive" in line]
    back = [line for line in console.splitlines() if "sampler remote/0 answers again" in line]
    assert len(lost) == 1 and len(back) == 1, console[-3000:]
    assert "respawn" not in console  # a partition is not a death: the process ran on
    remote = m["last"]["pools"]["remote"]
    assert remote["outages"] == 1 and remote["outage_s"] >= m["cut_s"] - 5 and remote["up"] == 1, remote
    (outage,) = m["spans"]
    assert outage["attributes"]["outcome"] == "rejoined" and outage["attributes"]["host"].startswith("tcp://")


@pytest.mark.parametrize("how", ["cut", "kill"])
def test_a_host_that_never_comes_back_is_given_up(tmp_path: Path, netrig, how: str) -> None:
    host = netrig.add_host("g")
    faults = {"host_give_up_after_s": 8.0}
    cfg = remote_run_config(tmp_path, how, {"hosts": [host.address], "keys": str(netrig.keys)}, faults=faults)
    run = Run(cfg, tmp_path / "runs" / how)
    try:
        run.wait(lambda r: len(r) >= 3 and r[-1]["pools"]["remote"]["rollouts"] > 0, 300, "warm-up")
        if how == "cut":
            host.cut()
        else:
            host.kill(signal.SIGKILL)
        run.wait_console("giving it up", timeout=90)
        n = len(run.metrics())
        run.wait(lambda r: len(r) >= n + 5, 120, "5 steps after the host was given up")
    finally:
        code = run.stop()
    assert code == 0, run.tail()
    console = run.err.read_text()
    assert console.count("giving it up") == 1, console[-3000:]
    assert console.count("respawn") <= 6, console[-3000:]  # said once, then at doubling counts
    rows = run.metrics()
    assert rows[-1]["prompts_skipped"] == 0
    assert rows[-1]["pools"]["remote"]["up"] == 0 and rows[-1]["pools"]["remote"]["outages"] == 1
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    (outage,) = run.spans("sampler.outage")
    assert outage["attributes"]["outcome"] == "given_up" and outage["attributes"]["seconds"] >= 8.0
