"""Checks before any actor starts: each bad input is one line naming the problem, and a
checkpoint too large for this machine is refused with its size and the memory available."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from actors.tiny import make_checkpoint
from orchestrator.entry.preflight import estimate_memory, preflight
from orchestrator.state.config import ConfigError, load_config

POOL = {"name": "cpu", "gpu": "cpu", "precision": "bf16", "device": "cpu"}


def _cfg(tmp_path: Path, **sections: Any):
    raw: dict[str, Any] = {"name": "pf", "run_root": str(tmp_path / "runs"), "pools": [POOL]}
    raw.update(sections)
    return load_config(raw=raw)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_builtin_run_passes_and_reports_its_size(tmp_path) -> None:
    checked = preflight(_cfg(tmp_path))
    assert 50_000 < checked.params < 200_000 and checked.dataset is None


def test_task_errors_before_any_actor(tmp_path) -> None:
    with pytest.raises(ConfigError) as e:
        preflight(_cfg(tmp_path, task={"name": "nope"}))
    assert "task.name: unknown task 'nope'" in _one_line(e)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(ConfigError) as e:
        preflight(_cfg(tmp_path, task={"modules": [str(broken)]}))
    assert "task.modules: cannot import" in _one_line(e) and "RuntimeError: boom at import" in str(e.value)
    with pytest.raises(ConfigError) as e:
        preflight(_cfg(tmp_path, task={"name": "guess_number", "params": {"n": 1000}}))
    assert "task.params: task 'guess_number' rejected" in _one_line(e) and "ValueError" in str(e.value)
    with pytest.raises(ConfigError) as e:
        preflight(_cfg(tmp_path, task={"name": "arithmetic", "params": {"colour": "red"}}))
    assert "does not take" in _one_line(e) and "colour" in str(e.value)


def test_dataset_rows_are_checked_against_the_task(tmp_path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n" + json.dumps({"prompt": "hi"}) + "\n")  # no answer, on the file's line 2
    with pytest.raises(ConfigError) as e:
        preflight(_cfg(tmp_path, task={"name": "chat_dataset", "dataset": str(rows)}))
    assert "task.params: task 'chat_dataset' rejected" in _one_line(e) and "rows.jsonl:2)" in str(e.value)
    rows.write_text(json.dumps({"prompt": "hi", "answer": "yo"}) + "\n")
    checked = preflight(_cfg(tmp_path, task={"name": "chat_dataset", "dataset": str(rows), "eval_dataset": str(rows)}))
    assert checked.dataset.rows == [{"prompt": "hi", "answer": "yo"}]
    with pytest.raises(ConfigError, match="task.eval_dataset is not"):
        preflight(_cfg(tmp_path, task={"name": "chat_dataset", "dataset": str(rows)}, eval={"every": 2}))
    with pytest.raises(ConfigError, match="task.dataset: dataset .*missing.jsonl: no such file"):
        preflight(_cfg(tmp_path, task={"name": "chat_dataset", "dataset": str(tmp_path / "missing.jsonl")}))
    with pytest.raises(ConfigError, match="eval.pool 'gpu' is not a pool"):
        _cfg(tmp_path, eval={"every": 1, "pool": "gpu"})


def test_model_directory_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such directory"):
        preflight(_cfg(tmp_path, model={"path": str(tmp_path / "none")}))
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported; supported: qwen3"):
        preflight(_cfg(tmp_path, model={"path": str(tmp_path / "gpt")}))
    ckpt = make_checkpoint(tmp_path / "m", "llama")
    checked = preflight(_cfg(tmp_path, model={"path": str(ckpt), "max_seq_len": 128}))
    assert checked.params > 0
    with pytest.raises(ConfigError, match="max_seq_len=4096 exceeds the model's max_position_embeddings=512"):
        preflight(_cfg(tmp_path, model={"path": str(ckpt), "max_seq_len": 4096}))


def test_a_checkpoint_too_large_for_this_machine_fails_with_both_sizes(tmp_path) -> None:
    import psutil

    ckpt = make_checkpoint(tmp_path / "big", "qwen3")
    # Replace the weights by one (sparse) safetensors file whose header declares far more
    # parameters than this machine could hold: only the header is ever read.
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    rows = psutil.virtual_memory().total // (4 * 4096) + 1
    header = json.dumps(
        {"model.embed_tokens.weight": {"dtype": "F32", "shape": [rows, 4096], "data_offsets": [0, rows * 4096 * 4]}}
    ).encode()
    path = ckpt / "model.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(8 + len(header) + rows * 4096 * 4)  # sparse: no disk used
    cfg = _cfg(tmp_path, model={"path": str(ckpt)})
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    msg = _one_line(e)
    assert "B parameters need about" in msg and "GiB available" in msg
    assert estimate_memory(rows * 4096, cfg) > psutil.virtual_memory().total
