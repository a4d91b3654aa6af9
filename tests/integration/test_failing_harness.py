"""A harness that always fails ends the run: `flotilla run` exits non-zero with one line naming
the error, and leaves its checkpoint and reports, whatever the failure is (a crash, a hang,
malformed requests to the gateway, no reward). Real processes throughout."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.integration.conftest import flotilla_run

ROOT = Path(__file__).resolve().parents[2]

_MALFORMED = (
    "import json, os, urllib.request, sys; "
    "req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions', "
    "data=json.dumps({'messages': []}).encode(), headers={'content-type': 'application/json'}); "
    "urllib.request.urlopen(req)"
)

HARNESSES = {
    # kind: (command, what the stop line must name)
    "crash": (
        "python3 -c 'import sys; print(\"the agent broke\", file=sys.stderr); sys.exit(3)'",
        "exited with code 3; stderr tail: the agent broke",
    ),
    "timeout": ("python3 -c 'import time; time.sleep(60)'", "timed out after 1 s"),
    "malformed": (f'python3 -c "{_MALFORMED}"', "HTTP Error 400"),
    "no_reward": ("python3 -c 'print(1)'", "reported no reward"),
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", sorted(HARNESSES))
def test_an_always_failing_harness_stops_the_run_with_its_error(tmp_path: Path, kind: str) -> None:
    command, named = HARNESSES[kind]
    config = tmp_path / "failing.toml"
    config.write_text(f"""
name = "failing"
run_root = "{tmp_path}"
steps = 50
[task]
kind = "harness"
name = "failing"
command = {json.dumps(command)}
episode_timeout_s = {1 if kind == "timeout" else 30}
[rollout]
prompts_per_step = 2
group_size = 4
max_buffered_groups = 2
[[pools]]
name = "p"
gpu = "cpu"
device = "cpu"
max_concurrent_rollouts = 8
""")
    t0 = time.monotonic()
    done = flotilla_run(config, timeout=180)
    took = time.monotonic() - t0
    assert done.returncode == 1, f"{done.stdout}\n{done.stderr}"
    stop = [line for line in done.stderr.splitlines() if line.startswith("flotilla: stopped: ")]
    assert len(stop) == 1, done.stderr
    assert "24 episodes failed in a row" in stop[0] and named in stop[0], stop[0]
    assert "bytearray" not in done.stderr and "Traceback" not in stop[0]
    run_dir = tmp_path / "failing"
    assert (run_dir / "checkpoint").is_dir() and (run_dir / "cost_report.json").is_file()
    assert (run_dir / "metrics.jsonl").read_text() == ""  # nothing trained
    print(f"{kind}: stopped after {took:.1f} s")
