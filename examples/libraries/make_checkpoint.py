"""Make the tiny local checkpoint the environment-library examples train.

A byte-level BPE tokenizer trained here (any text encodes: reasoning-gym questions,
verifiers prompts, OpenEnv observations) with a ChatML template, and a random-init Qwen2
model, saved with ``save_pretrained``: nothing is downloaded.

    python examples/libraries/make_checkpoint.py            # -> examples/libraries/model/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root, when run from a clone

from actors.tiny import make_checkpoint, train_tokenizer

CORPUS = [
    "Calculate 12 + 34. What is 5 - 3? Answer with one number. <answer>46</answer>",
    "Your task is to count how many legs there are in total when given a list of animals.",
    "how many legs are there in total if you have 3 spiders, 2 cows, 1 duck?",
    "guess the number from 0 to 7 in 3 turns higher lower correct invalid try again",
    "You are a helpful assistant. system user assistant 0 1 2 3 4 5 6 7 8 9",
] * 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(HERE / "model"), help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the random init")
    args = p.parse_args()
    out = make_checkpoint(
        args.out,
        "qwen2",
        tokenizer=train_tokenizer(CORPUS, vocab_size=400),
        seed=args.seed,
        max_position_embeddings=1024,
    )
    print(out)


if __name__ == "__main__":
    main()
