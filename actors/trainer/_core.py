"""The training step: GRPO advantages, packed micro-batches, the recipe loss, AdamW.

``Trainer`` is a plain object (no actor, no I/O besides checkpoints) so it can be
driven in-process; ``TrainerActor`` wraps it and adds weight publishing.

One step on a batch of trajectories:

1. drop failed trajectories and those without generated tokens; GRPO advantages
   over the rest by ``group_id`` (``policies.grpo_advantages``);
2. pack into right-padded micro-batches under ``micro_batch_tokens``;
3. per micro-batch: forward to the final hidden states, gather the states that
   predict generated tokens, replay log p^S over the recorded supports without a
   [T, V] logits tensor (``replay_logprobs_from_hidden``), and the recipe loss with
   the GLOBAL token count, so the accumulated gradient equals the whole batch's;
4. clip, AdamW step, version += 1.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from actors.models import build_model, default_model_config
from actors.tokenizer import VOCAB_SIZE
from actors.trainer import _checkpoint
from actors.trainer._config import StepResult, TrainerConfig
from actors.trainer._packing import MicroBatch, pack
from actors.types import Trajectory
from policies import (
    LossMetrics,
    PoolMetrics,
    RecipeConfig,
    SupportRecord,
    full_vocab_logprobs,
    grpo_advantages,
    recipe_loss,
    replay_logprobs_from_hidden,
)

__all__ = ["Trainer"]


class Trainer:
    """fp32 master weights + AdamW + the recipe loss (see the module docstring).

    ``resume_from`` is a directory written by :meth:`save_checkpoint`; the model,
    optimizer state, version and RNG state come from it, hyperparameters from
    ``config`` (keep them equal for a bit-exact continuation).
    """

    def __init__(self, config: TrainerConfig, resume_from: str | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if resume_from is not None:
            model_src = _checkpoint.model_dir(resume_from)
        else:
            model_src = config.model if config.model is not None else default_model_config(VOCAB_SIZE)
        self.model_source = model_src
        self.model_config: dict[str, Any] = (
            dict(model_src) if isinstance(model_src, dict)
            else json.loads((Path(model_src) / "config.json").read_text()))
        """The resolved model config dict (what samplers must build)."""
        self.model = build_model(model_src, seed=config.seed).to(self.device)
        self.params = dict(self.model.named_parameters())
        self.optimizer = torch.optim.AdamW(
            list(self.params.values()), lr=config.lr, betas=config.betas, eps=config.eps,
            weight_decay=config.weight_decay, foreach=False)
        self.version = 0
        self.pad_id = 0
        if resume_from is not None:
            self.version = _checkpoint.load_state(self, resume_from)
        else:
            torch.manual_seed(config.seed)

    # ------------------------------------------------------------------ step
    def learning_rate(self) -> float:
        """The rate of the next optimizer step (the config's linear decay at this version)."""
        c = self.config
        if c.lr_decay_steps is None:
            return c.lr
        done = min(self.version, c.lr_decay_steps) / c.lr_decay_steps
        return c.lr * (1.0 - done * (1.0 - c.lr_final_ratio))

    def train_step(self, batch: Sequence[Trajectory]) -> StepResult:
        """One optimizer step on ``batch``; returns the loss at the pre-step weights.

        Raises ValueError when no trajectory has generated tokens, or naming the
        trajectory whose support record is malformed (a sampled token outside its
        support, a bad offset). A non-finite gradient skips the update
        (``applied=False``, version unchanged) instead of corrupting the weights.
        """
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        res = self._loss_and_grad(batch, backward=True)
        grad_norm = self._clip()
        applied = bool(torch.isfinite(grad_norm))
        if applied:
            for group in self.optimizer.param_groups:
                group["lr"] = self.learning_rate()
            self.optimizer.step()
            self.version += 1
        self.optimizer.zero_grad(set_to_none=True)
        return res.result(version=self.version, applied=applied, grad_norm=float(grad_norm),
                          seconds=time.perf_counter() - t0)

    @torch.no_grad()
    def evaluate(self, batch: Sequence[Trajectory],
                 recipe: RecipeConfig | None = None) -> StepResult:
        """The loss and metrics of ``batch`` at the current weights under ``recipe``
        (default: the trainer's); no update, ``applied`` False, ``grad_norm`` 0."""
        t0 = time.perf_counter()
        res = self._loss_and_grad(batch, backward=False, recipe=recipe)
        return res.result(version=self.version, applied=False, grad_norm=0.0,
                          seconds=time.perf_counter() - t0)

    def _clip(self) -> torch.Tensor:
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        if not grads:
            return torch.zeros(())
        if self.config.grad_clip is None:
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        return torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.config.grad_clip)

    def _loss_and_grad(self, batch: Sequence[Trajectory], *, backward: bool,
                       recipe: RecipeConfig | None = None) -> _Accumulated:
        cfg = recipe if recipe is not None else self.config.recipe
        keep = [t for t in batch if not t.failed and t.num_generated > 0]
        if not keep:
            raise ValueError(f"train_step: none of the {len(batch)} trajectories has generated "
                             f"tokens ({sum(t.failed for t in batch)} failed)")
        vocab = self.model.config.vocab_size
        for t in keep:
            top = max(int(t.tokens.max()),
                      int(t.support_ids.max()) if t.support_ids.numel() else 0)
            if top >= vocab or int(t.tokens.min()) < 0:
                raise ValueError(f"train_step: trajectory {t.prompt_id} has token id {top} "
                                 f"outside the model's vocabulary (size {vocab})")
        groups = {g: i for i, g in enumerate(sorted({t.group_id for t in keep}))}
        rewards = torch.tensor([t.reward for t in keep], dtype=torch.float64)
        adv = grpo_advantages(rewards, torch.tensor([groups[t.group_id] for t in keep]),
                              normalize_std=cfg.normalize_std, eps=cfg.std_eps)
        pools = sorted({t.pool for t in keep})
        pool_of = {p: i for i, p in enumerate(pools)}
        n_global = sum(t.num_generated for t in keep)
        mbs = pack(keep, self.config.micro_batch_tokens, self.pad_id)
        parts = []
        for mb in mbs:
            loss, metrics = self._micro_batch(cfg, mb, keep, adv, pool_of, pools, n_global)
            if backward:
                loss.backward()
            parts.append(metrics)
        return _Accumulated(LossMetrics.merge(parts), n_global, len(keep),
                            len(batch) - len(keep), len(mbs), float(rewards.mean()))

    def _micro_batch(self, cfg: RecipeConfig, mb: MicroBatch, batch: Sequence[Trajectory], adv: torch.Tensor,
                     pool_of: dict[str, int], pools: list[str],
                     n_global: int) -> tuple[torch.Tensor, LossMetrics]:
        dev = self.device
        members = [batch[i] for i in mb.members]
        support = _concat_support(members, dev)
        counts = torch.tensor([t.num_generated for t in members])
        adv_tok = adv[mb.members].repeat_interleave(counts).to(dev)
        seq_ids = torch.arange(len(members)).repeat_interleave(counts).to(dev)
        pool_ids = torch.tensor([pool_of[t.pool] for t in members]).repeat_interleave(counts).to(dev)
        targets = mb.targets.to(dev)
        out = self.model.model(input_ids=mb.input_ids.to(dev),
                               attention_mask=mb.attention_mask.to(dev), use_cache=False)
        hidden = out.last_hidden_state[mb.rows.to(dev), mb.cols.to(dev)]
        head = self.model.lm_head
        try:
            if cfg.mask_replay:
                replay = replay_logprobs_from_hidden(hidden, head.weight, support, targets,
                                                     cfg.temperature, head.bias)
                return recipe_loss(cfg, support, targets, adv_tok, num_loss_tokens=n_global,
                                   replay=replay, seq_ids=seq_ids, pool_ids=pool_ids,
                                   pool_names=pools)
            full = full_vocab_logprobs(head(hidden), targets, cfg.temperature)
            return recipe_loss(cfg, support, targets, adv_tok, num_loss_tokens=n_global,
                               logp_token_full=full, seq_ids=seq_ids, pool_ids=pool_ids,
                               pool_names=pools)
        except ValueError as e:
            names = ", ".join(t.prompt_id for t in members)
            raise ValueError(f"train_step: bad trajectory among [{names}]: {e}") from e

    # ------------------------------------------------------------------ state
    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by HF parameter name (live tensors; do not modify)."""
        return {n: p.detach() for n, p in self.model.state_dict().items()}

    def digest(self) -> str:
        """SHA-256 over the master weights, optimizer moments and step counts, and version."""
        h = hashlib.sha256(str(self.version).encode())
        for name, p in self.params.items():
            h.update(name.encode())
            h.update(_raw(p))
            for k, v in sorted(self.optimizer.state.get(p, {}).items()):
                h.update(k.encode())
                h.update(_raw(v))
        return h.hexdigest()

    def save_checkpoint(self, directory: str) -> str:
        """Write weights, optimizer state, version, RNG state and config to ``directory``."""
        return _checkpoint.save(self, directory)


class _Accumulated:
    """Merged micro-batch metrics and counts of one pass over a batch."""

    def __init__(self, metrics: LossMetrics, tokens: int, trajectories: int, failed: int,
                 micro_batches: int, reward_mean: float) -> None:
        self.metrics, self.tokens, self.trajectories = metrics, tokens, trajectories
        self.failed, self.micro_batches, self.reward_mean = failed, micro_batches, reward_mean

    def result(self, *, version: int, applied: bool, grad_norm: float,
               seconds: float) -> StepResult:
        m = self.metrics
        overall = PoolMetrics(tokens=m.tokens, mismatch_kl=m.mismatch_kl,
                              masked_fraction=m.masked_fraction, mean_weight=m.mean_weight,
                              entropy=m.entropy)
        return StepResult(version=version, applied=applied, loss=m.loss, grad_norm=grad_norm,
                          tokens=self.tokens, trajectories=self.trajectories,
                          failed_skipped=self.failed, micro_batches=self.micro_batches,
                          reward_mean=self.reward_mean, seconds=seconds, overall=overall,
                          per_pool=dict(m.per_pool))


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _concat_support(members: Sequence[Trajectory], device: torch.device) -> SupportRecord:
    ids = torch.cat([t.support_ids for t in members])
    logq = torch.cat([t.support_logq for t in members])
    counts = torch.cat([(t.support_offsets[1:] - t.support_offsets[:-1]).long() for t in members])
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(counts, 0)
    return SupportRecord(ids.to(device, torch.int32), offsets.to(device, torch.int32),
                         logq.to(device, torch.float32))
