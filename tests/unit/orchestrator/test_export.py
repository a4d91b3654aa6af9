"""`flotilla export`: a run's checkpoint becomes a directory transformers loads, with the
trainer's logits, the right architecture and dtype, and the run's tokenizer + template."""

from __future__ import annotations

import json

import pytest
import torch

from actors.tiny import make_checkpoint
from actors.tokenizer import default_chat_tokens
from actors.trainer import TrainerConfig
from actors.trainer._core import Trainer
from orchestrator.controller import ControllerState
from orchestrator.entry.cli import main
from orchestrator.entry.export import ExportError, export_run

torch.set_num_threads(1)


def _fake_run(tmp_path, model_path: str | None, step: int = 7) -> tuple[object, Trainer]:
    """A run directory as a run leaves it: config.json and checkpoint/ (trainer + state)."""
    run = tmp_path / "run"
    run.mkdir()
    trainer = Trainer(TrainerConfig(model=model_path))
    with torch.no_grad():  # stands in for training: the weights moved away from the source
        for p in trainer.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    trainer.save_checkpoint(str(run / "checkpoint"))
    ControllerState(step=step, version=step).save(run / "checkpoint")
    (run / "config.json").write_text(json.dumps({"model": {"path": model_path}}))
    return run, trainer


def test_export_reloads_with_the_trainers_logits(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = make_checkpoint(tmp_path / "src", "qwen2", texts=["hello world what is two plus two"] * 3)
    run, trainer = _fake_run(tmp_path, str(src))
    ids = torch.tensor([[5, 9, 30, 2, 17, 60]])
    with torch.no_grad():
        want = trainer.model(ids).logits

    out = export_run(run, tmp_path / "fp32", step=7, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, atol=1e-5, rtol=0)

    assert main(["export", str(run), str(tmp_path / "bf16")]) == 0  # default dtype bf16
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", local_files_only=True).eval()
    assert next(bf16.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        got = bf16(ids).logits.float()
    assert (got - want).abs().max() < 0.05  # bf16 rounding of weights and activations only

    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    source = AutoTokenizer.from_pretrained(src, local_files_only=True)
    assert tok.chat_template == source.chat_template
    msgs = [{"role": "user", "content": "two plus two"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == source.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


def test_export_of_a_builtin_model_run_carries_the_word_layout(tmp_path) -> None:
    from transformers import AutoTokenizer

    run, _ = _fake_run(tmp_path, None)
    out = export_run(run, tmp_path / "out", dtype="float32")
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    chat = default_chat_tokens()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "what is 2 + 3 ?"}], tokenize=True, add_special_tokens=False
    )
    assert list(enc["input_ids"]) == chat.prompt("what is 2 + 3 ?")


def test_export_errors_name_the_problem(tmp_path) -> None:
    run, _ = _fake_run(tmp_path, None, step=3)
    with pytest.raises(ExportError, match="--step 5 is not kept; the checkpoint is at step 3"):
        export_run(run, tmp_path / "o", step=5)
    with pytest.raises(ExportError, match="--dtype 'int8'"):
        export_run(run, tmp_path / "o", dtype="int8")
    with pytest.raises(ExportError, match="no complete checkpoint"):
        export_run(tmp_path, tmp_path / "o")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export_run(run, tmp_path / "full")
    assert (tmp_path / "full" / "x").read_text() == "keep me"


def test_export_refuses_a_checkpoint_that_fails_its_digests(tmp_path) -> None:
    from orchestrator.state.checkpoints import commit_checkpoint_dir

    run, _ = _fake_run(tmp_path, None, step=3)
    staged = run / "checkpoint.new"
    (run / "checkpoint").rename(staged)
    commit_checkpoint_dir(run / "checkpoint", staged, {"step": 3})  # as a run writes it: with its marker
    model = run / "checkpoint" / "model" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    with pytest.raises(ExportError, match=r"model\.safetensors: xxh3-128 digest .* the checkpoint is damaged"):
        export_run(run, tmp_path / "o")
    assert not (tmp_path / "o").exists()
