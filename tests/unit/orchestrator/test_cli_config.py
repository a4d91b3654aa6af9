"""The CLI entry point and run-config errors (no actors started)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.buffer import RolloutBuffer
from orchestrator.config import ConfigError, apply_overrides, load_config

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "examples" / "guess_number.toml"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=60)


def test_help_does_not_import_torch():
    code = "import sys; from orchestrator.cli import _parser; _parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
    assert "usage: flotilla" in _cli("--help").stdout


def test_demo_config_loads_and_overrides_apply():
    cfg = load_config(DEMO, ["rollout.group_size=4", "pools.1.staleness_budget=0", 'mode="sync"'])
    assert cfg.rollout.group_size == 4
    assert cfg.pools[1].staleness_budget == 0
    assert cfg.mode == "sync"
    assert {p.precision for p in cfg.pools} == {"bf16", "fp8"}


def test_config_errors_name_the_file_and_the_field(tmp_path):
    raw = {"pools": [{"name": "a", "gpu": "A100-80GB", "precision": "fp8", "device": "cpu"}],
           "rollout": {"group_size": 1}}
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


class _T:
    def __init__(self, pool: str, version: int, failed: bool = False) -> None:
        self.pool, self.version, self.failed, self.error = pool, version, failed, "boom"


def test_buffer_drops_stale_trajectories_and_retries_their_slots():
    buf = RolloutBuffer(group_size=2, min_version_of=lambda t: t.version, max_attempts=2)
    buf.add_group("g0", "p0", task="t")
    slots = [buf.next_slot(), buf.next_slot()]
    assert buf.next_slot() is None
    buf.complete(slots[0], _T("fast", version=3))
    buf.complete(slots[1], _T("slow", version=0))
    groups, drops = buf.take_batch(1, trainer_version=3, budget_of=lambda pool: 1)
    assert groups == [] and [(d.pool, d.staleness) for d in drops] == [("slow", 3)]
    retry = buf.next_slot()
    assert (retry.group_id, retry.index) == ("g0", 1)
    buf.complete(retry, _T("slow", version=3))
    groups, drops = buf.take_batch(1, trainer_version=3, budget_of=lambda pool: 1)
    assert [g.group_id for g in groups] == ["g0"] and drops == []
    c = buf.counts()
    assert c["groups_in"] == c["groups_trained"] == 1 and c["dropped_stale"] == 1


def test_buffer_abandons_a_group_after_repeated_failures():
    buf = RolloutBuffer(group_size=1, min_version_of=lambda t: t.version, max_attempts=2)
    buf.add_group("g0", "p0", task="t")
    buf.complete(buf.next_slot(), _T("a", 0, failed=True))
    buf.complete(buf.next_slot(), _T("a", 0, failed=True))
    c = buf.counts()
    assert c["groups_abandoned"] == 1 and c["groups_buffered"] == 0 and c["dropped_failed"] == 2
    assert buf.next_slot() is None
