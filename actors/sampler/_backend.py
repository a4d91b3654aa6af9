"""Generation backends: the interface the sampler actor drives, and the torch one.

A backend owns the model on its device, batches requests itself, and exposes:

* ``run()`` -- its long-lived task (the decode loop, or an HTTP session), started
  once in the actor's nursery;
* ``generate(req)`` -- one request in, one ``GenerateResult`` out, with every
  generated token's support row (ids + log q) and policy version;
* ``update_weights(snapshot, version, changed)`` -- the new wire snapshot (bf16,
  or float8_e4m3fn + ``<name>_scale_inv`` 128x128 block scales) after the
  weight sync applied a message; ``changed`` names the tensors that differ (or maps
  each to the flat element indices that differ, ``DecoderEngine.load``; None: all);
* ``abort(request_id)``, ``version``, ``counters()``.

The shape follows what SGLang offers, so an SGLang server fits behind it:
``POST /generate`` with ``input_ids``, ``sampling_params``, ``return_logprob`` and
``return_sampling_mask`` gives the kept set and its renormalised log-probs per
token; ``update_weights_from_tensor`` takes named tensors in the checkpoint's own
format (block-FP8 checkpoints name scales ``<name>_scale_inv`` as we do).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import trio

from ._batcher import ContinuousBatcher
from ._engine import DecoderEngine
from ._types import GenerateRequest, GenerateResult

__all__ = ["GenerationBackend", "TorchBackend"]


@runtime_checkable
class GenerationBackend(Protocol):
    """What ``SamplerActor`` needs from a generation engine."""

    name: str
    """"torch" or "sglang"."""

    @property
    def version(self) -> int:
        """Policy version of the weights in use (-1 before any)."""
        ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The backend's long-lived task; reports started once requests can be served."""
        ...

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        """Serve one request (waits for admission, see ``GenerateRequest.min_version``)."""
        ...

    async def update_weights(
        self, snapshot: Mapping[str, torch.Tensor], version: int, changed: Collection[str] | None = None
    ) -> None:
        """Switch to the snapshot's weights between two decode steps."""
        ...

    def abort(self, request_id: str) -> bool:
        """End a request early; its ``generate`` returns finish_reason "abort"."""
        ...

    def end_session(self, session_id: str) -> bool:
        """Forget a session's cached prefix (see ``GenerateRequest.session_id``)."""
        ...

    def counters(self) -> dict[str, Any]:
        """tokens_generated, prompt_tokens, requests_finished, busy_seconds, prefill_batches,
        decode_steps, running, waiting."""
        ...


@dataclass
class _Waiter:
    session_id: str | None = None
    done: trio.Event = field(default_factory=trio.Event)
    result: GenerateResult | None = None
    error: BaseException | None = None


class TorchBackend:
    """The torch engine with continuous batching, driven by one trio task.

    Each loop turn runs one ``ContinuousBatcher.step()`` (admit + prefill, one
    batched decode step, retire) synchronously, then yields to trio.  Endpoints
    therefore run *between* decode steps: a weight update lands exactly on a
    step boundary and tokens after it carry the new version; an aborted or
    cancelled request leaves its slot before the next step.

    Admission batching: when nothing is decoding, a tick that would prefill
    waits until no request has arrived for ``batch_window_s`` (at most
    ``4 * batch_window_s`` after it first could run, and never once the free
    slots are spoken for), so that requests arriving one by one (from many
    environment episodes) share one prefill instead of paying for one forward
    each. While sequences are decoding there is no wait: new requests join at
    the next tick. The window also closes as soon as every session (``session_id``)
    answered since the last admission batch has its next request waiting: those are
    the arrivals the wait was for (a multi-turn agent's next turns), so waiting
    longer would only delay them. A session that does not come back costs at most
    this one window (it is not expected again), and traffic without sessions keeps
    the quiet-gap rule alone.

    Args:
        model_config: model config dict or checkpoint directory (``actors.models``).
        pool: pool name stamped on results.
        max_batch: KV-cache slots (sequences decoding at once).
        max_len: tokens per slot (default: the model's max_position_embeddings).
        device: "cpu" or "cuda[:i]".
        seed: seeds the generator of requests that carry no seed.
        batch_window_s: the quiet gap that closes an admission batch (0: no wait).
        prefix_cache / stale_prefix: the session prefix cache (``ContinuousBatcher``).
        emulate_quant: a coarse weight format to emulate (``actors.sampler._emulate``), or None.
    """

    name = "torch"

    def __init__(
        self,
        model_config: dict[str, Any] | str,
        *,
        pool: str,
        max_batch: int,
        max_len: int | None = None,
        device: str = "cpu",
        seed: int = 0,
        batch_window_s: float = 0.005,
        prefix_cache: bool = True,
        stale_prefix: str = "reuse",
        emulate_quant: str | None = None,
    ) -> None:
        if batch_window_s < 0:
            raise ValueError(f"batch_window_s must be >= 0, got {batch_window_s}")
        engine = DecoderEngine(model_config, max_slots=max_batch, max_len=max_len, device=device, emulate=emulate_quant)
        self._batcher = ContinuousBatcher(
            engine, pool=pool, seed=seed, prefix_cache=prefix_cache, stale_prefix=stale_prefix
        )  # type: ignore[arg-type]
        self._waiters: dict[str, _Waiter] = {}
        self._wake = trio.Event()
        self._window = batch_window_s
        self._last_submit = 0.0
        self._returning: set[str] = set()
        """Sessions answered since the last admission window whose next request has not come."""
        self._answered = False
        """Whether any session was answered since the last admission window."""

    @property
    def version(self) -> int:
        """Policy version of the weights in use (-1 before the first update)."""
        return self._batcher.version

    @property
    def engine(self) -> DecoderEngine:
        """The underlying engine (tests score sequences with it)."""
        return self._batcher.engine

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Decode loop; runs until cancelled.

        Cancellation: stops between steps; requests still in flight are not
        answered here (their ``generate`` callers are cancelled with the actor).
        Errors: an exception from the engine fails every in-flight request with
        ``RuntimeError`` (their KV state is suspect) and the loop keeps serving.
        """
        task_status.started()
        while True:
            while not self._batcher.has_work():
                self._wake = trio.Event()
                await self._wake.wait()
            if self._window and not self._batcher.running:
                await self._gather()
            try:
                finished = self._batcher.step()
            except Exception as exc:
                for res in self._batcher.abort_all():
                    self._settle(res.request_id, error=exc)
                finished = []
            for res in finished:
                self._settle(res.request_id, result=res)
            # The one place the loop yields: endpoints (weights, new requests, cancels)
            # run here, between two decode steps.
            await trio.lowlevel.checkpoint()

    async def _gather(self) -> None:
        """Let requests that are still arriving join the next prefill (see the class docstring)."""
        b = self._batcher
        latest = trio.current_time() + 4 * self._window
        try:
            while b.admissible() < b.free_slots:
                if self._answered and not self._returning:
                    return  # every session answered since the last window is back
                deadline = min(self._last_submit + self._window, latest)
                if trio.current_time() >= deadline:
                    return
                self._wake = trio.Event()  # set by the next generate(): re-check at once
                with trio.move_on_at(deadline):
                    await self._wake.wait()
        finally:
            self._returning.clear()
            self._answered = False

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        """Queue ``req`` and wait for its result.

        Raises ValueError for a bad request (duplicate id, prompt too long, ids
        outside the vocabulary) and RuntimeError when the engine failed during
        the request.  Cancellation: the request leaves its slot (or the queue)
        before the next decode step; nothing is returned.
        """
        self._batcher.submit(req)
        self._last_submit = trio.current_time()
        if req.session_id is not None:
            self._returning.discard(req.session_id)
        waiter = self._waiters[req.request_id] = _Waiter(req.session_id)
        self._wake.set()
        try:
            await waiter.done.wait()
        finally:
            if not waiter.done.is_set():
                self._batcher.abort(req.request_id)
            self._waiters.pop(req.request_id, None)
        if waiter.error is not None:
            raise RuntimeError(f"generation of {req.request_id!r} failed: {waiter.error!r}") from waiter.error
        assert waiter.result is not None
        return waiter.result

    def _settle(
        self, request_id: str, *, result: GenerateResult | None = None, error: BaseException | None = None
    ) -> None:
        waiter = self._waiters.get(request_id)
        if waiter is not None:
            waiter.result, waiter.error = result, error
            waiter.done.set()
            if waiter.session_id is not None and result is not None and self._window:
                self._returning.add(waiter.session_id)
                self._answered = True

    async def update_weights(
        self, snapshot: Mapping[str, torch.Tensor], version: int, changed: Collection[str] | None = None
    ) -> None:
        """Load the changed tensors now (the loop is parked between steps while this runs).

        Raises KeyError/ValueError naming a missing or malformed tensor; the
        caller should then reload a full snapshot (``changed=None``).
        """
        self._batcher.set_weights(snapshot, version, changed)
        self._wake.set()  # requests waiting for min_version may be admissible now

    def abort(self, request_id: str) -> bool:
        """End a request now; its ``generate`` returns the partial result with finish_reason "abort"."""
        res = self._batcher.abort(request_id)
        if res is None:
            return False
        self._settle(request_id, result=res)
        return True

    def end_session(self, session_id: str) -> bool:
        """Free a session's parked KV-cache slot now (it would otherwise wait for eviction)."""
        return self._batcher.drop_session(session_id)

    def counters(self) -> dict[str, Any]:
        """Cumulative counters for ``SamplerStats``."""
        b = self._batcher
        return {
            "tokens_generated": b.tokens_generated,
            "prompt_tokens": b.prompt_tokens,
            "requests_finished": b.requests_finished,
            "busy_seconds": b.busy_seconds,
            "prefill_batches": b.prefill_batches,
            "decode_steps": b.decode_steps,
            "running": b.running,
            "waiting": b.waiting,
            "prefix_hits": b.prefix_hits,
            "prefix_tokens_reused": b.prefix_tokens_reused,
            "parked_sessions": b.parked,
        }
