"""``SamplerActor``: one sampler process of a pool, behind the actor runtime.

It holds the pool's wire snapshot (bf16, fp8 blocks, or fp32) in a
``WeightReceiver``, feeds a generation backend (the torch engine by default),
and serves ``generate`` / ``apply_weights`` / ``version`` / ``stats`` /
``abort``.  The decode loop is a long-lived task in the actor's nursery;
``generate`` calls park until their request finishes.

Weight messages travel in weightsync's own pickle-free forms: the bytes of
``WeightMessage.to_bytes()``, the frame list of ``to_frames()``, or (in
process) a ``WeightMessage``.  Applying a message runs in a worker thread
while decoding continues on the old compute weights; the backend then
switches between two decode steps, so tokens after the switch carry the new
version (an in-flight update), and running sequences keep their KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, get_args

import trio

from orchestrator.runtime import Actor, current_rank, endpoint, span
from orchestrator.weightsync import Precision, WeightMessage, WeightReceiver, wire_snapshot

from ._backend import GenerationBackend, TorchBackend
from ._placement import rank_device, sglang_backend
from ._types import GenerateRequest, GenerateResult, SamplerStats

__all__ = ["SamplerActor", "as_weight_messages"]

_PRECISIONS = get_args(Precision)


def as_weight_messages(update: Any) -> list[WeightMessage]:
    """Normalise an ``apply_weights`` argument to a list of ``WeightMessage``.

    Accepts a ``WeightMessage``, its ``to_bytes()`` form (bytes-like), its
    ``to_frames()`` form (a list of bytes-like frames), or a list of any of
    these.  Raises TypeError naming the position of anything else and
    weightsync's ``MalformedMessageError`` for bytes that do not parse.
    """
    if isinstance(update, WeightMessage):
        return [update]
    if isinstance(update, (bytes, bytearray, memoryview)):
        return [WeightMessage.from_bytes(update)]
    if isinstance(update, (list, tuple)):
        if update and all(isinstance(f, (bytes, bytearray, memoryview)) for f in update) and _is_frames(update):
            return [WeightMessage.from_frames(list(update))]
        out: list[WeightMessage] = []
        for i, item in enumerate(update):
            if isinstance(item, (list, tuple)):
                out.append(WeightMessage.from_frames(list(item)))
            elif isinstance(item, (WeightMessage, bytes, bytearray, memoryview)):
                out.extend(as_weight_messages(item))
            else:
                raise TypeError(
                    f"weight update [{i}] is a {type(item).__name__}; expected a WeightMessage, "
                    "its to_bytes() bytes or its to_frames() list"
                )
        return out
    raise TypeError(
        f"weight update is a {type(update).__name__}; expected a WeightMessage, "
        "its to_bytes() bytes, its to_frames() list, or a list of these"
    )


def _is_frames(items: Sequence[Any]) -> bool:
    # A to_frames() list starts with the JSON metadata; a to_bytes() blob is safetensors,
    # whose first 8 bytes are a little-endian header length, never '{'.
    first = bytes(items[0][:1])
    return first == b"{"


class SamplerActor(Actor):
    """A sampler of one pool.  See the module docstring.

    Args:
        pool: pool name (stamped on every result).
        precision: wire precision of the weights held: "bf16", "fp8" (e4m3 with
            128x128 block scales, dequantised for compute) or "fp32".
        model_config: model config dict or checkpoint directory (``actors.models``);
            None: the default tiny Qwen3.
        device: "cpu" or "cuda[:i]".
        initial_weights: a keyframe (any form ``as_weight_messages`` takes); None
            builds the seeded random init of ``init_seed`` as version 0.
        init_seed: seed of that init; None (with no initial_weights) starts with no
            weights (version -1): nothing is admitted until a keyframe arrives.
        max_batch: KV-cache slots (sequences decoding together).
        max_len: tokens per slot (default: the model's max_position_embeddings).
        staleness_budget: the pool's budget, reported in stats (the controller
            enforces it through ``GenerateRequest.min_version``).
        seed: seeds sampling for requests that carry no seed.
        batch_window_s: torch backend: how long an idle sampler waits for more
            requests before a prefill (see ``TorchBackend``); 0: no wait.
        prefix_cache: torch backend: keep a session's KV cache between its requests
            (``GenerateRequest.session_id``), so a turn costs only its new tokens.
        stale_prefix: "reuse" a session's cached prefix after a weight update (its keys
            and values stay those of the older weights; recorded versions are unchanged)
            or "recompute" it under the new weights.
        backend: "torch", or "sglang" (needs a CUDA GPU; never run against a real
            server here, see ``actors.sampler._sglang``).
        sglang: backend "sglang": ``{"urls": [...]}`` (one running server per rank) or
            ``{"launch": SGLangLaunch dict}`` (this rank starts its own), plus optional
            ``weights_dir`` and ``pause_mode``.
        gpus: device "cuda": the CUDA index of each rank (rank r uses ``gpus[r]``); None:
            rank r uses device r modulo the visible GPUs. Ignored for "cpu" and "cuda:i".
        weights_key: hex key shared with the trainer's publisher: weight messages must be
            sealed with it (``weightsync.WeightReceiver(auth_key=...)``); None: unkeyed digests.
        emulate_quant: torch backend: a coarse weight format the engine rounds every linear
            weight through (``actors.sampler._emulate``), or None.
    """

    def __init__(
        self,
        pool: str,
        precision: str = "bf16",
        model_config: dict[str, Any] | str | None = None,
        device: str = "cpu",
        *,
        initial_weights: Any = None,
        init_seed: int | None = 0,
        max_batch: int = 32,
        max_len: int | None = None,
        staleness_budget: int | None = None,
        seed: int = 0,
        batch_window_s: float = 0.005,
        prefix_cache: bool = True,
        stale_prefix: str = "reuse",
        backend: str = "torch",
        sglang: dict[str, Any] | None = None,
        gpus: list[int] | None = None,
        weights_key: str | None = None,
        emulate_quant: str | None = None,
    ) -> None:
        from actors.models import build_model, default_model_config, model_weights

        if precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.pool = pool
        self.precision = precision
        self.staleness_budget = staleness_budget
        config = model_config if model_config is not None else default_model_config()
        rank = current_rank()
        self._backend: GenerationBackend
        if backend == "torch":
            device = rank_device(device, rank, gpus)
            self._backend = TorchBackend(
                config,
                pool=pool,
                max_batch=max_batch,
                max_len=max_len,
                device=device,
                seed=seed,
                batch_window_s=batch_window_s,
                prefix_cache=prefix_cache,
                stale_prefix=stale_prefix,
                emulate_quant=emulate_quant,
            )
        elif backend == "sglang":
            if emulate_quant is not None:
                raise ValueError("emulate_quant is a torch-backend setting (the sglang backend computes its own way)")
            self._backend = sglang_backend(pool, config, rank, gpus, sglang or {})
        else:
            raise ValueError(f"backend must be 'torch' or 'sglang', got {backend!r}")
        self.device = device

        self._key = bytes.fromhex(weights_key) if weights_key else None
        self._receiver = WeightReceiver(precision, auth_key=self._key)  # type: ignore[arg-type]
        self._hashes: dict[str, str] = {}
        if initial_weights is not None:
            for msg in as_weight_messages(initial_weights):
                self._receiver.apply(msg)
                self._hashes = {t.name: t.hash for t in msg.meta.tensors}
        elif init_seed is not None:
            master = model_weights(build_model(config, seed=init_seed))
            self._receiver = WeightReceiver(
                precision,
                wire_snapshot(master, precision),
                0,  # type: ignore[arg-type]
                auth_key=self._key,
            )
        self._lock = trio.Lock()
        self._updates = 0

    async def on_start(self, nursery: trio.Nursery) -> None:
        """Start the backend's loop and load the initial weights into it."""
        await nursery.start(self._backend.run)
        if self._receiver.snapshot is not None and self._receiver.version is not None:
            await self._backend.update_weights(self._receiver.snapshot, self._receiver.version)

    @endpoint
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        """Generate for one request; waits for admission (free slot, ``min_version``).

        Errors: ValueError for a bad request (duplicate id, prompt too long, ids
        outside the vocabulary), RuntimeError when the engine failed mid-request.
        Cancellation (the caller's scope or timeout): the request leaves its slot
        before the next decode step and nothing is returned.
        """
        with span(
            "sampler.generate",
            pool=self.pool,
            precision=self.precision,
            request_id=req.request_id,
            prompt_tokens=len(req.prompt_ids),
            min_version=req.min_version,
        ) as s:
            res = await self._backend.generate(req)
            s.set_attribute("tokens", len(res.token_ids))
            s.set_attribute("finish_reason", res.finish_reason)
            if res.versions:
                s.set_attribute("version_min", min(res.versions))
                s.set_attribute("version_max", max(res.versions))
            return res

    @endpoint
    async def apply_weights(self, update: Any) -> int:
        """Apply weight messages in order; returns the version now in use.

        Errors: weightsync's ``DeltaError`` subclasses (version gap, hash
        mismatch, corrupt payload, wrong precision) -- the held weights then stay
        at the last good version and the next update should be a keyframe path
        (``WeightReceiver.have_version`` is None).  Cancellation does not
        interrupt an apply in progress: it finishes (shielded) so the receiver
        and the engine never disagree, then the cancellation is delivered.
        """
        messages = as_weight_messages(update)
        async with self._lock:
            with (
                trio.CancelScope(shield=True),
                span(
                    "weights.apply",
                    pool=self.pool,
                    precision=self.precision,
                    messages=len(messages),
                    from_version=self._backend.version,
                    wire_bytes=sum(m.nbytes for m in messages),
                ) as s,
            ):
                for msg in messages:
                    before, held = self._receiver.snapshot, self._receiver.version
                    version = await trio.to_thread.run_sync(self._receiver.apply, msg)
                    snapshot = self._receiver.snapshot
                    if version == held and snapshot is before:
                        continue  # staged: a keyframe path still below the held version
                    assert snapshot is not None and version is not None
                    # a new snapshot object (a keyframe) is loaded whole
                    await self._load(snapshot, version, msg.meta, diff=snapshot is before)
                s.set_attribute("to_version", self._backend.version)
        return self._backend.version

    async def _load(self, snapshot: Any, version: int, meta: Any, *, diff: bool) -> None:
        """Hand the receiver's snapshot at ``version`` to the backend. With ``diff``, and the
        same tensors as the weights in use, only those whose hash changed are named as
        changed; otherwise the backend loads everything. When the message was a delta
        applied to the weights in use (the backend held its base version), each changed
        name maps to the element indices the receiver reports it changed
        (``WeightReceiver.last_changed``), so the backend can update just those."""
        new_hashes = {t.name: t.hash for t in meta.tensors}
        changed: Any = None
        if diff and new_hashes.keys() == self._hashes.keys():
            changed = [n for n, h in new_hashes.items() if self._hashes[n] != h]
            elements = self._receiver.last_changed
            if elements is not None and meta.base_version == self._backend.version:
                changed = {n: elements.get(n) for n in changed}
        self._hashes = {}  # until the backend holds these weights: next load is a full one
        await self._backend.update_weights(snapshot, version, changed)
        self._hashes = new_hashes
        self._updates += 1

    @endpoint
    async def apply_weights_part(self, header: dict[str, Any], frames: list[Any]) -> int:
        """One part of a streamed keyframe (``weightsync.message_part``), decoded into the
        receiver's own snapshot (``WeightReceiver.apply_part``: no second copy); returns the
        version now in use. After the last part the engine switches to the keyframe, unless
        it is below the version in use (then it is staged until deltas bring it there).

        Errors: weightsync's ``DeltaError`` subclasses (a corrupt or misordered part, a
        hash mismatch, a bad seal, a stale keyframe): the stream ends, the engine keeps
        generating with the weights it has, and the next update must be a keyframe.
        Cancellation does not interrupt a part in progress (shielded, as ``apply_weights``).
        """
        async with self._lock:
            with (
                trio.CancelScope(shield=True),
                span(
                    "weights.part",
                    pool=self.pool,
                    precision=self.precision,
                    seq=header.get("seq"),
                    parts=header.get("parts"),
                    wire_bytes=sum(memoryview(f).nbytes for f in frames),
                ) as s,
            ):
                meta = await trio.to_thread.run_sync(self._receiver.apply_part, header, frames)
                snapshot, version = self._receiver.snapshot, self._receiver.version
                if meta is not None and snapshot is not None and version == meta.version:
                    # The hashes name the bytes the engine holds, so they tell what changed
                    # even though the snapshot's memory was rewritten whole.
                    await self._load(snapshot, version, meta, diff=True)
                s.set_attribute("to_version", self._backend.version)
        return self._backend.version

    @endpoint
    def end_session(self, session_id: str) -> bool:
        """Free a session's cached prefix (its episode is over); False if none is held."""
        return self._backend.end_session(session_id)

    @endpoint
    def device_names(self) -> list[str]:
        """Names of the CUDA devices this rank computes on (empty on CPU and for SGLang,
        whose server owns the GPU); the controller checks them against the pool's label."""
        if self._backend.name != "torch" or not self.device.startswith("cuda"):
            return []
        import torch

        return [torch.cuda.get_device_name(torch.device(self.device))]

    @endpoint
    async def reset_weights(self) -> None:
        """Forget the held weights' version, so that the next keyframe is accepted whatever
        its version: the trainer went back to a checkpoint, and the versions after it no
        longer exist. The weights stay in use until that keyframe arrives (the controller
        starts no rollout on them meanwhile). Waits for an apply in progress."""
        async with self._lock:
            self._receiver = WeightReceiver(self.precision, auth_key=self._key)  # type: ignore[arg-type]
            self._hashes = {}

    @endpoint
    def version(self) -> int:
        """Policy version of the weights in use (-1 before any)."""
        return self._backend.version

    @endpoint
    def have_version(self) -> int | None:
        """What to tell the publisher's ``updates_for``: the held version, or None when
        the last apply failed and a keyframe is needed."""
        return self._receiver.have_version

    @endpoint
    def abort(self, request_id: str) -> bool:
        """End a request early; its ``generate`` returns finish_reason "abort".  False if unknown."""
        return self._backend.abort(request_id)

    @endpoint
    def stats(self) -> dict[str, Any]:
        """``SamplerStats`` as a dict (tokens, busy seconds, tokens/s, queue sizes)."""
        c = self._backend.counters()
        busy = c["busy_seconds"]
        return SamplerStats(
            pool=self.pool,
            precision=self.precision,
            backend=self._backend.name,
            version=self._backend.version,
            tokens_per_second=c["tokens_generated"] / busy if busy > 0 else 0.0,
            weight_updates=self._updates,
            staleness_budget=self.staleness_budget,
            **c,
        ).model_dump()
