"""Make a tiny local Hugging Face checkpoint for the bring-your-own example.

It trains a byte-level BPE tokenizer (``tokenizers``) on the example's data and a
chat template's words, attaches a ChatML chat template (Qwen2.5's shape, with tool
calls), builds a random-init model of a supported family with transformers and saves
both with ``save_pretrained``: a directory like any checkpoint from the Hub, made
here, nothing downloaded.

    python examples/byo/make_checkpoint.py                  # -> examples/byo/model/
    python examples/byo/make_checkpoint.py --family llama   # Llama 3 (rope scaling)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root, when run from a clone

from actors.tiny import FAMILIES, make_checkpoint, train_tokenizer


def corpus() -> list[str]:
    texts = ["Answer with one word.", "You are a helpful assistant.", "system user assistant"]
    for name in ("train.jsonl", "eval.jsonl"):
        for line in (HERE / "data" / name).read_text().splitlines():
            row = json.loads(line)
            texts.append(f"The opposite of {row['word']} is {row['answer']}.")
    return texts * 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(HERE / "model"), help="output directory")
    p.add_argument("--family", default="qwen2", choices=sorted(FAMILIES))
    p.add_argument("--vocab", type=int, default=384, help="BPE vocabulary size")
    p.add_argument("--seed", type=int, default=0, help="seed of the random init")
    args = p.parse_args()
    tok = train_tokenizer(corpus(), vocab_size=args.vocab)
    out = make_checkpoint(
        args.out, args.family, tokenizer=tok, seed=args.seed, max_position_embeddings=256, shard_size="100KB"
    )
    files = sorted(f.name for f in out.iterdir())
    print(f"wrote {out}: {args.family}, vocab {len(tok)}, files {files}")


if __name__ == "__main__":
    main()
