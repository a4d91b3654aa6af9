"""The CLI entry point and run-config errors (no actors started)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.state.config import ConfigError, apply_overrides, load_config

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "examples" / "guess_number.toml"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], cwd=ROOT, text=True, capture_output=True, timeout=60
    )


def test_help_does_not_import_torch():
    code = "import sys; from orchestrator.entry.cli import _parser; _parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
    assert "usage: flotilla" in _cli("--help").stdout


def test_demo_config_loads_and_overrides_apply():
    cfg = load_config(DEMO, ["rollout.group_size=4", "pools.1.staleness_budget=0", 'mode="sync"'])
    assert cfg.rollout.group_size == 4
    assert cfg.pools[1].staleness_budget == 0
    assert cfg.mode == "sync"
    assert {p.precision for p in cfg.pools} == {"bf16", "fp8"}


def test_the_learning_rate_decays_over_the_run_unless_the_config_says_otherwise(tmp_path):
    cfg = load_config(DEMO, ["steps=120"])
    assert cfg.trainer.lr_decay_steps == 120
    assert load_config(DEMO, ["steps=120", "trainer.lr_decay_steps=40"]).trainer.lr_decay_steps == 40
    # the resolved config a resumed run reads keeps the schedule of the run that wrote it
    resolved = tmp_path / "config.json"
    resolved.write_text(cfg.resolved_json())
    assert load_config(resolved, ["steps=500"]).trainer.lr_decay_steps == 120


def test_config_errors_name_the_file_and_the_field(tmp_path):
    raw = {
        "pools": [{"name": "a", "gpu": "A100-80GB", "precision": "fp8", "device": "cpu"}],
        "rollout": {"group_size": 1},
    }
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    text = str(err.value)
    assert str(bad) in text
    assert "rollout.group_size" in text and "pools.0.precision" in text

    proc = _cli("run", str(bad))
    assert proc.returncode == 2
    assert "pools.0.precision" in proc.stderr


def test_unknown_section_and_bad_override_are_refused():
    with pytest.raises(ConfigError, match="colour"):
        load_config(raw={"colour": "red", "pools": [{"name": "a", "gpu": "cpu"}]})
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["steps"])


def _fields(model, prefix=""):
    """Every leaf field of a config model, as dotted names."""
    from orchestrator.entry.confighelp import _model_of

    for name, field in model.model_fields.items():
        sub = _model_of(field.annotation)
        if sub is None:
            yield prefix + name, field
        else:
            yield from _fields(sub, f"{prefix}{name}.")


def test_config_help_documents_every_field_from_the_models():
    from orchestrator.entry.confighelp import config_help
    from orchestrator.state.config import RunConfig

    text = config_help()
    leaves = list(_fields(RunConfig))
    assert len(leaves) > 40
    for dotted, field in leaves:
        assert field.description, f"{dotted} has no docstring"
        name = dotted.rsplit(".", 1)[-1]
        assert f"  {name}: " in text, dotted
        assert field.description.splitlines()[0].strip() in text, dotted
    assert "[checkpoint]" in text and "[[pools]]" in text
    assert "max_restarts: int = 3" in text


def test_flotilla_config_prints_one_section_and_refuses_an_unknown_one():
    out = _cli("config", "checkpoint")
    assert out.returncode == 0 and out.stdout.startswith("[checkpoint]")
    assert "every_steps: int | None = 50" in out.stdout and "rollout" not in out.stdout
    bad = _cli("config", "colour")
    assert bad.returncode == 2 and "no config section 'colour'" in bad.stderr


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"trace_sample": 1.5}, "telemetry.trace_sample"),
        ({"trace_sample": -0.1}, "telemetry.trace_sample"),
        ({"traces_max_mb": 0}, "telemetry.traces_max_mb"),
        ({"trace_sampel": 0.1}, "telemetry.trace_sampel"),
    ],
)
def test_config_errors_name_the_telemetry_field(section: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(raw={"pools": [{"name": "a", "gpu": "cpu"}], "telemetry": section})
    cfg = load_config(raw={"pools": [{"name": "a", "gpu": "cpu"}], "telemetry": {"trace_sample": 0.25}})
    assert cfg.telemetry.trace_sample == 0.25
