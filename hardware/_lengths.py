"""The scheduler's estimate of generated tokens per rollout.

A flow ratio per pool: tokens generated (from throughput observations) ÷ rollouts finished,
both forgotten exponentially over the pool's last `window` fills' worth of tokens, and
starting from the configured mean counted as one fill of the pool; the estimate is Σ tokens ÷
Σ rollouts over pools. In a steady state this is the mean rollout length. In a transient it
errs long, where the mean of finished rollouts errs short: after a synchronised start the
short rollouts finish first, and a short estimate makes the scheduler believe rollouts in
flight will land sooner than they do (the trainer waits). Before a pool's first observation,
its finished rollouts' token counts stand in for what it generated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["PoolLengthState", "RolloutLengths"]


class PoolLengthState(BaseModel):
    """One pool's part of the estimate, as saved in a controller checkpoint."""

    model_config = ConfigDict(extra="forbid")

    tokens: float = Field(ge=0, allow_inf_nan=False)
    """Forgotten sum of tokens generated on the pool."""
    rollouts: float = Field(gt=0, allow_inf_nan=False)
    """Forgotten count of rollouts finished on the pool (the configured mean counts as a fill)."""
    observed: bool
    """Whether the pool has reported a throughput measurement."""


class RolloutLengths:
    """Pools are addressed by position; not thread-safe (owned by the scheduler)."""

    def __init__(self, capacities: Sequence[int], prior: float, window: float) -> None:
        self._cap = list(capacities)
        self._prior = prior
        self._window = window
        self._tokens = [c * prior for c in self._cap]
        self._rollouts = [float(c) for c in self._cap]
        self._pending = [0] * len(self._cap)  # finished since the pool's last observation
        self._observed = [False] * len(self._cap)
        self.mean = prior

    def _update(self) -> None:
        self.mean = sum(self._tokens) / sum(self._rollouts)

    def finished(self, i: int, tokens: int | None) -> None:
        """A rollout on pool i finished (or failed) with `tokens` generated tokens, if known."""
        self._pending[i] += 1
        if not self._observed[i] and tokens is not None and tokens > 0:
            self._tokens[i] += tokens
            self._rollouts[i] += 1.0
            self._update()

    def generated(self, i: int, tokens: float) -> None:
        """Pool i generated `tokens` since its last observation."""
        if tokens <= 0:
            return
        if not self._observed[i]:  # the measured flow replaces the finished-rollout stand-in
            self._observed[i] = True
            self._tokens[i] = self._cap[i] * self._prior
            self._rollouts[i] = float(self._cap[i])
        keep = math.exp(-tokens / (self._window * self._cap[i] * self.mean))
        self._tokens[i] = keep * self._tokens[i] + tokens
        self._rollouts[i] = keep * self._rollouts[i] + self._pending[i]
        self._pending[i] = 0
        self._update()

    def state(self, i: int) -> PoolLengthState:
        return PoolLengthState(tokens=self._tokens[i], rollouts=self._rollouts[i], observed=self._observed[i])

    def load(self, i: int, st: PoolLengthState) -> None:
        """Restore pool i (call `refresh` after the last one)."""
        self._tokens[i], self._rollouts[i], self._observed[i] = st.tokens, st.rollouts, st.observed
        self._pending[i] = 0

    def refresh(self) -> None:
        self._update()
