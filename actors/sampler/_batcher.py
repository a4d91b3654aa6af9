"""Continuous batching on top of ``DecoderEngine``: requests, slots, sampling, records.

``ContinuousBatcher.step()`` is one scheduler tick:

1. admit waiting requests whose ``min_version`` the held weights satisfy, while
   KV slots are free (FIFO among the admissible ones), and prefill them in one
   batched forward, sampling each one's first token;
2. decode every request that was already running, one token each, in one
   batched forward;
3. retire requests that hit a stop token, ``max_new_tokens`` or a full context,
   freeing their slots for the next tick.

Sampling goes through ``policies.sample_with_support``.  A request with a
``seed`` owns a ``torch.Generator`` and is sampled on its own row, so its tokens
do not depend on what shares the batch; requests without a seed are sampled
together (grouped by sampling parameters) from the batcher's generator.

Every generated token records the version of the weights that computed its
logits, so a weight update between two ticks (``set_weights``) splits a
running sequence's versions exactly at that boundary.

Prefix cache (``prefix_cache=True``): a request with a ``session_id`` leaves its
slot *parked* when it finishes, keys and values intact.  The session's next
request takes that slot back, keeps the longest cached prefix its prompt shares
(at most all but the prompt's last token, whose logits are needed) and computes
only the rest (``Qwen3Engine.extend``), so a turn of a growing conversation costs
its new tokens.  Parked slots are capacity on loan: when a request needs a slot
and none is free, the least recently parked session is evicted.  A parked prefix
computed under older weights is reused as it is (``stale_prefix="reuse"``: its
tokens were generated and recorded under those versions, and only the context's
keys/values differ) or recomputed from scratch (``"recompute"``).

Synchronous and single-threaded by design: the actor drives it from one trio
task, and weight updates or aborts run between ticks.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from policies.sampling import sample_with_support

from ._engine import DecoderEngine, first_outside_vocab
from ._types import FinishReason, GenerateRequest, GenerateResult

__all__ = ["ContinuousBatcher"]


@dataclass
class _Sequence:
    req: GenerateRequest
    generator: torch.Generator | None
    submitted: float
    slot: int = -1
    started: float = 0.0
    tokens: list[int] = field(default_factory=list)
    # array('i'/'f') rather than lists or per-row tensors: extending is a memcpy and
    # the final tensors are built from the buffers without per-element conversion.
    ids: array = field(default_factory=lambda: array("i"))
    logq: array = field(default_factory=lambda: array("f"))
    counts: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stops: frozenset[int] = frozenset()
    reuse: int = 0
    """Cached prompt tokens this request started from (prefix cache hit), else 0."""


@dataclass
class _Parked:
    """A finished session's slot, kept for its next turn."""

    slot: int
    tokens: list[int]
    """The ids whose keys/values the slot holds (prompt + generated, less the last token)."""
    version: int
    """Weights version when the slot was parked (the newest that wrote into it)."""


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a session's next turn): one C-level comparison
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ContinuousBatcher:
    """Slots + queue + sampling around one engine.  See the module docstring.

    Args:
        engine: the forward/KV-cache engine (weights loaded or not yet).
        pool: pool name stamped on results.
        seed: seeds the shared generator used by requests without their own seed.
        prefix_cache: keep the KV cache of requests with a ``session_id`` between turns.
        stale_prefix: "reuse" a cached prefix computed under older weights, or
            "recompute" it.
    """

    def __init__(
        self,
        engine: DecoderEngine,
        *,
        pool: str,
        seed: int = 0,
        prefix_cache: bool = True,
        stale_prefix: Literal["reuse", "recompute"] = "reuse",
    ) -> None:
        if stale_prefix not in ("reuse", "recompute"):
            raise ValueError(f"stale_prefix must be 'reuse' or 'recompute', got {stale_prefix!r}")
        self.engine = engine
        self.prefix_cache = prefix_cache
        self.stale_prefix = stale_prefix
        self._parked: OrderedDict[str, _Parked] = OrderedDict()  # LRU first
        self.prefix_hits = 0
        """Requests that started from a cached prefix."""
        self.prefix_tokens_reused = 0
        """Prompt tokens not recomputed thanks to the prefix cache."""
        self.prefix_evictions = 0
        """Parked sessions evicted to make room."""
        self.pool = pool
        self.version = -1
        """Version of the weights loaded (-1: none yet; nothing is admitted until then)."""
        self._generator = torch.Generator(device=engine.device).manual_seed(seed)
        self._waiting: list[_Sequence] = []
        self._running: dict[int, _Sequence] = {}
        self._free = list(range(engine.max_slots - 1, -1, -1))  # pop() hands out the lowest slot
        self._ids: set[str] = set()
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.busy_seconds = 0.0
        self.requests_finished = 0
        self.prefill_batches = 0
        self.decode_steps = 0

    # ---------------------------------------------------------------- requests
    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests queued for a slot or for newer weights."""
        return len(self._waiting)

    @property
    def free_slots(self) -> int:
        """KV-cache slots not held by a running request (parked sessions can be evicted)."""
        return len(self._free) + len(self._parked)

    @property
    def parked(self) -> int:
        """Sessions whose KV cache is kept for their next turn."""
        return len(self._parked)

    def admissible(self) -> int:
        """Waiting requests the held weights could serve now (``min_version`` satisfied)."""
        return sum(1 for s in self._waiting if s.req.min_version <= self.version)

    def has_work(self) -> bool:
        """True when ``step()`` would do something (run a sequence or admit one)."""
        if self._running:
            return True
        return bool(self.free_slots) and any(s.req.min_version <= self.version for s in self._waiting)

    def drop_session(self, session_id: str) -> bool:
        """Forget a session's parked cache (its episode ended); False if none is parked."""
        parked = self._parked.pop(session_id, None)
        if parked is None:
            return False
        self._release(parked.slot)
        return True

    def _release(self, slot: int) -> None:
        self.engine.free(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)

    def _take_slot(self, seq: _Sequence) -> bool:
        """Give ``seq`` a slot: its session's parked one (setting ``seq.reuse``), a free one,
        or one evicted from the least recently parked session.  False when none is left."""
        sid = seq.req.session_id
        parked = self._parked.pop(sid, None) if sid is not None else None
        if parked is not None:
            seq.slot = parked.slot
            prompt = seq.req.prompt_ids
            keep = min(_common_prefix(parked.tokens, prompt), len(prompt) - 1)
            if self.stale_prefix == "recompute" and parked.version != self.version:
                keep = 0
            self.engine.truncate(parked.slot, keep)
            seq.reuse = keep
            return True
        if not self._free and self._parked:
            _, victim = self._parked.popitem(last=False)
            self._release(victim.slot)
            self.prefix_evictions += 1
        if not self._free:
            return False
        seq.slot = self._free.pop()
        return True

    def submit(self, req: GenerateRequest) -> None:
        """Queue a request.  Raises ValueError for a duplicate in-flight request_id, a
        prompt that leaves no room in a slot, or token ids outside the vocabulary."""
        if req.request_id in self._ids:
            raise ValueError(f"request_id {req.request_id!r} is already in flight on pool {self.pool!r}")
        vocab, max_len = self.engine.vocab_size, self.engine.max_len
        if len(req.prompt_ids) >= max_len:
            raise ValueError(
                f"prompt_ids has {len(req.prompt_ids)} tokens; the sampler's context is {max_len}, "
                "so at most max_len - 1 leave room for one generated token"
            )
        for name, ids in (("prompt_ids", req.prompt_ids), ("stop_token_ids", req.stop_token_ids)):
            if (i := first_outside_vocab(ids, vocab)) is not None:
                raise ValueError(f"{name}[{i}] = {ids[i]} is outside the vocabulary [0, {vocab})")
        gen = None
        if req.seed is not None:
            gen = torch.Generator(device=self.engine.device).manual_seed(req.seed)
        self._waiting.append(_Sequence(req, gen, time.perf_counter(), stops=frozenset(req.stop_token_ids)))
        self._ids.add(req.request_id)

    def abort(self, request_id: str) -> GenerateResult | None:
        """Remove a request wherever it is (queue or slot), freeing its slot.

        Returns its partial result with finish_reason "abort", or None when the
        request is not in flight (already finished or never submitted).
        """
        for i, seq in enumerate(self._waiting):
            if seq.req.request_id == request_id:
                del self._waiting[i]
                return self._finish(seq, "abort")
        for slot, seq in self._running.items():
            if seq.req.request_id == request_id:
                return self._retire(slot, "abort")
        return None

    def abort_all(self) -> list[GenerateResult]:
        """Abort every request and drop every parked cache (e.g. after an engine error left
        the cache suspect)."""
        ids = [s.req.request_id for s in self._waiting] + [s.req.request_id for s in self._running.values()]
        for sid in list(self._parked):
            self.drop_session(sid)
        return [r for r in (self.abort(i) for i in ids) if r is not None]

    # ----------------------------------------------------------------- weights
    def set_weights(
        self, snapshot: Mapping[str, torch.Tensor], version: int, changed: Collection[str] | None = None
    ) -> None:
        """Load (changed tensors of) a wire snapshot; later tokens carry ``version``.
        ``changed``: as ``DecoderEngine.load``'s ``names`` (names, or name -> element indices).

        Runs between ticks, so running sequences keep their KV cache and simply
        continue under the new weights (in-flight update)."""
        self.engine.load(snapshot, changed)
        self.version = version

    # -------------------------------------------------------------------- tick
    def step(self) -> list[GenerateResult]:
        """One scheduler tick (see the module docstring); returns finished results.

        Raises whatever the engine raises; the caller should then ``abort_all()``.
        """
        t0 = time.perf_counter()
        decoding = sorted(self._running)
        admitted: list[_Sequence] = []
        if self.free_slots and self._waiting:
            keep: list[_Sequence] = []
            for seq in self._waiting:
                if seq.req.min_version <= self.version and self._take_slot(seq):
                    seq.started = t0
                    admitted.append(seq)
                else:
                    keep.append(seq)
            self._waiting = keep
        # Every forward of the tick first, then one sampling pass over all their rows
        # (sampling costs per call, not per row).
        sampled: list[_Sequence] = []
        parts: list[torch.Tensor] = []
        if admitted:
            for seq in admitted:
                self._running[seq.slot] = seq
            fresh = [s for s in admitted if not s.reuse]
            cached = [s for s in admitted if s.reuse]
            if fresh:
                parts.append(self.engine.prefill([s.slot for s in fresh], [s.req.prompt_ids for s in fresh]))
                sampled += fresh
                self.prefill_batches += 1
                self.prompt_tokens += sum(len(s.req.prompt_ids) for s in fresh)
            if cached:
                parts.append(
                    self.engine.extend([s.slot for s in cached], [s.req.prompt_ids[s.reuse :] for s in cached])
                )
                sampled += cached
                self.prefill_batches += 1
                self.prompt_tokens += sum(len(s.req.prompt_ids) - s.reuse for s in cached)
                self.prefix_hits += len(cached)
                self.prefix_tokens_reused += sum(s.reuse for s in cached)
        if decoding:
            seqs = [self._running[s] for s in decoding]
            parts.append(self.engine.decode(decoding, [s.tokens[-1] for s in seqs]))
            sampled += seqs
            self.decode_steps += 1
        if parts:
            self._sample(sampled, parts[0] if len(parts) == 1 else torch.cat(parts))
        finished: list[GenerateResult] = []
        for slot in decoding + [s.slot for s in admitted]:
            seq = self._running[slot]
            reason = self._finish_reason(seq)
            if reason is not None:
                finished.append(self._retire(slot, reason))
        self.busy_seconds += time.perf_counter() - t0
        return finished

    def _sample(self, seqs: list[_Sequence], logits: torch.Tensor) -> None:
        groups: dict[tuple[float, int, float, int], list[int]] = {}
        for row, seq in enumerate(seqs):
            r = seq.req
            if seq.generator is not None:
                tokens, support = sample_with_support(
                    logits[row : row + 1],
                    temperature=r.temperature,
                    top_k=r.top_k,
                    top_p=r.top_p,
                    min_keep=r.min_keep,
                    generator=seq.generator,
                )
                self._append(seq, int(tokens[0]), array("i", support.ids.tolist()), array("f", support.logq.tolist()))
            else:
                groups.setdefault((r.temperature, r.top_k, r.top_p, r.min_keep), []).append(row)
        for (temperature, top_k, top_p, min_keep), rows in groups.items():
            sub = logits if len(rows) == len(seqs) else logits[rows]
            tokens, support = sample_with_support(
                sub, temperature=temperature, top_k=top_k, top_p=top_p, min_keep=min_keep, generator=self._generator
            )
            # One host transfer per tick; slicing arrays row by row is far cheaper
            # than slicing tensors.
            offsets = support.offsets.tolist()
            ids, logq = array("i", support.ids.tolist()), array("f", support.logq.tolist())
            for i, (row, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
                a, b = offsets[i], offsets[i + 1]
                self._append(seqs[row], token, ids[a:b], logq[a:b])

    def _append(self, seq: _Sequence, token: int, ids: array, logq: array) -> None:
        seq.tokens.append(token)
        seq.ids.extend(ids)
        seq.logq.extend(logq)
        seq.counts.append(len(ids))
        seq.versions.append(self.version)
        self.tokens_generated += 1

    def _finish_reason(self, seq: _Sequence) -> FinishReason | None:
        if seq.tokens[-1] in seq.stops:
            return "stop"
        if len(seq.tokens) >= seq.req.max_new_tokens:
            return "length"
        # The last sampled token still has to be fed; a full slot cannot take it.
        if len(seq.req.prompt_ids) + len(seq.tokens) >= self.engine.max_len:
            return "length"
        return None

    def _retire(self, slot: int, reason: FinishReason) -> GenerateResult:
        seq = self._running.pop(slot)
        sid = seq.req.session_id
        if self.prefix_cache and sid is not None and reason != "abort" and seq.tokens:
            # The last sampled token was never fed, so the slot holds everything before it.
            held = list(seq.req.prompt_ids) + seq.tokens[:-1]
            assert int(self.engine.lengths[slot]) == len(held), "slot length and token record disagree"
            old = self._parked.pop(sid, None)
            if old is not None:  # two requests of one session overlapped; keep the newer cache
                self._release(old.slot)
            self._parked[sid] = _Parked(slot, held, self.version)
        else:
            self._release(slot)
        return self._finish(seq, reason)

    def _finish(self, seq: _Sequence, reason: FinishReason) -> GenerateResult:
        self._ids.discard(seq.req.request_id)
        self.requests_finished += 1
        n = len(seq.tokens)
        offsets = [0]
        for c in seq.counts:
            offsets.append(offsets[-1] + c)
        return GenerateResult(
            request_id=seq.req.request_id,
            token_ids=list(seq.tokens),
            support_ids=torch.frombuffer(seq.ids, dtype=torch.int32).clone()
            if n
            else torch.zeros(0, dtype=torch.int32),
            support_offsets=torch.tensor(offsets, dtype=torch.int32),
            # float32 -> Python float -> float32 round-trips exactly.
            support_logq=torch.frombuffer(seq.logq, dtype=torch.float32).clone() if n else torch.zeros(0),
            versions=list(seq.versions),
            finish_reason=reason,
            pool=self.pool,
            prompt_tokens=len(seq.req.prompt_ids),
            seconds=(time.perf_counter() - seq.started) if seq.started else 0.0,
        )
