"""``TrainerActor``: the trainer behind the actor runtime, publishing weights after each step.

After every applied step the new fp32 master weights are published as wire
snapshots (one per precision in ``TrainerConfig.precisions``) through a
``WeightPublisher``: an XOR/zstd delta against the previous version, and a
keyframe every ``keyframe_interval`` versions. Samplers pull what they need with
``updates_for`` and acknowledge with ``ack``, so history nobody needs is dropped.

Concurrency: the step's compute runs in a worker thread, so while the trainer
computes, the actor keeps answering ``updates_for``/``ack``/``version`` (samplers
catch up on version k while k+1 is being computed). Steps, evaluations and
checkpoints are serialised by one lock; the publisher is only touched from the
actor's trio thread.
"""
from __future__ import annotations

import time
from typing import Any

import trio

from actors.trainer._checkpoint import is_complete
from actors.trainer._config import StepResult, TrainerConfig
from actors.trainer._core import Trainer
from actors.types import Trajectory
from orchestrator.runtime import Actor, endpoint, span
from orchestrator.weightsync import Precision, WeightMessage, WeightPublisher
from policies import RecipeConfig

__all__ = ["TrainerActor"]



def _frames(msg: WeightMessage) -> list[bytes]:
    return [bytes(f) if not isinstance(f, bytes) else f for f in msg.to_frames()]


class TrainerActor(Actor):
    """The trainer actor (see the module docstring).

    Args:
        config: trainer settings (None: defaults, the embedded tiny model).
        resume_from: a checkpoint directory written by ``save_checkpoint``; the
            model, optimizer state, version and RNG state come from it.
        missing_ok: start from the initial weights when ``resume_from`` holds no complete
            checkpoint (yet): a trainer respawned mid-run restores from whatever checkpoint
            the run has written by then.
        weights_key: hex key the weight publisher seals messages with (shared with the
            samplers' receivers); None: unkeyed digests.

    Weight messages travel as their ``WeightMessage.to_frames()`` lists (metadata
    JSON + compressed chunks, raw frames on the wire); ``SamplerActor.apply_weights``
    takes them as they are.
    """

    def __init__(self, config: TrainerConfig | None = None, resume_from: str | None = None,
                 missing_ok: bool = False, weights_key: str | None = None) -> None:
        self.config = config if config is not None else TrainerConfig()
        if missing_ok and resume_from is not None and not is_complete(resume_from):
            resume_from = None
        self.trainer = Trainer(self.config, resume_from=resume_from)
        self.publisher = WeightPublisher(keyframe_interval=self.config.keyframe_interval,
                                         precisions=tuple(self.config.precisions),
                                         auth_key=bytes.fromhex(weights_key) if weights_key else None)
        self._lock = trio.Lock()
        self._publish()

    def _publish(self) -> tuple[float, dict[str, int]]:
        t0 = time.perf_counter()
        version = self.trainer.version
        with span("weights.publish", version=version) as sp:
            msgs = self.publisher.publish(version, self.trainer.master_weights())
            wire: dict[str, int] = {}
            for m in msgs:   # deltas first, then keyframes; report the delta when both exist
                wire.setdefault(m.precision, m.nbytes)
            raw = {p: sum(t.numel() * t.element_size()
                          for t in self.publisher.snapshot(p).values()) for p in wire}
            for p, n in wire.items():
                sp.set_attribute(f"{p}.raw_bytes", raw[p])
                sp.set_attribute(f"{p}.wire_bytes", n)
                sp.set_attribute(f"{p}.ratio", raw[p] / n if n else 0.0)
            sp.set_attribute("keyframe", any(m.is_keyframe for m in msgs))
        return time.perf_counter() - t0, wire

    @endpoint
    async def train_step(self, batch: list[Trajectory]) -> StepResult:
        """One optimizer step on ``batch``, then publish the new version.

        Errors: ValueError (as ActorError at the caller) for a batch without
        generated tokens or with a malformed support record; the weights are then
        unchanged. Cancellation: once started, the step runs to completion (the
        update is all-or-nothing); a cancelled caller only loses the result.
        """
        async with self._lock:
            oldest = min((t.oldest_version for t in batch if t.num_generated), default=None)
            with span("train_step", batch=len(batch),
                      staleness_max=-1 if oldest is None else self.trainer.version - oldest) as sp:
                res = await trio.to_thread.run_sync(self.trainer.train_step, batch)
                if res.applied:
                    res.publish_seconds, res.publish_bytes = self._publish()
                for k, v in (("version", res.version), ("loss", res.loss),
                             ("grad_norm", res.grad_norm), ("tokens", res.tokens),
                             ("mismatch_kl", res.overall.mismatch_kl),
                             ("masked_fraction", res.overall.masked_fraction),
                             ("applied", res.applied)):
                    sp.set_attribute(k, v)
        return res

    @endpoint
    async def evaluate(self, batch: list[Trajectory],
                       recipe: RecipeConfig | None = None) -> StepResult:
        """Loss and metrics of ``batch`` at the current weights (``recipe`` overrides the
        trainer's); nothing changes."""
        async with self._lock:
            return await trio.to_thread.run_sync(self.trainer.evaluate, batch, recipe)

    @endpoint
    def version(self) -> int:
        """Policy version of the current weights (optimizer steps taken)."""
        return self.trainer.version

    @endpoint
    def model_config(self) -> dict[str, Any]:
        """The model config dict the trainer built, for samplers to build the same model."""
        return dict(self.trainer.model_config)

    @endpoint
    def updates_for(self, receiver: str, have_version: int | None,
                    precision: Precision) -> list[list[bytes]]:
        """Weight messages taking ``receiver`` from ``have_version`` (None or < 0: it holds
        nothing trustworthy) to the latest version: the delta chain or the newest keyframe
        plus the deltas after it, whichever is fewer bytes. Registers the receiver."""
        have = None if have_version is None or have_version < 0 else have_version
        return [_frames(m) for m in self.publisher.updates_for(receiver, have, precision)]

    @endpoint
    def ack(self, receiver: str, version: int) -> None:
        """``receiver`` holds ``version``; history older than every receiver's ack is dropped."""
        self.publisher.ack(receiver, version)

    @endpoint
    def keyframe(self, precision: Precision) -> list[bytes]:
        """The newest keyframe of ``precision`` (a new sampler's initial weights)."""
        return _frames(self.publisher.keyframe(precision))

    @endpoint
    async def save_checkpoint(self, directory: str) -> str:
        """Write a checkpoint (weights, optimizer, version, RNG, config) to ``directory``;
        returns its path. Waits for a running step to finish first."""
        async with self._lock:
            return await trio.to_thread.run_sync(self.trainer.save_checkpoint, directory)

    @endpoint
    async def digest(self) -> str:
        """SHA-256 of master weights + optimizer state + version (for exact-resume checks)."""
        async with self._lock:
            return self.trainer.digest()
