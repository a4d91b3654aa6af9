"""deploy/slurm/flotilla.sbatch on a real Slurm cluster: one node (munged, slurmctld and
slurmd started by the test), two tasks, the controller and one `flotilla host`; the run's
only sampler pool is placed on the host, so it trains only if the host serves it. The job
must end with a finished run and its outputs."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.integration.conftest import read_jsonl, small_run_raw
from tests.slurmrig import single_node_cluster, slurm_unavailable, submit_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _hostname_resolves() -> bool:
    try:
        socket.gethostbyname(socket.gethostname().split(".")[0])
    except OSError:
        return False
    return True


def test_the_sbatch_recipe_runs_a_short_demo_on_a_one_node_cluster(tmp_path: Path) -> None:
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
    if not _hostname_resolves():
        pytest.skip("this host's name does not resolve (the recipe addresses hosts by node name)")
    with single_node_cluster(tmp_path / "slurm") as cluster:
        raw = small_run_raw(tmp_path, steps=3)
        raw["pools"] = raw["pools"][:1]
        raw["checkpoint"] = {"every_steps": 1}
        config = tmp_path / "run.json"
        config.write_text(json.dumps(raw))
        job = submit_recipe(cluster, tmp_path / "job", config)
        assert (job.state, job.returncode) == ("COMPLETED", 0), f"{job.output[-4000:]}\n{cluster.log_tail()}"
    out = job.output
    assert "listening on tcp://" in out, out[-4000:]  # the host task ran
    assert "done at step 3" in out, out[-4000:]
    assert "Killed" not in out, out[-4000:]  # the host stopped on SIGTERM, not SIGKILL
    cfg = json.loads((job.run_dir / "config.json").read_text())
    remote = cfg["pools"][0]
    assert remote["hosts"] == [f"tcp://{cluster.node}:{remote['hosts'][0].rsplit(':', 1)[1]}"]
    metrics = read_jsonl(job.run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["pools"][remote["name"]]["rollouts"] > 0 for m in metrics)
    assert any((job.run_dir / "checkpoint").iterdir())
    for name in ("report.html", "cost_report.json", "cost_report.md", "traces.jsonl"):
        assert (job.run_dir / name).stat().st_size > 0, name
