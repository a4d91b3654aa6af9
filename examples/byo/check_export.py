"""Reload an exported run with transformers alone and compare its logits with the trainer's.

    python examples/byo/check_export.py runs/byo examples/byo/export

The trainer's side is the run's checkpoint (``RUN_DIR/checkpoint/model``, fp32 master
weights, built the way the trainer builds it); the export is loaded with
``AutoModelForCausalLM`` / ``AutoTokenizer`` only.  The prompt is rendered with the
exported chat template.  Prints one JSON line; exits 1 when the logits differ by more
than the export dtype's rounding allows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.models import build_model

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("export_dir")
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.export_dir, local_files_only=True)
    exported = AutoModelForCausalLM.from_pretrained(args.export_dir, local_files_only=True).eval()
    trainer = build_model(Path(args.run_dir) / "checkpoint" / "model")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "The opposite of hot is"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        want = trainer(ids).logits
        got = exported(ids).logits.float()
    dtype = next(exported.parameters()).dtype
    diff = float((got - want).abs().max())
    ok = diff <= TOLERANCE[dtype]
    print(
        json.dumps(
            {
                "architectures": exported.config.architectures,
                "dtype": str(dtype),
                "tokens": ids.shape[1],
                "max_abs_logit_diff": diff,
                "tolerance": TOLERANCE[dtype],
                "equal": ok,
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
