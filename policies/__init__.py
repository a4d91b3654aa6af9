"""The RL recipe: pure functions on tensors (DESIGN §3).

Sampling with a support record (sampler side), mask replay of the recorded supports
(trainer side), masked importance sampling, the score-centred token loss, GRPO
advantages, global token-mean aggregation and per-pool metrics.
"""

from .sampling import sample_with_support
from .support import SupportRecord

__all__ = [
    "SupportRecord",
    "sample_with_support",
]
