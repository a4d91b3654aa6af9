"""The trainer's configuration and what one training step reports."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from orchestrator.weightsync import Precision
from policies import PoolMetrics, RecipeConfig

__all__ = ["LoraConfig", "StepResult", "TrainerConfig"]


class LoraConfig(BaseModel):
    """Low-rank adapters (``peft``) on the named linear modules; everything else is frozen."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(16, ge=1)
    """Adapter rank."""
    alpha: float = Field(32.0, gt=0.0)
    """Scale numerator: the adapter's update is ``(alpha / r) · B @ A``."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)
    """Names (last path component) of the ``nn.Linear`` modules that get adapters."""


class TrainerConfig(BaseModel):
    """Optimiser, batching, precision and recipe settings of the trainer."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: dict[str, Any] | str | None = None
    """Model config dict (random init from ``seed``), a local checkpoint directory
    (``config.json`` + ``*.safetensors``), or None for the embedded tiny Qwen3 sized to
    the built-in tokenizer. Ignored when resuming: the checkpoint holds the model."""
    lr: float = Field(1e-3, gt=0.0)
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW (beta1, beta2)."""
    eps: float = Field(1e-8, gt=0.0)
    """AdamW epsilon."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    lr_decay_steps: int | None = Field(None, ge=1)
    """Decay the learning rate linearly from ``lr`` to ``lr * lr_final_ratio`` over this many
    optimizer steps, then hold it; None keeps ``lr`` constant. A run config that leaves it
    unset decays over the run's ``steps``. The rate is a function of the policy version, so
    a resumed run continues on the same schedule."""
    lr_final_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Learning rate at the end of the decay, as a fraction of ``lr``; 1 keeps ``lr``
    constant."""
    micro_batch_tokens: int = Field(4096, ge=1)
    """Padded tokens (rows × longest sequence) per forward pass; gradients accumulate
    over micro-batches and the loss is normalised by the whole batch's token count, so
    this changes memory, not the result."""
    grad_clip: float | None = Field(1.0, gt=0.0)
    """Clip the global gradient L2 norm to this value; None disables clipping (the
    norm is still reported)."""
    seed: int = 0
    """Seed of the model init (same seed, same weights as samplers building the model)
    and of torch's CPU generator."""
    precisions: list[Precision] = Field(default_factory=lambda: ["bf16"])
    """Wire precisions published after every step (one snapshot + delta chain each)."""
    keyframe_interval: int = Field(10, ge=1)
    """A full keyframe every this many versions (deltas in between)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the master weights and the optimizer live."""
    procs: int = Field(1, ge=1)
    """Trainer processes: more than one form a ``torch.distributed`` group (gloo on CPU,
    NCCL on CUDA) and shard the model with FSDP2, one unit per decoder layer."""
    rendezvous: str | None = None
    """``host:port`` of rank 0's rendezvous for multi-node groups; None: ``MASTER_ADDR`` /
    ``MASTER_PORT`` from the environment when set (torchrun style), else a free loopback
    port chosen at start-up."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Compute dtype. ``bf16``: bf16 parameters in forward/backward with fp32 master weights,
    fp32 gradient reductions and an fp32 loss (FSDP2 ``MixedPrecisionPolicy``)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of storing them."""
    lora: LoraConfig | None = None
    """Train low-rank adapters only (``pip install flotilla[lora]``); samplers still receive
    merged weights. None: full fine-tuning."""
    recipe: RecipeConfig = Field(default_factory=RecipeConfig)
    """The loss recipe (importance sampling, score centering, replay, advantages)."""

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"betas must each be in [0, 1), got {v}")
        return v

    @field_validator("precisions")
    @classmethod
    def _precisions(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"precisions has duplicates: {v}")
        return v


class StepResult(BaseModel):
    """What one ``train_step`` did (metrics are over the batch's generated tokens)."""

    model_config = ConfigDict(extra="forbid")

    version: int
    """Policy version after the step (unchanged when ``applied`` is False)."""
    applied: bool
    """False when the gradient was not finite and the optimizer step was skipped."""
    loss: float
    """Recipe loss of the batch at the weights before the step (global token mean)."""
    grad_norm: float
    """Global gradient L2 norm before clipping."""
    tokens: int
    """Generated (loss) tokens trained on."""
    trajectories: int
    """Trajectories trained on (failed ones excluded)."""
    failed_skipped: int
    """Failed trajectories in the batch, not trained on."""
    micro_batches: int
    """Forward/backward passes the batch was split into."""
    reward_mean: float
    """Mean reward of the trained trajectories."""
    seconds: float
    """Wall time of the step (packing, forward/backward, optimizer), excluding publishing."""
    overall: PoolMetrics
    """Recipe metrics over all tokens: mismatch KL, masked fraction, mean weight, entropy."""
    per_pool: dict[str, PoolMetrics]
    """The same metrics per sampler pool."""
    publish_seconds: float = 0.0
    """Time spent building wire snapshots and deltas after the step."""
    publish_bytes: dict[str, int] = Field(default_factory=dict)
    """Wire bytes of this version's delta (or keyframe) per precision."""
    memory: dict[str, Any] | None = None
    """Set on the first step a trainer process takes: rank 0's parameter count, bytes per
    rank (parameters, gradients, optimizer) and measured peak memory after that step."""
