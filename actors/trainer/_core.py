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

On the FSDP2 path (``TrainerConfig.procs`` > 1, bf16 or LoRA; see ``_shard``) every rank
runs the same ``train_step`` on the whole batch: steps 1 and the global token count are
computed everywhere, each rank packs and trains only its token share (``_dist``), ranks
with fewer micro-batches take zero-loss passes (FSDP2's collectives need every rank),
gradients are summed across ranks, the clip norm is global, and the metrics of all
ranks are merged on every rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from actors.models import build_model, default_model_config
from actors.tokenizer import VOCAB_SIZE
from actors.trainer import _checkpoint, _dcp
from actors.trainer._config import StepResult, TrainerConfig
from actors.trainer._dist import (
    World,
    all_max,
    gather_json,
    init_group,
    rendezvous_address,
    token_shares,
)
from actors.trainer._packing import MicroBatch, pack
from actors.trainer._sft import SftResult, SftSequence, sft_pass
from actors.trainer._shard import hf_name, is_sharded, lora_merge_plan, prepare
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
    stuck_groups,
)

__all__ = ["Trainer"]


class Trainer:
    """fp32 master weights + AdamW + the recipe loss (see the module docstring).

    ``world`` is this process's rank in the trainer group (default: rank 0 of 1). A
    multi-rank Trainer needs the process group joined first (``_dist.init_group``, as
    ``TrainerActor`` does); a one-rank Trainer on the FSDP2 path (bf16 or LoRA) joins a
    group of one on a free loopback port itself, in the calling process.

    ``resume_from`` is a directory written by :meth:`save_checkpoint`; the model,
    optimizer state, version and RNG state come from it, hyperparameters from
    ``config`` (keep them equal for a bit-exact continuation).
    """

    def __init__(self, config: TrainerConfig, resume_from: str | None = None, world: World | None = None) -> None:
        self.config = config
        self.world = world if world is not None else World()
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        # Every error of reading the checkpoint is one CheckpointError line naming the file.
        resuming = _checkpoint.loading(resume_from) if resume_from is not None else contextlib.nullcontext()
        with resuming:
            fmt = _checkpoint.checkpoint_format(resume_from) if resume_from is not None else None
            if resume_from is not None:
                model_src: dict[str, Any] | str = _checkpoint.model_dir(resume_from)
            else:
                model_src = config.model if config.model is not None else default_model_config(VOCAB_SIZE)
            self.model_source = model_src
            self.model_config: dict[str, Any] = (
                dict(model_src)
                if isinstance(model_src, dict)
                else json.loads((Path(model_src) / "config.json").read_text())
            )
            """The resolved model config dict (what samplers must build)."""
        # A sharded checkpoint's model dir holds only config.json: the weights come from
        # the distributed checkpoint after the model is sharded.
        build_src = self.model_config if fmt == _dcp.FORMAT else model_src
        self.sharded = is_sharded(config)
        """FSDP2 path: several ranks, bf16 compute or LoRA (see ``_shard``)."""
        if self.sharded and not dist.is_initialized():
            if self.world.size != 1:
                raise RuntimeError("a multi-rank Trainer needs its process group initialised")
            init_group(rendezvous_address(None), self.world, config.device)
        with _checkpoint.loading(str(build_src)) if isinstance(build_src, str) else contextlib.nullcontext():
            model = build_model(build_src, seed=config.seed)
        if self.device.type == "cuda":
            model = model.to(self.device)
        self.policy = prepare(model, config, sharded=self.sharded, seed=config.seed)
        self.model = model
        """The HF model (its parameters are DTensor shards on the FSDP2 path)."""
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        """Trained parameters by name (all of them, or the LoRA adapters)."""
        self.optimizer = torch.optim.AdamW(
            list(self.params.values()),
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
            foreach=False,
        )
        self.version = 0
        self.pad_id = 0
        if resume_from is not None:
            with _checkpoint.loading(resume_from):
                self.version = (
                    _dcp.load(self, resume_from)
                    if fmt == _dcp.FORMAT or self.sharded
                    else _checkpoint.load_state(self, resume_from)
                )
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
        return res.result(
            version=self.version, applied=applied, grad_norm=float(grad_norm), seconds=time.perf_counter() - t0
        )

    @torch.no_grad()
    def evaluate(self, batch: Sequence[Trajectory], recipe: RecipeConfig | None = None) -> StepResult:
        """The loss and metrics of ``batch`` at the current weights under ``recipe``
        (default: the trainer's); no update, ``applied`` False, ``grad_norm`` 0."""
        t0 = time.perf_counter()
        res = self._loss_and_grad(batch, backward=False, recipe=recipe)
        return res.result(version=self.version, applied=False, grad_norm=0.0, seconds=time.perf_counter() - t0)

    def _clip(self) -> torch.Tensor:
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        if self.sharded:
            return self._clip_sharded(grads)
        if not grads:
            return torch.zeros(())
        if self.config.grad_clip is None:
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        return torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.config.grad_clip)

    def _clip_sharded(self, grads: list[torch.Tensor]) -> torch.Tensor:
        # The norm over every rank's shard (each element lives on exactly one rank), then
        # the same clip coefficient as torch.nn.utils.clip_grad_norm_.
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            sq += g.to_local().float().pow(2).sum()
        dist.all_reduce(sq)
        norm = sq.sqrt().cpu()
        if self.config.grad_clip is not None and bool(torch.isfinite(norm)):
            coef = min(1.0, self.config.grad_clip / (float(norm) + 1e-6))
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        return norm

    def _loss_and_grad(
        self, batch: Sequence[Trajectory], *, backward: bool, recipe: RecipeConfig | None = None
    ) -> _Accumulated:
        cfg = recipe if recipe is not None else self.config.recipe
        keep = [t for t in batch if not t.failed and t.num_generated > 0]
        if not keep:
            raise ValueError(
                f"train_step: none of the {len(batch)} trajectories has generated "
                f"tokens ({sum(t.failed for t in batch)} failed)"
            )
        vocab = self.model.config.vocab_size
        for t in keep:
            top = max(int(t.tokens.max()), int(t.support_ids.max()) if t.support_ids.numel() else 0)
            if top >= vocab or int(t.tokens.min()) < 0:
                raise ValueError(
                    f"train_step: trajectory {t.prompt_id} has token id {top} "
                    f"outside the model's vocabulary (size {vocab})"
                )
        if self.world.size > 1:
            # A bad record found by one rank alone would leave the others waiting in a
            # collective: every rank checks the whole batch before the first one.
            for t in keep:
                _check_support(t)
        groups = {g: i for i, g in enumerate(sorted({t.group_id for t in keep}))}
        rewards = torch.tensor([t.reward for t in keep], dtype=torch.float64)
        adv = grpo_advantages(
            rewards,
            torch.tensor([groups[t.group_id] for t in keep]),
            normalize_std=cfg.normalize_std,
            eps=cfg.std_eps,
            flat_groups=cfg.flat_groups,
        )
        group_of = [t.group_id for t in keep]
        stuck = stuck_groups(rewards, group_of) if cfg.entropy_coef > 0 and cfg.entropy_groups == "stuck" else None
        pools = sorted({t.pool for t in keep})
        pool_of = {p: i for i, p in enumerate(pools)}
        n_global = sum(t.num_generated for t in keep)
        mine = token_shares([t.num_generated for t in keep], self.world.size)[self.world.rank]
        local = [keep[i] for i in mine]
        mbs = pack(local, self.config.micro_batch_tokens, self.pad_id)
        # FSDP2 runs collectives in every forward and backward: all ranks take the same
        # number of passes, a rank short of work takes zero-loss ones.
        passes = all_max(len(mbs), self.device) if self.world.size > 1 else len(mbs)
        parts = []
        for k in range(passes):
            if k < len(mbs):
                loss, metrics = self._micro_batch(
                    cfg, mbs[k], local, adv[mine], pool_of, pools, n_global, None if stuck is None else stuck[mine]
                )
                parts.append(metrics)
            else:
                loss = self._idle_pass()
            if backward:
                loss.backward()
        merged = LossMetrics.merge(parts) if parts else None
        if self.world.size > 1:
            every = gather_json(merged.model_dump(mode="json") if merged else None, self.world, self.device)
            merged = LossMetrics.merge([LossMetrics.model_validate(m) for m in every if m])
        assert merged is not None
        return _Accumulated(merged, n_global, len(keep), len(batch) - len(keep), passes, float(rewards.mean()))

    def _idle_pass(self) -> torch.Tensor:
        one = torch.full((1, 1), self.pad_id, dtype=torch.int64, device=self.device)
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        return self.policy(
            one, torch.ones_like(one), zero, zero, lambda hidden, weight, bias: (hidden.sum() + weight.sum()) * 0.0
        )

    def _micro_batch(
        self,
        cfg: RecipeConfig,
        mb: MicroBatch,
        batch: Sequence[Trajectory],
        adv: torch.Tensor,
        pool_of: dict[str, int],
        pools: list[str],
        n_global: int,
        stuck: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LossMetrics]:
        dev = self.device
        members = [batch[i] for i in mb.members]
        support = _concat_support(members, dev)
        counts = torch.tensor([t.num_generated for t in members])
        adv_tok = adv[mb.members].repeat_interleave(counts).to(dev)
        seq_ids = torch.arange(len(members)).repeat_interleave(counts).to(dev)
        pool_ids = torch.tensor([pool_of[t.pool] for t in members]).repeat_interleave(counts).to(dev)
        targets = mb.targets.to(dev)
        common = {"num_loss_tokens": n_global, "seq_ids": seq_ids, "pool_ids": pool_ids, "pool_names": pools}
        if stuck is not None:  # the entropy term on stuck groups' tokens alone
            common["entropy_mask"] = stuck[mb.members].repeat_interleave(counts).to(dev)

        def loss_fn(
            hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
        ) -> tuple[torch.Tensor, LossMetrics]:
            if cfg.mask_replay:
                replay = replay_logprobs_from_hidden(hidden, weight, support, targets, cfg.temperature, bias)
                return recipe_loss(cfg, support, targets, adv_tok, replay=replay, **common)
            logits = torch.nn.functional.linear(hidden, weight, bias)
            full = full_vocab_logprobs(logits, targets, cfg.temperature)
            return recipe_loss(cfg, support, targets, adv_tok, logp_token_full=full, **common)

        try:
            return self.policy(
                mb.input_ids.to(dev), mb.attention_mask.to(dev), mb.rows.to(dev), mb.cols.to(dev), loss_fn
            )
        except ValueError as e:
            names = ", ".join(t.prompt_id for t in members)
            raise ValueError(f"train_step: bad trajectory among [{names}]: {e}") from e

    def sft_step(self, batch: Sequence[SftSequence], lr: float) -> SftResult:
        """One supervised step on ``batch`` at rate ``lr`` (``actors.trainer._sft``)."""
        return sft_pass(self, batch, lr=lr)

    @torch.no_grad()
    def sft_evaluate(self, batch: Sequence[SftSequence]) -> SftResult:
        """The mean NLL of ``batch``'s loss tokens at the current weights; nothing changes."""
        return sft_pass(self, batch, lr=None)

    # ------------------------------------------------------------------ state
    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 weights samplers use, by HF parameter name (LoRA: merged).

        Single process, full fine-tuning: the live master tensors (do not modify).
        FSDP2: a collective (every rank must call it); each tensor is gathered in turn
        and only rank 0 keeps it, so rank 0 holds one full copy next to its shard and
        the other ranks return an empty dict.
        """
        if not self.sharded:
            return {n: p.detach() for n, p in self.model.state_dict().items()}
        full = {n: t for n, t in self._gathered()}
        if not self.world.is_main:
            return {}
        for name, (base, a, b, scale) in lora_merge_plan(self.model).items():
            full[name] = full.pop(base) + scale * (full.pop(b) @ full.pop(a))
        return {hf_name(n): t for n, t in full.items()}

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter tensors alone, by their ``peft`` names (``...q_proj.lora_A.default
        .weight``), fp32 on CPU, for exporting an adapter; {} without LoRA. A collective on
        the FSDP2 path (rank 0 gets the tensors, the others {})."""
        out = {}
        for name, p in self.params.items():
            if ".lora_A." in name or ".lora_B." in name:
                full = _full(p).detach().to("cpu")
                if self.world.is_main:
                    out[name] = full
        return out

    def _gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full fp32 tensor on CPU) for each parameter and buffer, in order; a
        collective. Non-zero ranks get each tensor too and drop it at once."""
        for name, t in self.model.state_dict().items():
            full = t.full_tensor() if isinstance(t, DTensor) else t
            yield name, full.detach().to("cpu")

    def digest(self) -> str:
        """SHA-256 over the master weights, optimizer moments and step counts, and version
        (a collective on the FSDP2 path; every rank returns the same digest)."""
        h = hashlib.sha256(str(self.version).encode())
        for name, p in self.params.items():
            h.update(name.encode())
            h.update(_raw(_full(p)))
            for k, v in sorted(self.optimizer.state.get(p, {}).items()):
                h.update(k.encode())
                h.update(_raw(_full(v)))
        return h.hexdigest()

    def save_checkpoint(self, directory: str) -> str:
        """Write weights, optimizer state, version, RNG state and config to ``directory``
        (FSDP2 path: a distributed checkpoint, written by every rank together)."""
        return _dcp.save(self, directory) if self.sharded else _checkpoint.save(self, directory)


class _Accumulated:
    """Merged micro-batch metrics and counts of one pass over a batch."""

    def __init__(
        self, metrics: LossMetrics, tokens: int, trajectories: int, failed: int, micro_batches: int, reward_mean: float
    ) -> None:
        self.metrics, self.tokens, self.trajectories = metrics, tokens, trajectories
        self.failed, self.micro_batches, self.reward_mean = failed, micro_batches, reward_mean

    def result(self, *, version: int, applied: bool, grad_norm: float, seconds: float) -> StepResult:
        m = self.metrics
        overall = PoolMetrics(
            tokens=m.tokens,
            mismatch_kl=m.mismatch_kl,
            masked_fraction=m.masked_fraction,
            mean_weight=m.mean_weight,
            entropy=m.entropy,
        )
        return StepResult(
            version=version,
            applied=applied,
            loss=m.loss,
            grad_norm=grad_norm,
            tokens=self.tokens,
            trajectories=self.trajectories,
            failed_skipped=self.failed,
            micro_batches=self.micro_batches,
            reward_mean=self.reward_mean,
            seconds=seconds,
            overall=overall,
            per_pool=dict(m.per_pool),
        )


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _check_support(t: Trajectory) -> None:
    """The record checks ``recipe_loss`` makes, done up front (see ``_loss_and_grad``)."""
    off = t.support_offsets.long()
    n = t.num_generated
    ok = (
        off.numel() == n + 1
        and int(off[0]) == 0
        and int(off[-1]) == t.support_ids.numel()
        and bool((off[1:] >= off[:-1]).all())
        and t.support_logq.numel() == t.support_ids.numel()
    )
    if ok:
        ys = t.tokens[t.loss_mask.bool()]
        for i in range(n):
            if not bool((t.support_ids[off[i] : off[i + 1]] == ys[i]).any()):
                ok = False
                break
    if not ok:
        raise ValueError(
            f"train_step: bad trajectory among [{t.prompt_id}]: malformed support "
            "record (offsets, sizes, or a sampled token outside its support)"
        )


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _concat_support(members: Sequence[Trajectory], device: torch.device) -> SupportRecord:
    ids = torch.cat([t.support_ids for t in members])
    logq = torch.cat([t.support_logq for t in members])
    counts = torch.cat([(t.support_offsets[1:] - t.support_offsets[:-1]).long() for t in members])
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(counts, 0)
    return SupportRecord(ids.to(device, torch.int32), offsets.to(device, torch.int32), logq.to(device, torch.float32))
