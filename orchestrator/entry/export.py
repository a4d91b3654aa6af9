"""`flotilla export RUN_DIR OUT_DIR [--step N] [--dtype D]`: a run's policy as a Hugging Face
directory that `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
load.

It reads the run's checkpoint (`RUN_DIR/checkpoint/`: the trainer's fp32 weights and
the controller's step), builds the model with transformers' own class, casts it to
`--dtype` and writes it with `save_pretrained` (config.json with the right
`architectures` and dtype, safetensors).  The tokenizer is the run's: the model
directory's own (with its chat template), or the built-in word tokenizer with a chat
template that renders its layout.

A run keeps its latest checkpoint only; `--step N` must name that checkpoint's step
(otherwise the error says which step is there).  A checkpoint whose files do not match
the digests of its marker is refused, naming the file.  Nothing in RUN_DIR is changed; an
existing OUT_DIR is refused unless it is empty.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["ExportError", "export_run"]

DTYPES = ("float32", "bfloat16", "float16")


class ExportError(ValueError):
    """The run cannot be exported as asked; the message names the file or the option."""


def export_run(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None, dtype: str = "bfloat16") -> Path:
    """Export the checkpoint of `run_dir` to `out_dir` (see the module docstring)."""
    import torch

    from actors.chat import HFChatFormat, load_chat_format
    from actors.models import build_model
    from actors.tokenizer import build_tokenizer
    from orchestrator.controller import STATE_FILE, ControllerState
    from orchestrator.state.checkpoints import MARKER, verify_checkpoint

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    ckpt = run_dir / "checkpoint"
    if not (ckpt / "trainer.json").is_file():
        raise ExportError(f"{run_dir}: no complete checkpoint ({ckpt / 'trainer.json'} missing)")
    if (ckpt / MARKER).is_file() and (problem := verify_checkpoint(ckpt)) is not None:
        raise ExportError(
            f"{problem}; the checkpoint is damaged (`flotilla run --resume` falls back "
            "to an older one if the run has one)"
        )
    have = ControllerState.load(ckpt).step if (ckpt / STATE_FILE).is_file() else None
    if step is not None and step != have:
        raise ExportError(f"{run_dir}: --step {step} is not kept; the checkpoint is at step {have}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ExportError(f"{out_dir}: exists and is not empty")
    run_cfg = json.loads((run_dir / "config.json").read_text())
    model_path = (run_cfg.get("model") or {}).get("path")

    if model_path:
        fmt = load_chat_format(model_path)
        if not isinstance(fmt, HFChatFormat):
            raise ExportError(
                f"the run's model.path {model_path!r} holds no tokenizer (moved, or not relative to {Path.cwd()}?)"
            )
        tokenizer = fmt.tokenizer
    else:
        tokenizer = build_tokenizer()  # carries the word layout's chat template
    model = build_model(ckpt / "model").to(getattr(torch, dtype))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "flotilla_export.json").write_text(
        json.dumps(
            {"run_dir": str(run_dir.resolve()), "step": have, "dtype": dtype, "source_model": model_path}, indent=1
        )
    )
    return out_dir
