"""Shared helpers for the weightsync tests: tiny models' state dicts and sparse steps."""

from __future__ import annotations

import torch

from orchestrator.weightsync import WeightMessage


def master_state(seed: int = 0, *, scale: float = 0.02) -> dict[str, torch.Tensor]:
    """A fp32 state dict shaped like a (tiny) Qwen3: 2-D weights whose sides are
    and are not multiples of 128, 1-D norms, a bias, embeddings, a head."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, s: float = scale) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * s

    return {
        "model.embed_tokens.weight": rnd(96, 64),
        "model.layers.0.self_attn.q_proj.weight": rnd(256, 64),
        "model.layers.0.self_attn.o_proj.weight": rnd(200, 130),
        "model.layers.0.mlp.down_proj.weight": rnd(64, 300),
        "model.layers.0.input_layernorm.weight": torch.ones(64) + rnd(64, s=1e-3),
        "model.layers.0.mlp.bias": rnd(300),
        "model.norm.weight": torch.ones(64),
        "lm_head.weight": rnd(96, 64),
    }


def sparse_step(state: dict[str, torch.Tensor], gen: torch.Generator, *, frac: float = 0.03, lr: float = 1e-3) -> None:
    """In place: move a random `frac` of every tensor's elements by ~lr, the way
    an optimizer step nudges weights (some steps also touch the norms)."""
    for t in state.values():
        flat = t.view(-1)
        mask = torch.rand(flat.shape, generator=gen) < frac
        flat += mask * torch.randn(flat.shape, generator=gen) * lr


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))
        for n in a
    )


def clone(snapshot: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in snapshot.items()}


def with_frame(message: WeightMessage, index: int, frame: bytes) -> WeightMessage:
    """The same message with chunk frame `index` replaced and its length in the
    metadata adjusted, so only the codec (not the framing check) can notice."""
    frames = list(message.frames)
    frames[index] = frame
    tensors, i = [], 0
    for t in message.meta.tensors:
        chunks = list(t.chunks)
        for j in range(len(chunks)):
            if i == index:
                chunks[j] = len(frame)
            i += 1
        tensors.append(t.model_copy(update={"chunks": tuple(chunks)}))
    return WeightMessage(message.meta.model_copy(update={"tensors": tuple(tensors)}), frames)


def flip(buf: bytes, pos: int, bit: int = 0x10) -> bytes:
    b = bytearray(buf)
    b[pos] ^= bit
    return bytes(b)
