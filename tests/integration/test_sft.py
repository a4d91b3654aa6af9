"""`flotilla sft` end to end: it trains, `flotilla run` starts from its output, bad data is one line."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from actors.models import build_model, read_tensors
from tests.integration.conftest import ROOT, flotilla_run, read_jsonl, small_run_raw


def _flotilla(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _toml(raw: dict) -> str:
    """A minimal TOML writer for the test config (tables, arrays of tables, scalars)."""
    lines: list[str] = []
    scalars = {k: v for k, v in raw.items() if not isinstance(v, (dict, list))}
    lines += [f"{k} = {json.dumps(v)}" for k, v in scalars.items()]
    for k, v in raw.items():
        if isinstance(v, dict):
            lines.append(f"[{k}]")
            for kk, vv in v.items():
                if isinstance(vv, dict):
                    inner = ", ".join(f"{a} = {json.dumps(b)}" for a, b in vv.items())
                    lines.append(f"{kk} = {{ {inner} }}")
                else:
                    lines.append(f"{kk} = {json.dumps(vv)}")
        elif isinstance(v, list):
            for item in v:
                lines.append(f"[[{k}]]")
                lines += [f"{kk} = {json.dumps(vv)}" for kk, vv in item.items()]
    text = "\n".join(lines) + "\n"
    tomllib.loads(text)
    return text


def _config(tmp_path: Path, data: Path) -> Path:
    raw = small_run_raw(
        tmp_path,
        name="arith",
        task={"name": "arithmetic", "params": {"max_sum": 3}},
        sft={"data": str(data), "epochs": 12, "lr": 5e-3, "batch_size": 32},
    )
    path = tmp_path / "arith.toml"
    path.write_text(_toml(raw))
    return path


@pytest.mark.timeout(600)
def test_sft_trains_and_a_run_starts_from_its_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(1)
    rows = []
    for _ in range(160):
        a = rng.randrange(4)
        b = rng.randrange(4 - a)
        rows.append({"prompt": f"what is {a} + {b} ?", "completion": str(a + b)})
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = _config(tmp_path, data)

    sft = _flotilla("sft", str(config), "--quiet")
    assert sft.returncode == 0, sft.stderr
    out = tmp_path / "runs" / "arith-sft"
    summary = json.loads((out / "sft_summary.json").read_text())
    steps = read_jsonl(out / "metrics.jsonl")
    assert summary["steps"] == len(steps) == 12 * 5  # 160 rows in batches of 32, 12 epochs
    assert summary["final_loss"] < 0.3 * summary["initial_loss"], summary
    model_dir = out / "checkpoint" / "model"
    assert (out / "checkpoint" / "trainer.json").is_file() and (model_dir / "model.safetensors").is_file()

    # A run with [model] path = the SFT model starts from those weights: its trainer's
    # first batch already earns far more than a random init's (about 1/100 of replies
    # right), and its model is the SFT one before any RL step (step-1 loss is taken at
    # the weights before the step).
    run = flotilla_run(config, "--set", f"model.path={model_dir}", "--steps", "2")
    assert run.returncode == 0, run.stderr
    rows = read_jsonl(tmp_path / "runs" / "arith" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward_mean"] > 0.5, [r["reward_mean"] for r in rows]
    resolved = json.loads((tmp_path / "runs" / "arith" / "config.json").read_text())
    assert resolved["model"]["path"] == str(model_dir)
    # the SFT weights are what the sampler pools also built (same config, same tensors)
    sft_weights = read_tensors(model_dir / "model.safetensors")
    built = build_model(str(model_dir)).state_dict()
    assert all(torch.equal(built[n], t) for n, t in sft_weights.items())


def test_bad_jsonl_is_one_line_naming_the_line(tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text(
        '{"prompt": "what is 1 + 1 ?", "completion": "2"}\n{"prompt": "what is 1 + 2 ?", "completion": 3}\n'
    )
    config = _config(tmp_path, data)
    res = _flotilla("sft", str(config), "--quiet")
    assert res.returncode == 2
    assert res.stderr.strip() == f"flotilla: {data}:2: 'completion' must be a string", res.stderr
    assert not (tmp_path / "runs" / "arith-sft").exists()  # refused before anything is written

    missing = _flotilla("sft", str(config), "--set", "sft.epochs=0", "--quiet")
    assert missing.returncode == 2 and "sft.epochs" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    no_table = tmp_path / "plain.toml"
    no_table.write_text(_toml(small_run_raw(tmp_path)))
    res = _flotilla("sft", str(no_table), "--quiet")
    assert res.returncode == 2 and "no [sft] table" in res.stderr
