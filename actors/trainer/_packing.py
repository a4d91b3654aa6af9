"""Packing trajectories into right-padded micro-batches under a token budget.

Each micro-batch is a [B, L] block (L = its longest sequence, right-padded, with
an attention mask) whose B·L stays within ``micro_batch_tokens``; a sequence
longer than the budget gets a micro-batch of its own. Generated tokens are
gathered back in trajectory order, so the support rows (one per generated token)
line up with the hidden states that predicted them: the token at position p is
predicted by the hidden state at p − 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from actors.types import Trajectory

__all__ = ["MicroBatch", "pack"]


@dataclass
class MicroBatch:
    """One forward pass worth of sequences.

    ``rows``/``cols`` index the hidden states that predict the generated tokens
    (``hidden[rows, cols]`` is [T, H]), in the order of ``members`` and, within a
    member, in trajectory order.
    """

    members: list[int]
    """Indices into the step's batch of the trajectories packed here."""
    input_ids: torch.Tensor
    """int64 [B, L], right-padded with ``pad_id``."""
    attention_mask: torch.Tensor
    """int64 [B, L]: 1 on real tokens."""
    rows: torch.Tensor
    """int64 [T]: batch row of each generated token's predicting position."""
    cols: torch.Tensor
    """int64 [T]: column of each generated token's predicting position (its position − 1)."""
    targets: torch.Tensor
    """int64 [T]: the generated tokens."""

    @property
    def num_tokens(self) -> int:
        """Generated (loss) tokens in this micro-batch."""
        return self.targets.numel()


def pack(batch: Sequence[Trajectory], micro_batch_tokens: int, pad_id: int) -> list[MicroBatch]:
    """Split ``batch`` into micro-batches of at most ``micro_batch_tokens`` padded tokens.

    Sequences are taken longest first (less padding); the grouping never changes
    the loss because it is normalised by the global token count. Raises ValueError
    naming the trajectory when a generated token sits at position 0 (nothing
    predicts it).
    """
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens={micro_batch_tokens} must be >= 1")
    for i, t in enumerate(batch):
        if t.loss_mask.numel() and bool(t.loss_mask[0]):
            raise ValueError(
                f"trajectory {i} ({t.prompt_id}): a generated token at position 0 "
                "has no context; the prompt must be at least one token"
            )
    order = sorted(range(len(batch)), key=lambda i: -batch[i].tokens.numel())
    groups: list[list[int]] = []
    for i in order:
        n = batch[i].tokens.numel()
        if groups:
            g = groups[-1]
            width = max(n, batch[g[0]].tokens.numel())  # g[0] is the longest in g
            if width * (len(g) + 1) <= micro_batch_tokens:
                g.append(i)
                continue
        groups.append([i])
    return [_block(batch, g, pad_id) for g in groups]


def _block(batch: Sequence[Trajectory], members: list[int], pad_id: int) -> MicroBatch:
    width = max(batch[i].tokens.numel() for i in members)
    ids = torch.full((len(members), width), pad_id, dtype=torch.int64)
    att = torch.zeros((len(members), width), dtype=torch.int64)
    rows, cols, targets = [], [], []
    for r, i in enumerate(members):
        t = batch[i]
        n = t.tokens.numel()
        ids[r, :n] = t.tokens
        att[r, :n] = 1
        pos = torch.nonzero(t.loss_mask, as_tuple=False).flatten()
        rows.append(torch.full_like(pos, r))
        cols.append(pos - 1)
        targets.append(t.tokens[pos])
    return MicroBatch(
        members=members,
        input_ids=ids,
        attention_mask=att,
        rows=torch.cat(rows),
        cols=torch.cat(cols),
        targets=torch.cat(targets),
    )
