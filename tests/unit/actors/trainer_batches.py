"""Fixed, on-policy trajectory batches for trainer tests.

Tokens are sampled from the tiny model at a given seed with the recipe's own
``sample_with_support`` (full forward per token: tiny and exact), so the support
records and log q are what a real sampler holding those weights would record.
Rewards: 1 when the first generated token has an even id, else 0, so groups have
mixed rewards and nonzero GRPO advantages.
"""

from __future__ import annotations

import torch

from actors.models import build_model, default_model_config
from actors.tokenizer import VOCAB_SIZE, default_chat_tokens
from actors.types import Trajectory
from policies import sample_with_support

__all__ = ["on_policy_batch"]


@torch.no_grad()
def on_policy_batch(
    *,
    model_seed: int = 0,
    data_seed: int = 0,
    prompts: int = 3,
    group: int = 4,
    new_tokens: int = 3,
    pools: tuple[str, ...] = ("a", "b"),
    version: int = 0,
    model: torch.nn.Module | None = None,
) -> list[Trajectory]:
    """``prompts`` × ``group`` trajectories sampled from the model (or ``model``)."""
    chat = default_chat_tokens()
    m = model if model is not None else build_model(default_model_config(VOCAB_SIZE), model_seed)
    gen = torch.Generator().manual_seed(data_seed)
    out: list[Trajectory] = []
    for p in range(prompts):
        words = torch.randint(7, VOCAB_SIZE, (2 + p,), generator=gen).tolist()
        prompt = chat.prompt(words)
        for k in range(group):
            ids = list(prompt)
            sup_ids, counts, logq, gen_tok = [], [], [], []
            for _ in range(new_tokens):
                logits = m(input_ids=torch.tensor([ids])).logits[0, -1:, :VOCAB_SIZE]
                tok, rec = sample_with_support(logits, temperature=1.0, top_k=64, top_p=0.97, generator=gen)
                ids.append(int(tok[0]))
                gen_tok.append(int(tok[0]))
                sup_ids.append(rec.ids)
                counts.append(rec.ids.numel())
                logq.append(rec.logq)
            offsets = torch.tensor([0, *counts]).cumsum(0).to(torch.int32)
            out.append(
                Trajectory(
                    task="synthetic",
                    prompt_id=f"p{p}",
                    group_id=f"g{p}",
                    pool=pools[k % len(pools)],
                    tokens=torch.tensor(ids),
                    loss_mask=torch.tensor([False] * len(prompt) + [True] * new_tokens),
                    support_ids=torch.cat(sup_ids),
                    support_offsets=offsets,
                    support_logq=torch.cat(logq),
                    versions=torch.full((new_tokens,), version, dtype=torch.int32),
                    reward=float(gen_tok[0] % 2 == 0),
                    turns=1,
                    seconds=0.0,
                )
            )
    return out
