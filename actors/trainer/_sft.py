"""Supervised fine-tuning on the trainer: chat data as token sequences, a cross-entropy step.

A warm start for RL (``flotilla sft``): the same model, chat format and checkpoint as a run,
so ``[model] path`` of a later run can name the SFT checkpoint's ``model/`` directory.

Data: a JSONL file, one record a line, either a chat ``{"messages": [{"role", "content"},
...]}`` or a pair ``{"prompt": "...", "completion": "..."}`` (one user turn, one assistant
turn). ``tokenize_records`` renders each record with the run's ``ChatFormat`` exactly as an
episode would: user turns through ``Conversation.add`` (ending with the assistant
generation prompt), each assistant turn as the reply a sampler would have generated (its
content's ids and the format's first stop id). The loss mask is True on those reply ids
only: the loss is on assistant tokens, never on prompts.

Loss: token-mean negative log-likelihood of the masked tokens over the whole batch,
normalised by the batch's token count, so micro-batching changes memory, not the result.
On the FSDP2 path every rank takes its token share and the same number of passes, as
``Trainer.train_step`` does.

Errors: a record that cannot be used raises ``SftDataError`` with one line naming the file,
the line number and the problem (bad JSON, a missing or mistyped field, a role the format
has no turn for, a sequence past ``max_seq_len``, an assistant turn with no tokens).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, model_validator

from actors.trainer._dist import all_max, gather_json, token_shares
from actors.trainer._packing import pack

if TYPE_CHECKING:
    from actors.chat import ChatFormat
    from actors.trainer._core import Trainer

__all__ = ["SftDataError", "SftResult", "SftSequence", "read_records", "sft_pass", "tokenize_records"]


class SftDataError(ValueError):
    """An SFT record that cannot be used; one line naming the file, the line and the problem."""


class SftSequence(BaseModel):
    """One tokenized SFT example: the ids as the model sees them and where the loss is."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    tokens: torch.Tensor
    """int64 [L]: the rendered conversation."""
    loss_mask: torch.Tensor
    """bool [L]: True on assistant reply tokens (never at position 0)."""
    source: str = ""
    """Where the example came from (``file:line``), named in errors."""

    @model_validator(mode="after")
    def _layout(self) -> SftSequence:
        t, m = self.tokens, self.loss_mask
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
            raise ValueError("SftSequence.tokens must be a 1-D int64 tensor")
        if not isinstance(m, torch.Tensor) or m.dim() != 1 or m.dtype != torch.bool or m.numel() != t.numel():
            raise ValueError("SftSequence.loss_mask must be a 1-D bool tensor as long as tokens")
        if not bool(m.any()):
            raise ValueError(f"SftSequence {self.source}: no loss token")
        return self

    @property
    def prompt_id(self) -> str:  # named by ``pack`` in its errors
        return self.source

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


class SftResult(BaseModel):
    """One SFT pass over a batch: a step (``applied``) or an evaluation."""

    model_config = ConfigDict(extra="forbid")

    version: int
    """Optimizer steps taken so far (SFT steps count like RL steps)."""
    applied: bool
    """An optimizer step was taken (False for an evaluation or a non-finite gradient)."""
    loss: float
    """Mean negative log-likelihood per loss token at the weights before the step (nats)."""
    tokens: int
    """Loss (assistant) tokens in the batch."""
    sequences: int
    """Sequences in the batch."""
    grad_norm: float
    """Global gradient L2 norm before clipping (0 for an evaluation)."""
    seconds: float
    """Wall time of the pass."""


def read_records(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) for every non-blank line of the JSONL file ``path``."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SftDataError(f"{p}: cannot be read: {e}") from None
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise SftDataError(f"{p}:{n}: not valid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(rec, dict):
            raise SftDataError(f"{p}:{n}: expected an object with 'messages' or 'prompt'/'completion'")
        out.append((n, rec))
    if not out:
        raise SftDataError(f"{p}: no records")
    return out


def _messages(rec: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages" in rec:
        extra = sorted(set(rec) - {"messages"})
        if extra:
            raise ValueError(f"unknown field {extra[0]!r} next to 'messages'")
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("'messages' must be a non-empty list")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string 'role'")
            if not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}].content must be a string")
        return msgs
    if "prompt" in rec or "completion" in rec:
        extra = sorted(set(rec) - {"prompt", "completion"})
        if extra:
            raise ValueError(f"unknown field {extra[0]!r} next to 'prompt'/'completion'")
        for key in ("prompt", "completion"):
            if not isinstance(rec.get(key), str):
                raise ValueError(f"'{key}' must be a string")
        return [{"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": rec["completion"]}]
    raise ValueError("expected 'messages' or 'prompt' and 'completion'")


def _tokenize(fmt: ChatFormat, msgs: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
    from actors.chat import Conversation

    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError("no assistant turn to learn")
    conv = Conversation(fmt)
    mask: list[bool] = []
    pending: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if not pending:
            raise ValueError(f"messages[{i}]: an assistant turn must follow a user (or system/tool) turn")
        mask += [False] * len(conv.add(pending))
        pending = []
        reply = list(fmt.encode(m["content"]))
        if not reply:
            raise ValueError(f"messages[{i}]: the assistant turn has no tokens")
        reply += list(fmt.stop_ids[:1])  # the turn ends as a sampler's reply that stopped
        conv.add_reply(reply)
        mask += [True] * len(reply)
    return conv.ids, mask


def tokenize_records(path: str | Path, fmt: ChatFormat, max_seq_len: int) -> list[SftSequence]:
    """Every record of ``path`` rendered with ``fmt`` (see the module docstring); raises
    SftDataError naming the line of the first bad record."""
    out = []
    for n, rec in read_records(path):
        where = f"{path}:{n}"
        try:
            ids, mask = _tokenize(fmt, _messages(rec))
        except (ValueError, TypeError) as e:
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SftDataError(f"{where}: {text}") from None
        if len(ids) > max_seq_len:
            raise SftDataError(f"{where}: {len(ids)} tokens, more than model.max_seq_len = {max_seq_len}")
        out.append(
            SftSequence(
                tokens=torch.tensor(ids, dtype=torch.int64),
                loss_mask=torch.tensor(mask, dtype=torch.bool),
                source=where,
            )
        )
    return out


def sft_pass(trainer: Trainer, batch: Sequence[SftSequence], *, lr: float | None) -> SftResult:
    """Cross-entropy on ``batch``'s loss tokens; with ``lr`` an optimizer step at that rate
    (clipped like an RL step), without it an evaluation (no gradient, nothing changes).

    Raises ValueError for an empty batch or a token id outside the model's vocabulary."""
    t0 = time.perf_counter()
    if not batch:
        raise ValueError("sft: an empty batch")
    vocab = trainer.model.config.vocab_size
    for s in batch:
        if int(s.tokens.max()) >= vocab or int(s.tokens.min()) < 0:
            raise ValueError(f"sft: {s.source}: a token id outside the model's vocabulary (size {vocab})")
    step = lr is not None
    n_global = sum(s.num_loss_tokens for s in batch)
    world = trainer.world
    mine = token_shares([s.num_loss_tokens for s in batch], world.size)[world.rank]
    mbs = pack([batch[i] for i in mine], trainer.config.micro_batch_tokens, trainer.pad_id)
    passes = all_max(len(mbs), trainer.device) if world.size > 1 else len(mbs)
    dev = trainer.device

    def nll(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor) -> Any:
        logits = torch.nn.functional.linear(hidden, weight, bias)
        return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")

    if step:
        trainer.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    with torch.enable_grad() if step else torch.no_grad():
        for k in range(passes):
            if k < len(mbs):
                mb = mbs[k]
                targets = mb.targets.to(dev)
                loss_sum = trainer.policy(
                    mb.input_ids.to(dev),
                    mb.attention_mask.to(dev),
                    mb.rows.to(dev),
                    mb.cols.to(dev),
                    lambda h, w, b, targets=targets: nll(h, w, b, targets),
                )
                total += float(loss_sum.detach())
                loss = loss_sum / n_global
            else:
                loss = trainer._idle_pass()
            if step:
                loss.backward()
    if world.size > 1:
        total = sum(float(x) for x in gather_json(total, world, dev))
    grad_norm, applied = 0.0, False
    if step:
        norm = trainer._clip()
        applied = bool(torch.isfinite(norm))
        grad_norm = float(norm)
        if applied:
            for group in trainer.optimizer.param_groups:
                group["lr"] = lr
            trainer.optimizer.step()
            trainer.version += 1
        trainer.optimizer.zero_grad(set_to_none=True)
    return SftResult(
        version=trainer.version,
        applied=applied,
        loss=total / n_global,
        tokens=n_global,
        sequences=len(batch),
        grad_norm=grad_norm,
        seconds=time.perf_counter() - t0,
    )
