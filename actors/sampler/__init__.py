"""The sampler: token-in/tokens-out generation with support records and in-flight weight updates.

``SamplerActor`` is one sampler process of a pool (endpoints ``generate``,
``apply_weights``, ``version``, ``have_version``, ``abort``, ``stats``).
``GenerateRequest``/``GenerateResult`` are the link's messages.  ``DecoderEngine`` is
the lean dense-decoder forward (Qwen3, Qwen2, Llama 3, Mistral) with a slot KV cache; ``ContinuousBatcher`` schedules
requests onto its slots and samples through ``policies.sample_with_support``;
``TorchBackend`` drives it from a trio task behind the ``GenerationBackend``
interface that an SGLang server also fits (``SGLangBackend``: an HTTP client for
a CUDA-only server, untested here -- see its module docstring).
"""

from ._actor import SamplerActor, as_weight_messages
from ._backend import GenerationBackend, TorchBackend
from ._batcher import ContinuousBatcher
from ._engine import DecoderEngine, Qwen3Engine
from ._sglang import SGLangBackend, parse_sglang_response
from ._types import FinishReason, GenerateRequest, GenerateResult, SamplerStats
from ._weights import wire_to_compute

__all__ = [
    "ContinuousBatcher",
    "DecoderEngine",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "GenerationBackend",
    "Qwen3Engine",
    "SGLangBackend",
    "SamplerActor",
    "SamplerStats",
    "TorchBackend",
    "as_weight_messages",
    "parse_sglang_response",
    "wire_to_compute",
]
