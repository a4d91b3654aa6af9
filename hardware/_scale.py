"""What the scale simulation (`hardware.fleetscale`) takes and returns: pools, totals, a step log."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["ScalePool", "ScalePoolStats", "ScaleResult", "ScaleStep"]


@dataclass(frozen=True)
class ScalePool:
    """A set of identical GPUs of one provider, as the scale simulation sees it."""

    name: str
    provider: str
    gpu: str
    count: int
    tokens_per_s_per_gpu: float
    """Decode tokens/s of one GPU with all its slots busy."""
    slots_per_gpu: int
    """Rollouts one GPU decodes at once."""
    price_per_gpu_hour: float
    spot: bool = False
    preemptions_per_gpu_hour: float = 0.0
    """Mean preemptions of one GPU per hour it runs (spot only; 0 = never)."""
    link_gbps: float = 10.0
    """Bandwidth of the pool's link to the trainer, Gbit/s."""
    delta_bytes: float = 0.0
    """Bytes of one weight update (a sparse delta) sent to the pool per trainer step."""
    keyframe_bytes: float = 0.0
    """Bytes of the full weights a replacement GPU loads after a preemption."""
    staleness_budget: int = 2
    restart_s: float = 300.0
    """Seconds a preempted GPU's replacement takes to boot before it loads weights."""

    def __post_init__(self) -> None:
        checks = [
            (self.count >= 1, f"count must be ≥ 1, got {self.count}"),
            (self.tokens_per_s_per_gpu > 0, f"tokens_per_s_per_gpu must be > 0, got {self.tokens_per_s_per_gpu}"),
            (self.slots_per_gpu >= 1, f"slots_per_gpu must be ≥ 1, got {self.slots_per_gpu}"),
            (self.price_per_gpu_hour >= 0, f"price_per_gpu_hour must be ≥ 0, got {self.price_per_gpu_hour}"),
            (
                self.preemptions_per_gpu_hour >= 0,
                f"preemptions_per_gpu_hour must be ≥ 0, got {self.preemptions_per_gpu_hour}",
            ),
            (self.spot or self.preemptions_per_gpu_hour == 0, "an on-demand pool is not preempted; set spot=True"),
            (self.link_gbps > 0, f"link_gbps must be > 0, got {self.link_gbps}"),
            (self.delta_bytes >= 0 and self.keyframe_bytes >= 0, "delta_bytes and keyframe_bytes must be ≥ 0"),
            (self.staleness_budget >= 0, f"staleness_budget must be ≥ 0, got {self.staleness_budget}"),
            (self.restart_s >= 0, f"restart_s must be ≥ 0, got {self.restart_s}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"pool {self.name!r}: {msg}")

    @property
    def update_s(self) -> float:
        """Seconds one weight update takes to reach the pool: delta bytes ÷ link bandwidth."""
        return self.delta_bytes * 8.0 / (self.link_gbps * 1e9)

    @property
    def keyframe_s(self) -> float:
        """Seconds a replacement GPU takes to load the full weights over the link."""
        return self.keyframe_bytes * 8.0 / (self.link_gbps * 1e9)

    @property
    def usd_per_mtok(self) -> float:
        """Cost of a million tokens at full batch: price ÷ 3600 ÷ tokens/s × 10^6."""
        return self.price_per_gpu_hour / 3600.0 / self.tokens_per_s_per_gpu * 1e6


@dataclass
class ScalePoolStats:
    """What one pool did."""

    started: int = 0
    completed: int = 0
    trained: int = 0
    dropped: int = 0
    lost: int = 0
    """Rollouts lost to preemptions."""
    preemptions: int = 0
    tokens: float = 0.0
    """Tokens of rollouts that finished decoding."""
    tokens_lost: float = 0.0
    """Tokens decoded by rollouts a preemption killed."""
    cost_usd: float = 0.0


@dataclass(frozen=True)
class ScaleStep:
    """The state when trainer step `step` finished."""

    step: int
    t: float
    tokens: float
    """Tokens generated so far (finished rollouts and those lost to preemption)."""
    cost_usd: float
    tokens_trained: float
    """Tokens of the rollouts trained on so far, this step's included."""
    staleness_mean: float
    """Mean staleness of the rollouts this step trained on."""
    tokens_by_pool: dict[str, float]


@dataclass
class ScaleResult:
    """Totals of one simulation."""

    sim_seconds: float
    steps: int
    cost_usd: float
    tokens: float
    """Tokens of finished rollouts (what the cost report counts)."""
    tokens_lost: float
    tokens_trained: float
    rollouts_completed: int
    """Rollouts that finished decoding."""
    rollouts_served: int
    """Rollouts the controller has served (finished and handed on)."""
    rollouts_trained: int
    rollouts_dropped: int
    rollouts_lost: int
    preemptions: int
    staleness: Counter[int]
    """Trained rollouts per staleness (trainer version − start version)."""
    controller_s_per_rollout: float
    controller_cores: int
    controller_busy_fraction: float
    """Controller core-seconds used ÷ (cores × simulated seconds)."""
    trainer_idle_fraction: float
    """Time the trainer waited for a batch ÷ time from its first batch to the last step."""
    pools: dict[str, ScalePoolStats]
    log: list[ScaleStep] = field(default_factory=list)

    @property
    def usd_per_mtok(self) -> float:
        return self.cost_usd / self.tokens * 1e6 if self.tokens else math.nan

    @property
    def usd_per_mtok_trained(self) -> float:
        return self.cost_usd / self.tokens_trained * 1e6 if self.tokens_trained else math.nan

    def window_usd_per_mtok_trained(self, first_step: int) -> float:
        """Cost per million trained tokens between the end of step `first_step` and the last
        step: the steady state, without the initial fill and what is in flight at the end."""
        if not 1 <= first_step < len(self.log):
            raise ValueError(f"first_step must be in [1, {len(self.log) - 1}], got {first_step}")
        a, b = self.log[first_step - 1], self.log[-1]
        tokens = b.tokens_trained - a.tokens_trained
        return (b.cost_usd - a.cost_usd) / tokens * 1e6 if tokens > 0 else math.nan

    @property
    def rollouts_per_s(self) -> float:
        """Rollouts through the controller per simulated second."""
        return self.rollouts_served / self.sim_seconds if self.sim_seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.sim_seconds if self.sim_seconds > 0 else 0.0

    @property
    def controller_ceiling_rollouts_per_s(self) -> float:
        """cores ÷ per-rollout cost: the most rollouts/s the controller can serve."""
        return self.controller_cores / self.controller_s_per_rollout if self.controller_s_per_rollout > 0 else math.inf

    def staleness_quantile(self, q: float) -> int:
        """The smallest staleness s with at least a fraction q of trained rollouts at or below s."""
        n = sum(self.staleness.values())
        if n == 0:
            return 0
        seen = 0
        for s in sorted(self.staleness):
            seen += self.staleness[s]
            if seen >= q * n:
                return s
        return max(self.staleness)

    @property
    def staleness_mean(self) -> float:
        n = sum(self.staleness.values())
        return sum(s * c for s, c in self.staleness.items()) / n if n else math.nan
