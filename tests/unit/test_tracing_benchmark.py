"""benchmarks/tracing.py's replay: the rollout it picks from a run's trace file, and a replay
that runs to its JSON line; and what it reads of a run's metrics (issue 30, `tracing_overhead`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tb(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the benchmarks import each other by name
    import tracing

    yield tracing
    for name in ("tracing", "_runs"):
        sys.modules.pop(name, None)


def _span(trace: str, sid: str, parent: str | None, name: str, service: str, t: int, **extra: Any) -> str:
    return json.dumps(
        {
            "name": name,
            "trace_id": trace,
            "span_id": sid,
            "parent_span_id": parent,
            "start_ns": t,
            "end_ns": t + 1,
            "attributes": {"t": t},
            "service": service,
            "pid": 1,
            **extra,
        }
    )


def _rollout(trace: str, turns: int, t0: int) -> list[str]:
    lines = [_span(trace, "c", None, "rollout", "controller", t0), _span(trace, "e", "c", "rollout", "env[0]", t0 + 1)]
    for i in range(turns):
        lines.append(_span(trace, f"g{i}", "e", "generate", "env[0]", t0 + 2 + 2 * i))
        lines.append(_span(trace, f"s{i}", f"g{i}", "sampler.generate", "sampler-a[1]", t0 + 3 + 2 * i))
    return lines


def test_the_median_sampled_rollout_is_picked_as_a_tree_across_processes(tb: Any, tmp_path: Path) -> None:
    lines = [
        *_rollout("t1", 1, 100),
        *_rollout("t3", 3, 10),  # the median of 1, 2 and 3 turns
        *_rollout("t2", 2, 200),
        _span("t4", "c", None, "rollout", "controller", 0, sampled=False),  # failed outside the sample
        _span("t5", "w", None, "weights.apply", "controller", 0),  # not a rollout
        '{"name": "roll',  # a line cut off when the run stopped
    ]
    lines[2:2] = [_span("t9", "x", None, "rollout", "controller", 5, sampled=False)]
    path = tmp_path / "traces.jsonl"
    path.write_text("\n".join(lines))
    tree = tb._rollout_tree(path)
    assert (tree["name"], tree["service"]) == ("rollout", "controller")
    (env,) = tree["children"]
    assert (env["name"], env["service"]) == ("rollout", "env")
    assert [(c["name"], c["attributes"]["t"]) for c in env["children"]] == [("generate", 202), ("generate", 204)]
    assert [g["children"][0]["service"] for g in env["children"]] == ["sampler-a", "sampler-a"]
    assert tb._count(tree) == 6
    (tmp_path / "none.jsonl").write_text(lines[-2])
    assert tb._rollout_tree(tmp_path / "none.jsonl") is None


def test_a_saved_tree_replays_to_one_json_line(tb: Any, tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    path.write_text("\n".join(_rollout("t3", 3, 10)))
    tree_file = tmp_path / "tree.json"
    tree_file.write_text(json.dumps(tb._rollout_tree(path)))
    out = subprocess.run(
        [sys.executable, "benchmarks/tracing.py", "--replay-tree", str(tree_file), "--replay-count", "200", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    per = result["replay_us_per_rollout"]
    assert per["off"] > 0 and per["on"] > 0
    assert result["tracing_us_per_rollout"] == pytest.approx(per["on"] - per["off"], abs=0.02)


def test_a_runs_rollouts_are_its_batches_and_its_drops_counted_once(tb: Any, tmp_path: Path) -> None:
    # metrics.jsonl: `rollouts` is each step's batch, `dropped_total` the run's total so far.
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": 1, "wall_s": 1.0, "rollouts": 128, "dropped_total": 0},
        {"step": 2, "wall_s": 2.0, "rollouts": 128, "dropped_total": 5},
        {"step": 3, "wall_s": 3.5, "rollouts": 128, "dropped_total": 5},
        {"step": 4, "wall_s": 4.0, "rollouts": 128, "dropped_total": 7},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = tb._read_run(run)
    assert got["rollouts"] == 4 * 128 + 7
    assert got["steps"] == 4 and got["train_s"] == 3.0
