"""Decode throughput per GPU: a roofline estimate from the catalog, corrected online.

The roofline (per GPU, batch `b` sequences decoding one token each per step):

    step_s   = max(bytes_per_gpu / (bandwidth · bandwidth_efficiency),
                   flops_per_gpu / (peak · compute_efficiency)) + step_overhead_s
    tokens/s = b / step_s      (b·g ≥ 1: a replica with one sequence still runs whole steps)

- Replicas: a replica of the model spans `g` GPUs (tensor parallel), the smallest power of
  two whose memory (times `memory_fraction`) holds all weights (every expert, at the pool's
  precision) plus the KV cache of its `b·g` sequences. Each GPU reads 1/g of the replica's
  bytes per step. Interconnect time is ignored. A pool's replica size is fixed by its full
  batch (ThroughputModel); at a smaller batch the same replicas run with fewer sequences.
- Weight bytes read per step: shared (non-expert) parameters always; routed experts by
  coverage: with `b·g` tokens each routed to a fraction f = routed_active / routed_total of
  the experts, a fraction 1 − (1 − f)^(b·g) of the expert weights is read. Dense models have
  f = 1 (all weights every step); at batch 1 a MoE reads its active parameters only.
- Bytes per parameter: BF16 2; FP8 1 plus one FP32 scale per 128×128 block.
- KV cache: `b · context_tokens · kv_bytes_per_token` bytes read per step, kept in BF16 at both
  precisions (the serving default); attention FLOPs are one multiply-add per cached element.
- FLOPs: 2 · active_params per token plus attention; FP8 pools use the FP8 peak.
- Prefill, sampling, detokenisation and environment time are not modelled; the fixed
  `step_overhead_s` stands for launch and scheduling cost per step.

Online correction: each measurement gives a ratio measured / roofline at the measured batch;
the pool's factor is an exponentially weighted mean of these ratios in log space (so halving
and doubling weigh the same), and every estimate is roofline × factor. A pool emulated on this
machine's CPU is measured running on the CPU, so its ratio is taken against the `cpu` roofline
and applied to the emulated GPU's: the pool keeps its modelled speed, corrected by how far its
emulation runs from the model (a slowed-down emulated pool still looks slower).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hardware._state import parse_state
from hardware.catalog import CATALOG, GpuSpec
from hardware.pools import PoolConfig

__all__ = [
    "ModelSpec",
    "RooflineAssumptions",
    "ThroughputModel",
    "bytes_per_param",
    "decode_step_seconds",
    "fit_batch_per_gpu",
    "replica_gpus",
    "roofline_tokens_per_s",
]

_FP8_BLOCK = 128 * 128


def bytes_per_param(precision: str) -> float:
    """Stored bytes per weight: BF16 2; FP8 1 + one FP32 scale per 128×128 block."""
    if precision == "bf16":
        return 2.0
    if precision == "fp8":
        return 1.0 + 4.0 / _FP8_BLOCK
    raise ValueError(f"precision must be 'bf16' or 'fp8', got {precision!r}")


class ModelSpec(BaseModel):
    """What the roofline needs to know about the policy model."""

    model_config = ConfigDict(extra="forbid")

    total_params: float = Field(gt=0)
    """All parameters, every expert included: what must sit in device memory."""
    active_params: float = Field(gt=0)
    """Parameters one token uses (MoE: shared part + the routed experts it picks; dense: total)."""
    shared_params: float = Field(default=0.0, ge=0)
    """Part of `active_params` that every token reads (attention, embeddings, shared experts);
    the rest is routed experts."""
    kv_bytes_per_token: float = Field(default=0.0, ge=0)
    """KV-cache bytes per token of context, all layers, K and V, BF16."""
    context_tokens: float = Field(default=0.0, ge=0)
    """Mean context length (prompt + generated so far) of a decoding sequence."""

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        if self.active_params > self.total_params:
            raise ValueError(f"active_params ({self.active_params:g}) exceeds total_params ({self.total_params:g})")
        if self.shared_params > self.active_params:
            raise ValueError(f"shared_params ({self.shared_params:g}) exceeds active_params ({self.active_params:g})")
        return self

    def params_read(self, tokens_in_step: float) -> float:
        """Parameters read from memory by one decode step over `tokens_in_step` sequences."""
        routed_total = self.total_params - self.shared_params
        routed_active = self.active_params - self.shared_params
        if routed_total <= 0.0:
            return self.total_params
        f = routed_active / routed_total
        coverage = 1.0 - (1.0 - f) ** max(tokens_in_step, 1.0)
        return self.shared_params + routed_total * coverage

    @property
    def kv_bytes_per_sequence(self) -> float:
        return self.kv_bytes_per_token * self.context_tokens


class RooflineAssumptions(BaseModel):
    """Efficiency factors of the roofline; documented defaults, override per run."""

    model_config = ConfigDict(extra="forbid")

    bandwidth_efficiency: float = Field(default=0.7, gt=0, le=1)
    """Fraction of peak memory bandwidth a decode kernel sustains."""
    compute_efficiency: float = Field(default=0.5, gt=0, le=1)
    """Fraction of dense peak tensor FLOPS sustained during decode."""
    memory_fraction: float = Field(default=0.9, gt=0, le=1)
    """Fraction of device memory usable for weights and KV cache."""
    gpu_step_overhead_s: float = Field(default=0.001, ge=0)
    """Fixed cost per decode step on a GPU (launches, scheduling)."""
    cpu_step_overhead_s: float = Field(default=0.004, ge=0)
    """Fixed cost per decode step on this machine's CPU (launches, Python, scheduling)."""
    max_replica_gpus: int = Field(default=8, ge=1)
    """Largest tensor-parallel replica (one NVLink node); a model needing more does not fit."""


def replica_gpus(
    gpu: GpuSpec, precision: str, model: ModelSpec, batch_per_gpu: float, a: RooflineAssumptions
) -> int | None:
    """GPUs per model replica (a power of two), or None if the batch's KV cache alone does not fit."""
    room_per_gpu = gpu.memory_gb * 1e9 * a.memory_fraction - batch_per_gpu * model.kv_bytes_per_sequence
    if room_per_gpu <= 0.0:
        return None
    weights = model.total_params * bytes_per_param(precision)
    g = 1
    while g * room_per_gpu < weights:
        g *= 2
    return g if g <= a.max_replica_gpus else None


def fit_batch_per_gpu(
    gpu: GpuSpec,
    precision: str,
    model: ModelSpec,
    a: RooflineAssumptions | None = None,
    *,
    cap: int = 256,
    weight_share: float = 0.5,
) -> int:
    """A sensible full decode batch per GPU: take the smallest power-of-two replica whose
    usable memory the weights fill to at most `weight_share`, give the rest to the KV cache
    (as a serving engine sizes its KV pool) and fit as many sequences as it holds, at most
    `cap`. 0 if no replica of up to `max_replica_gpus` GPUs qualifies."""
    a = a or RooflineAssumptions()
    usable = gpu.memory_gb * 1e9 * a.memory_fraction
    weights = model.total_params * bytes_per_param(precision)
    g = 1
    while weights > weight_share * g * usable:
        g *= 2
        if g > a.max_replica_gpus:
            return 0
    kv = model.kv_bytes_per_sequence
    if kv <= 0.0:
        return cap
    return max(0, min(cap, int((g * usable - weights) / (g * kv))))


def decode_step_seconds(
    gpu: GpuSpec,
    precision: str,
    model: ModelSpec,
    batch_per_gpu: float,
    a: RooflineAssumptions,
    replica: int | None = None,
) -> float:
    """Seconds for one decode step with `batch_per_gpu` sequences per GPU on a replica of
    `replica` GPUs (None: the smallest that fits the batch); inf if it cannot fit.

    A replica steps all its sequences together, so a batch under one sequence per GPU (fewer
    sequences than GPUs in the replica) still pays for a step of one sequence across the
    replica: its GPUs are busy, and each produces tokens ÷ g per step."""
    b = max(batch_per_gpu, 0.0)
    if replica is None:
        g = replica_gpus(gpu, precision, model, max(b, 1.0), a)
        if g is None:
            return math.inf
    else:
        g = replica
        if g < 1:
            return math.inf
        room_per_gpu = gpu.memory_gb * 1e9 * a.memory_fraction - max(b, 1.0 / g) * model.kv_bytes_per_sequence
        if g * room_per_gpu < model.total_params * bytes_per_param(precision):
            return math.inf
    tokens = max(b * g, 1.0)  # sequences in the replica's step
    bytes_per_gpu = (model.params_read(tokens) * bytes_per_param(precision) + tokens * model.kv_bytes_per_sequence) / g
    flops_per_gpu = tokens / g * (2.0 * model.active_params + model.kv_bytes_per_sequence)
    peak = gpu.fp8_tflops if precision == "fp8" and gpu.fp8_tflops is not None else gpu.bf16_tflops
    memory_s = bytes_per_gpu / (gpu.bandwidth_gbps * 1e9 * a.bandwidth_efficiency)
    compute_s = flops_per_gpu / (peak * 1e12 * a.compute_efficiency)
    overhead = a.cpu_step_overhead_s if gpu.name == "cpu" else a.gpu_step_overhead_s
    return max(memory_s, compute_s) + overhead


def roofline_tokens_per_s(
    gpu: GpuSpec,
    precision: str,
    model: ModelSpec,
    batch_per_gpu: float,
    a: RooflineAssumptions | None = None,
    replica: int | None = None,
) -> float:
    """Decode tokens/s per GPU at `batch_per_gpu` concurrent sequences per GPU on a replica of
    `replica` GPUs (None: the smallest that fits); 0 if it cannot fit."""
    a = a or RooflineAssumptions()
    step = decode_step_seconds(gpu, precision, model, batch_per_gpu, a, replica)
    if math.isinf(step):
        return 0.0
    g = replica if replica is not None else replica_gpus(gpu, precision, model, max(batch_per_gpu, 1.0), a)
    assert g is not None  # a finite step means a replica fits
    return max(batch_per_gpu * g, 1.0) / g / step


class _PoolFactorState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    log_factor: float
    """Natural log of the pool's measured / roofline factor."""
    observations: int = Field(ge=0)
    """Measurements folded in so far."""


class _ThroughputState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pools: dict[str, _PoolFactorState] = Field(default_factory=dict)
    """Online correction per pool name."""


class ThroughputModel:
    """Per-pool decode tokens/s per GPU: roofline × an online factor.

    Each pool serves replicas of the size that holds the model and the KV cache of its full
    batch (`replica_gpus(pool)`); at a smaller batch the same replicas run, fewer sequences
    each. Not thread-safe; owned by one scheduler or controller task.
    """

    def __init__(
        self,
        pools: Sequence[PoolConfig],
        model: ModelSpec,
        assumptions: RooflineAssumptions | None = None,
        *,
        alpha: float = 0.3,
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.model = model
        self.assumptions = assumptions or RooflineAssumptions()
        self.alpha = alpha
        self._pools = {p.name: p for p in pools}
        self._log_factor = {p.name: 0.0 for p in pools}
        self._observations = {p.name: 0 for p in pools}
        self._replica: dict[str, int] = {}
        for p in pools:
            g = replica_gpus(p.spec, p.precision, model, p.capacity / p.count, self.assumptions)
            self._replica[p.name] = 0 if g is None or g > p.count else g

    def _pool(self, name: str) -> PoolConfig:
        try:
            return self._pools[name]
        except KeyError:
            raise KeyError(f"no pool {name!r}; pools: {', '.join(self._pools)}") from None

    def batch_per_gpu(self, pool: str) -> float:
        """Concurrent sequences per GPU when the pool is full."""
        p = self._pool(pool)
        return p.capacity / p.count

    def replica_gpus(self, pool: str) -> int:
        """GPUs per replica the pool serves (tensor parallel); 0 if the model with the KV cache
        of its full batch does not fit a replica of at most `max_replica_gpus`, or the pool has
        fewer GPUs than one replica needs."""
        return self._replica[self._pool(pool).name]

    def slots_per_replica(self, pool: str) -> int:
        """Concurrent sequences one replica holds when the pool is full (0 if none fits)."""
        p = self._pool(pool)
        g = self._replica[p.name]
        return 0 if g == 0 else math.ceil(p.capacity / (p.count // g))

    def roofline(self, pool: str, batch_per_gpu: float | None = None) -> float:
        """Uncorrected roofline tokens/s per GPU of the pool's replicas (at full batch unless
        given); 0 if the model does not fit."""
        p = self._pool(pool)
        g = self._replica[p.name]
        if g == 0:
            return 0.0
        b = self.batch_per_gpu(pool) if batch_per_gpu is None else batch_per_gpu
        return roofline_tokens_per_s(p.spec, p.precision, self.model, b, self.assumptions, replica=g)

    def factor(self, pool: str) -> float:
        """Measured / roofline, exponentially weighted (1.0 before any measurement)."""
        return math.exp(self._log_factor[self._pool(pool).name])

    def observations(self, pool: str) -> int:
        return self._observations[self._pool(pool).name]

    def estimate(self, pool: str, batch_per_gpu: float | None = None) -> float:
        """Expected tokens/s per GPU: roofline × factor."""
        return self.roofline(pool, batch_per_gpu) * self.factor(pool)

    def usd_per_token(self, pool: str, batch_per_gpu: float | None = None) -> float:
        """Expected cost of one token on the pool's busy GPUs at `batch_per_gpu` sequences per
        GPU (None: full batch); inf if the model cannot run there."""
        tps = self.estimate(pool, batch_per_gpu)
        return math.inf if tps <= 0.0 else self._pool(pool).price / 3600.0 / tps

    def observe(self, pool: str, tokens: float, gpu_seconds: float, batch_per_gpu: float | None = None) -> float:
        """Fold in a measurement: `tokens` decoded in `gpu_seconds` busy GPU-seconds at a mean
        of `batch_per_gpu` sequences per GPU (None: full batch). Returns the new factor.
        Measurements with no tokens or no time are ignored."""
        p = self._pool(pool)
        name = p.name
        if tokens <= 0 or gpu_seconds <= 0:
            return self.factor(name)
        if p.emulated:
            b = self.batch_per_gpu(name) if batch_per_gpu is None else batch_per_gpu
            expected = roofline_tokens_per_s(CATALOG["cpu"], p.precision, self.model, b, self.assumptions)
        else:
            expected = self.roofline(name, batch_per_gpu)
        if expected <= 0.0:
            return self.factor(name)
        ratio = (tokens / gpu_seconds) / expected
        lf = self._log_factor[name]
        self._log_factor[name] = lf + self.alpha * (math.log(ratio) - lf)
        self._observations[name] += 1
        return self.factor(name)

    # -- resume -------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The online corrections as JSON-serialisable data (for a controller checkpoint)."""
        return {
            "pools": {
                name: {"log_factor": self._log_factor[name], "observations": self._observations[name]}
                for name in self._pools
            }
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state()` returned. Pools absent from `state` keep their current factor;
        a pool in `state` that this model does not have, or a malformed entry, raises ValueError
        naming it (nothing is changed then)."""
        parsed = parse_state(_ThroughputState, state, "throughput state", lambda s: s.pools, self._pools)
        for name, st in parsed.pools.items():
            if not math.isfinite(st.log_factor):
                raise ValueError(f"throughput state: pool {name!r}: log_factor must be finite, got {st.log_factor}")
        for name, st in parsed.pools.items():
            self._log_factor[name] = st.log_factor
            self._observations[name] = st.observations
