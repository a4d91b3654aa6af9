"""Messages of the sampler link: what a caller asks for and what it gets back.

Token in, tokens out: a request carries token ids (never text to re-tokenise)
and the result carries, per generated token, its id, its sampling support
(CSR rows, exactly as ``policies.sample_with_support`` recorded them) and the
policy version of the weights that produced it.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.support import SupportRecord

__all__ = ["FinishReason", "GenerateRequest", "GenerateResult", "SamplerStats"]

FinishReason = Literal["stop", "length", "abort"]


class GenerateRequest(BaseModel):
    """One generation: a prompt as token ids and how to sample its continuation."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1)
    """Caller-chosen id, unique among the sampler's in-flight requests."""
    prompt_ids: list[int] = Field(min_length=1)
    """The full context as token ids (prompt plus every earlier turn)."""
    max_new_tokens: int = Field(ge=1)
    """Generation stops after this many tokens (finish_reason "length"); also when the
    sampler's context (its ``max_len``) is full."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Generation stops after producing any of these (the stop token is returned, with its
    support, because the trainer scores it like any other generated token)."""
    temperature: float = Field(1.0, ge=0.0)
    """Softmax temperature; 0 is greedy (support {y}, log q = 0)."""
    top_k: int = Field(64, ge=0)
    """Candidate cap before top-p (0 = no cap)."""
    top_p: float = Field(0.97, gt=0.0, le=1.0)
    """Nucleus mass kept after top-k."""
    min_keep: int = Field(1, ge=1)
    """Top-p keeps at least this many ids; 1 (the wire default) is the plain nucleus. Runs
    send the recipe's ``min_keep`` (default 2): a one-token support would be sampled
    deterministically and get no gradient. The SGLang backend refuses values > 1 with
    top_p < 1."""
    seed: int | None = None
    """Seeds a generator owned by this request, so its tokens do not depend on what else
    shares the batch. None: draws from the sampler's own generator (batched, faster)."""
    min_version: int = Field(0, ge=0)
    """The sampler does not admit the request before it holds weights of at least this
    version (how a lagging sampler stops taking work until it has caught up)."""
    session_id: str | None = None
    """A conversation's id: the sampler keeps the KV cache of the session's last request
    and the next one with the same id computes only the tokens past the shared prefix
    (when the sampler's prefix cache is on). Send the session's requests to one sampler."""


class GenerateResult(BaseModel):
    """What one request produced.  Support tensors are CSR: row t is token t's support."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    request_id: str
    """The request's id."""
    token_ids: list[int]
    """Generated tokens only (the prompt is not repeated)."""
    support_ids: torch.Tensor
    """int32 [nnz]: kept token ids, one row per generated token, each row in rank order."""
    support_offsets: torch.Tensor
    """int32 [n+1]: row t is support_ids[support_offsets[t]:support_offsets[t+1]]."""
    support_logq: torch.Tensor
    """float32 [nnz]: sampler log q over each row's support (renormalised)."""
    versions: list[int]
    """Policy version of the weights that produced each generated token."""
    finish_reason: FinishReason
    """"stop" (a stop token), "length" (max_new_tokens or context full) or "abort"."""
    pool: str
    """The sampler pool that generated the tokens."""
    prompt_tokens: int
    """Length of the prompt that was prefilled."""
    seconds: float
    """Wall time from admission to the last token."""

    @model_validator(mode="after")
    def _check_layout(self) -> GenerateResult:
        n = len(self.token_ids)
        for name, t, dtype in (
            ("support_ids", self.support_ids, torch.int32),
            ("support_offsets", self.support_offsets, torch.int32),
            ("support_logq", self.support_logq, torch.float32),
        ):
            if t.dim() != 1 or t.dtype != dtype:
                raise ValueError(f"GenerateResult.{name} must be 1-D {dtype}, got {t.dtype} {tuple(t.shape)}")
        if self.support_offsets.numel() != n + 1:
            raise ValueError(
                f"GenerateResult.support_offsets has {self.support_offsets.numel()} entries, expected {n + 1}"
            )
        if len(self.versions) != n:
            raise ValueError(f"GenerateResult.versions has {len(self.versions)} entries, expected {n}")
        if self.support_ids.numel() != self.support_logq.numel():
            raise ValueError("GenerateResult.support_ids and support_logq differ in length")
        return self

    def support(self) -> SupportRecord:
        """The support rows as a ``policies.SupportRecord``."""
        return SupportRecord(self.support_ids, self.support_offsets, self.support_logq)


class SamplerStats(BaseModel):
    """Counters the cost model reads (busy GPU-seconds x price, measured tokens/s)."""

    model_config = ConfigDict(extra="forbid")

    pool: str
    """Pool name."""
    precision: str
    """Weight precision held ("bf16" or "fp8")."""
    backend: str
    """Generation backend ("torch" or "sglang")."""
    version: int
    """Policy version of the weights held."""
    tokens_generated: int
    """Generated tokens over the actor's life (prompt tokens not counted)."""
    prompt_tokens: int
    """Prefilled prompt tokens over the actor's life."""
    requests_finished: int
    """Requests that returned a result (any finish reason)."""
    busy_seconds: float
    """Time spent in forward passes and sampling (the device is busy)."""
    prefill_batches: int = 0
    """Batched prefill forwards run (requests admitted / this = mean prefill batch)."""
    decode_steps: int = 0
    """Batched decode forwards run."""
    prefix_hits: int = 0
    """Requests that started from their session's cached prefix (torch backend)."""
    prefix_tokens_reused: int = 0
    """Prompt tokens those requests did not recompute."""
    parked_sessions: int = 0
    """Sessions whose KV cache is kept for their next turn now."""
    tokens_per_second: float
    """tokens_generated / busy_seconds (0 before the first token)."""
    running: int
    """Requests holding a KV-cache slot now."""
    waiting: int
    """Requests queued for a slot or for newer weights (min_version)."""
    weight_updates: int
    """Weight messages applied."""
    staleness_budget: int | None = None
    """The pool's staleness budget (versions), as configured; None if not given."""
