"""examples/byo end to end, as its README runs it: make a local checkpoint, train it with a
task module outside the package, a JSONL dataset and an eval split, export the policy and
reload it in transformers with the trainer's logits. Real processes throughout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLOTILLA = [sys.executable, "-m", "orchestrator"]


def _run(cmd: list[str], timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_byo_example_trains_evaluates_exports_and_reloads(tmp_path: Path) -> None:
    model = tmp_path / "model"
    _run([sys.executable, "examples/byo/make_checkpoint.py", "--out", str(model)], 120)
    assert len(list(model.glob("*.safetensors"))) > 1 and (model / "tokenizer.json").is_file()
    _run(
        FLOTILLA
        + [
            "run",
            "examples/byo/config.toml",
            "--quiet",
            "--set",
            f'model.path="{model}"',
            "--set",
            f'run_root="{tmp_path}"',
            "--set",
            "eval.every=2",
            "--set",
            "eval.episodes=4",
            "--steps",
            "4",
        ],
        300,
    )
    run = tmp_path / "byo"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "reward_mean" in r]
    evals = [r for r in lines if "eval_reward" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [(r["step"], r["eval_episodes"]) for r in evals] == [(2, 4), (4, 4)]
    assert all(r["eval_version"] >= r["step"] and r["eval_failed"] == 0 for r in evals)
    spans = [json.loads(x) for x in (run / "traces.jsonl").read_text().splitlines()]
    assert sum(s.get("name") == "eval" for s in spans) == 2
    assert "eval reward" in _run(FLOTILLA + ["report", str(run)], 60)

    out = tmp_path / "export"
    _run(FLOTILLA + ["export", str(run), str(out), "--dtype", "float32"], 120)
    check = json.loads(
        _run([sys.executable, "examples/byo/check_export.py", str(run), str(out)], 120).strip().splitlines()[-1]
    )
    assert check["equal"] and check["max_abs_logit_diff"] <= 1e-4
    assert check["architectures"] == ["Qwen2ForCausalLM"]
