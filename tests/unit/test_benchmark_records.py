"""Benchmark records resume only runs of the same config (benchmarks/_runs.run_variants),
and the mismatch sweep's runs do not follow the demo config's tuning (benchmarks/_sweep)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from actors.trainer import TrainerConfig
from orchestrator.state.config import RunConfig

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH))  # the benchmarks import each other by name
    import _runs
    import _sweep

    yield _runs, _sweep
    for name in ("_runs", "_sweep"):
        sys.modules.pop(name, None)


def test_a_record_resumes_runs_of_the_same_config_and_reruns_a_changed_one(bench: Any, monkeypatch, tmp_path) -> None:
    _runs, _ = bench
    configs = {("a", 0): {"lr": 1}, ("b", 0): {"lr": 2}, ("c", 0): {"lr": 3}}
    record = tmp_path / "record.jsonl"
    lines = [
        {"variant": "a", "seed": 0, "steps": 5, "config": _runs.config_hash({"lr": 1}), "figures": {"x": 10.0}},
        {"variant": "b", "seed": 0, "steps": 5, "config": _runs.config_hash({"lr": 99}), "figures": {"x": 20.0}},
        {"variant": "c", "seed": 0, "steps": 5, "figures": {"x": 30.0}},  # recorded before hashes
    ]
    record.write_text("".join(json.dumps(r) + "\n" for r in lines))
    ran: list[dict[str, Any]] = []

    def fake_run(raw: dict[str, Any], keep_spans: bool) -> Any:
        ran.append(raw)
        return _runs.RunOutput(metrics=[{"x": 7.0}], spans=[], counts={}, total_s=0.0)

    monkeypatch.setattr(_runs, "run_raw", fake_run)
    build = lambda name, seed: dict(configs[(name, seed)])  # noqa: E731
    figures = lambda metrics: {"x": metrics[-1]["x"]}  # noqa: E731

    report = _runs.run_variants(["a", "b", "c"], 1, 5, build, figures, record=record, run=False)
    assert report == {"a": [{"x": 10.0}], "c": [{"x": 30.0}]} and ran == []  # b's config changed

    out = _runs.run_variants(["a", "b", "c"], 1, 5, build, figures, record=record)
    assert ran == [{"lr": 2}]
    assert out == {"a": [{"x": 10.0}], "b": [{"x": 7.0}], "c": [{"x": 30.0}]}
    last = json.loads(record.read_text().splitlines()[-1])
    assert last["variant"] == "b" and last["config"] == _runs.config_hash({"lr": 2})

    ran.clear()  # the rerun is now the record's run of b: nothing left to run
    assert _runs.run_variants(["a", "b", "c"], 1, 5, build, figures, record=record) == out and ran == []


def test_the_sweep_pins_its_base_over_the_demo_config(bench: Any, monkeypatch) -> None:
    _runs, _sweep = bench
    demo = _runs.demo_raw()
    demo["trainer"]["lr"] = 5e-5  # the demo retuned: the sweep's runs must not follow
    demo["recipe"] = {"top_p": 0.5, "top_k": 64}
    monkeypatch.setattr(_sweep, "demo_raw", lambda: json.loads(json.dumps(demo)))
    for name in ("onpolicy", "bf16:0/full", "int4:16/tis"):
        cfg = RunConfig.model_validate(_sweep.build_sweep_raw(name, 1, 300))
        assert cfg.trainer.lr == _sweep.SWEEP_BASE["trainer"]["lr"]
        assert cfg.recipe.top_p == _sweep.SWEEP_BASE["recipe"]["top_p"]
        assert cfg.recipe.top_k == 64 and cfg.steps == 300 and cfg.seed == 1
        assert cfg.trainer.lr_final_ratio == 1.0  # its records ran at a constant rate
    tis = RunConfig.model_validate(_sweep.build_sweep_raw("int4:16/tis", 1, 300))
    assert tis.recipe.importance == "tis" and not tis.recipe.mask_replay
    assert [p.emulate_quant for p in tis.pools] == ["int4_group"]


def test_a_decaying_rate_never_matches_a_constant_rate_record(bench: Any) -> None:
    _runs, _ = bench
    assert TrainerConfig().lr_final_ratio == _runs.DEFAULT_FINAL_RATIO
    before = {"steps": 300, "trainer": {"lr": 2e-3}}  # a config recorded at a constant rate
    recorded = hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:12]
    pinned = {"steps": 300, "trainer": {"lr": 2e-3, "lr_final_ratio": 1.0}}
    assert _runs.config_hash(pinned) == recorded  # the same computation: resumed and reported
    assert _runs.config_hash(before) != recorded  # now decays over its 300 steps: run again
