"""Bad inputs that used to give tracebacks: each is one line `flotilla: <message>` naming
the field, exit code 2, and nothing is started or written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.entry.cli import main
from orchestrator.state.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "examples" / "guess_number.toml"

CASES = {
    "--set into a value": (["seed.x=1"], "--set 'seed.x=1': seed is a value (0), not a section"),
    "negative model size": (
        ["model.overrides.hidden_size=-5"],
        "model.overrides: Value error, hidden_size: must be ≥ 1, got -5",
    ),
    "unknown model field": (["model.overrides.hiden_size=64"], "model.overrides: Value error, hiden_size: not a field"),
    "wrong model type": (['model.overrides.hidden_size="big"'], "hidden_size: expected int, got 'big'"),
    "cuda without CUDA": (['pools.0.device="cuda"'], "pools.0.device: pool 'b200-bf16' needs CUDA"),
    "trainer on cuda": (['trainer.device="cuda"'], "trainer.device: 'cuda' but this machine has no CUDA GPU"),
    "unknown task": (['task.name="nope"'], "task.name: unknown task 'nope'"),
    "bad task params": (["task.params.n=1"], "task.params: task 'guess_number' rejected"),
    "run name escapes runs/": (
        ['name="../../x"'],
        "name: Value error, run name '../../x' must be one plain folder name",
    ),
    "absolute run name": (['name="/tmp/flotilla-escape"'], "must be one plain folder name"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_naming_the_field(case: str, tmp_path: Path, capsys, monkeypatch) -> None:
    overrides, expected = CASES[case]
    monkeypatch.chdir(tmp_path)  # a run that started would write runs/ here
    args = ["run", str(DEMO), "--quiet", "--set", f'run_root="{tmp_path / "runs"}"']
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("flotilla: ") and err.count("\n") == 1, err
    assert expected in err, err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_the_cli_process_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    for override in ("steps.x=1",):  # the in-process cases above go through the same main()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "orchestrator",
                "run",
                str(DEMO),
                "--set",
                override,
                "--set",
                f'run_root="{tmp_path}"',
            ],
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=120,
        )
        assert proc.returncode == 2 and proc.stderr.startswith("flotilla: ") and proc.stderr.count("\n") == 1, (
            proc.stderr
        )
    assert list(tmp_path.iterdir()) == []


def test_plain_names_and_model_overrides_still_load() -> None:
    cfg = load_config(
        DEMO,
        [
            'name="guess-number.v2"',
            "model.overrides.hidden_size=32",
            "model.overrides.rms_norm_eps=1e-5",
            "model.overrides.initializer_range=1",
        ],
    )
    assert cfg.name == "guess-number.v2" and cfg.model.overrides["hidden_size"] == 32
    for bad in ("..", ".", "a/b", "a\\\\b", "", "-rf"):
        with pytest.raises(ConfigError, match="plain folder name"):
            load_config(DEMO, [f'name="{bad}"'])


def test_an_sglang_pool_with_min_keep_is_refused_naming_the_field():
    from orchestrator.state.config import ConfigError, load_config

    raw = {
        "pools": [
            {"name": "s", "gpu": "H100-SXM", "device": "cuda", "backend": "sglang", "urls": ["http://127.0.0.1:30000"]}
        ],
        "recipe": {"min_keep": 2, "top_p": 0.97},
    }
    with pytest.raises(ConfigError, match=r"pools\.0\.backend.*min_keep = 1"):
        load_config(raw=raw)
    raw["recipe"]["min_keep"] = 1
    assert load_config(raw=raw).pools[0].backend == "sglang"
