"""``TrainerActor``: the trainer behind the actor runtime, publishing weights after each step.

After every applied step the new fp32 master weights are published as wire
snapshots (one per precision in ``TrainerConfig.precisions``) through a
``WeightPublisher``: an XOR/zstd delta against the previous version, and a
keyframe every ``keyframe_interval`` versions. Samplers pull what they need with
``updates_for`` and acknowledge with ``ack``, so history nobody needs is dropped.

A trainer mesh (``TrainerConfig.procs`` > 1) runs one ``TrainerActor`` per rank; the
ranks form a ``torch.distributed`` group in their constructors and shard the model
with FSDP2. Every rank takes every ``train_step``, ``evaluate``, ``save_checkpoint`` and
``digest`` call (they are collectives); only rank 0 holds a publisher and answers
``updates_for``/``ack``/``keyframe``. ``TrainerGroup`` presents such a mesh
to the controller as one trainer.

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

from actors.held import FETCH_TIMEOUT_S, fetch_held
from actors.trainer._checkpoint import is_complete
from actors.trainer._config import StepResult, TrainerConfig
from actors.trainer._core import Trainer
from actors.trainer._dist import World, gather_json, init_group
from actors.trainer._memory import size_report
from actors.trainer._sft import SftResult, SftSequence
from actors.types import MissingTrajectories, Trajectory, TrajectoryRef
from orchestrator.runtime import Actor, Mesh, current_rank, endpoint, span
from orchestrator.weightsync import (
    DEFAULT_PART_BYTES,
    Precision,
    VersionError,
    WeightMessage,
    WeightPublisher,
    message_part,
    part_plan,
)
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
        rendezvous: ``host:port`` of the group's rank 0 when ``config.procs`` > 1
            (``trainer_mesh`` chooses it; see ``actors.trainer._dist``).

    Weight messages travel as their ``WeightMessage.to_frames()`` lists (metadata
    JSON + compressed chunks, raw frames on the wire); ``SamplerActor.apply_weights``
    takes them as they are.
    """

    def __init__(
        self,
        config: TrainerConfig | None = None,
        resume_from: str | None = None,
        missing_ok: bool = False,
        weights_key: str | None = None,
        rendezvous: str | None = None,
    ) -> None:
        self.config = config if config is not None else TrainerConfig()
        if missing_ok and resume_from is not None and not is_complete(resume_from):
            resume_from = None
        self.world = World(current_rank(), self.config.procs)
        if self.config.procs > 1:
            if rendezvous is None:
                raise ValueError("TrainerActor: procs > 1 needs the group's rendezvous address")
            init_group(rendezvous, self.world, self.config.device)
        self.trainer = Trainer(self.config, resume_from=resume_from, world=self.world)
        self.publisher = (
            WeightPublisher(
                keyframe_interval=self.config.keyframe_interval,
                precisions=tuple(self.config.precisions),
                auth_key=bytes.fromhex(weights_key) if weights_key else None,
            )
            if self.world.is_main
            else None
        )
        self._lock = trio.Lock()
        self._stepped = False
        self._publish()

    def _main_publisher(self, what: str) -> WeightPublisher:
        if self.publisher is None:
            raise RuntimeError(f"{what}: trainer rank {self.world.rank} does not publish; ask rank 0")
        return self.publisher

    def _publish(self, weights: dict[str, Any] | None = None, t0: float | None = None) -> tuple[float, dict[str, int]]:
        """On rank 0, publish ``weights`` (default: gather them now, a collective on the FSDP2
        path, which every rank must join)."""
        t0 = time.perf_counter() if t0 is None else t0
        version = self.trainer.version
        if weights is None:
            weights = self.trainer.master_weights()
        if self.publisher is None:
            return time.perf_counter() - t0, {}
        with span("weights.publish", version=version) as sp:
            msgs = self.publisher.publish(version, weights)
            wire: dict[str, int] = {}
            for m in msgs:  # deltas first, then keyframes; report the delta when both exist
                wire.setdefault(m.precision, m.nbytes)
            raw = {p: sum(t.numel() * t.element_size() for t in self.publisher.snapshot(p).values()) for p in wire}
            for p, n in wire.items():
                sp.set_attribute(f"{p}.raw_bytes", raw[p])
                sp.set_attribute(f"{p}.wire_bytes", n)
                sp.set_attribute(f"{p}.ratio", raw[p] / n if n else 0.0)
            sp.set_attribute("keyframe", any(m.is_keyframe for m in msgs))
        return time.perf_counter() - t0, wire

    async def _fetch(
        self, batch: list[Trajectory | TrajectoryRef], envs: Mesh | None, timeout_s: float
    ) -> list[Trajectory] | MissingTrajectories:
        with span("trajectories.fetch", batch=len(batch)) as sp:
            fetched = await fetch_held(batch, envs, timeout_s)
            if self.world.size > 1:  # a step is a collective: every rank trains, or none
                mine = fetched.keys if isinstance(fetched, MissingTrajectories) else []
                ranks = await trio.to_thread.run_sync(gather_json, mine, self.world, self.trainer.device)
                missing = sorted({k for keys in ranks for k in keys})
                if missing:
                    why = (
                        fetched.reason
                        if isinstance(fetched, MissingTrajectories)
                        else "another trainer rank missed them"
                    )
                    fetched = MissingTrajectories(keys=missing, reason=why)
            sp.set_attribute("missing", len(fetched.keys) if isinstance(fetched, MissingTrajectories) else 0)
        return fetched

    @endpoint
    async def train_step(
        self,
        batch: list[Trajectory | TrajectoryRef],
        envs: Mesh | None = None,
        fetch_timeout_s: float = FETCH_TIMEOUT_S,
    ) -> StepResult | MissingTrajectories:
        """One optimizer step on ``batch``, then publish the new version.

        A ``TrajectoryRef`` in ``batch`` is fetched first from its holder in the environment
        mesh ``envs`` (``actors.held``, waiting at most ``fetch_timeout_s`` per holder); if
        any cannot be, nothing is trained and the answer is ``MissingTrajectories`` naming
        them. In a trainer group every rank fetches the batch itself, and the ranks agree
        before the step: if one rank misses a trajectory, none trains.

        Errors: ValueError (as ActorError at the caller) for a batch without
        generated tokens or with a malformed support record; the weights are then
        unchanged. Cancellation: once started, the step runs to completion (the
        update is all-or-nothing); a cancelled caller only loses the result.
        """
        async with self._lock:
            if any(isinstance(t, TrajectoryRef) for t in batch):
                fetched = await self._fetch(batch, envs, fetch_timeout_s)
                if isinstance(fetched, MissingTrajectories):
                    return fetched
                batch = fetched
            oldest = min((t.oldest_version for t in batch if t.num_generated), default=None)
            with span(
                "train_step", batch=len(batch), staleness_max=-1 if oldest is None else self.trainer.version - oldest
            ) as sp:
                res = await trio.to_thread.run_sync(self.trainer.train_step, batch)
                if res.applied:
                    t0 = time.perf_counter()
                    # Gathering is compute (and collectives): off the loop; publishing touches
                    # the publisher, which only the trio thread does.
                    weights = await trio.to_thread.run_sync(self.trainer.master_weights)
                    res.publish_seconds, res.publish_bytes = self._publish(weights, t0)
                if not self._stepped:
                    self._stepped = True
                    res.memory = self.size_report()
                for k, v in (
                    ("version", res.version),
                    ("loss", res.loss),
                    ("grad_norm", res.grad_norm),
                    ("tokens", res.tokens),
                    ("mismatch_kl", res.overall.mismatch_kl),
                    ("masked_fraction", res.overall.masked_fraction),
                    ("applied", res.applied),
                ):
                    sp.set_attribute(k, v)
        return res

    @endpoint
    async def evaluate(self, batch: list[Trajectory], recipe: RecipeConfig | None = None) -> StepResult:
        """Loss and metrics of ``batch`` at the current weights (``recipe`` overrides the
        trainer's); nothing changes."""
        async with self._lock:
            return await trio.to_thread.run_sync(self.trainer.evaluate, batch, recipe)

    @endpoint
    async def sft_step(self, batch: list[SftSequence], lr: float) -> SftResult:
        """One supervised step on ``batch`` (cross-entropy on its assistant tokens) at rate
        ``lr``. Nothing is published: SFT has no samplers; its output is a checkpoint.
        Errors and cancellation as ``train_step``."""
        async with self._lock:
            return await trio.to_thread.run_sync(self.trainer.sft_step, batch, lr)

    @endpoint
    async def sft_evaluate(self, batch: list[SftSequence]) -> SftResult:
        """The mean NLL of ``batch``'s assistant tokens at the current weights."""
        async with self._lock:
            return await trio.to_thread.run_sync(self.trainer.sft_evaluate, batch)

    @endpoint
    def version(self) -> int:
        """Policy version of the current weights (optimizer steps taken)."""
        return self.trainer.version

    @endpoint
    def model_config(self) -> dict[str, Any]:
        """The model config dict the trainer built, for samplers to build the same model."""
        return dict(self.trainer.model_config)

    @endpoint
    def updates_for(self, receiver: str, have_version: int | None, precision: Precision) -> list[list[bytes]]:
        """Weight messages taking ``receiver`` from ``have_version`` (None or < 0: it holds
        nothing trustworthy) to the latest version: the delta chain or the newest keyframe
        plus the deltas after it, whichever is fewer bytes. Registers the receiver."""
        have = None if have_version is None or have_version < 0 else have_version
        pub = self._main_publisher("updates_for")
        return [_frames(m) for m in pub.updates_for(receiver, have, precision)]

    @endpoint
    def update_path(
        self, receiver: str, have_version: int | None, precision: Precision, part_bytes: int = DEFAULT_PART_BYTES
    ) -> dict[str, Any]:
        """``updates_for``, with a keyframe at the start of the path left out, to be fetched
        in parts with ``keyframe_part``: ``{"keyframe": None | {"version", "parts",
        "wire_bytes"}, "deltas": [frames, ...]}``. Registers the receiver."""
        have = None if have_version is None or have_version < 0 else have_version
        msgs = self._main_publisher("update_path").updates_for(receiver, have, precision)
        keyframe = None
        if msgs and msgs[0].is_keyframe:
            kf, msgs = msgs[0], msgs[1:]
            keyframe = {"version": kf.version, "parts": len(part_plan(kf.meta, part_bytes)), "wire_bytes": kf.nbytes}
        return {"keyframe": keyframe, "deltas": [_frames(m) for m in msgs]}

    @endpoint
    def keyframe_part(
        self, precision: Precision, version: int, seq: int, part_bytes: int = DEFAULT_PART_BYTES
    ) -> tuple[dict[str, Any], list[bytes]]:
        """Part ``seq`` of the stored keyframe ``version`` (``weightsync.message_part``: its
        frames are the stored ones, nothing is re-encoded). Raises VersionError once a newer
        keyframe has replaced it (the publisher keeps only the newest), ValueError for a
        ``seq`` past the last part."""
        kf = self._main_publisher("keyframe_part").keyframe(precision)
        if kf.version != version:
            raise VersionError(f"keyframe v{version} is no longer held; the newest is v{kf.version}")
        header, frames = message_part(kf, seq, part_bytes)
        return header, [f if isinstance(f, bytes) else bytes(f) for f in frames]

    @endpoint
    def acks(self, precision: Precision, held: dict[str, int]) -> None:
        """Each receiver in ``held`` holds its version of ``precision`` (registered if new:
        it may have applied a path another receiver asked for); history older than every
        receiver's acknowledged version is dropped."""
        self._main_publisher("acks").acknowledge(held, precision)

    @endpoint
    def keyframe(self, precision: Precision) -> list[bytes]:
        """The newest keyframe of ``precision`` (a new sampler's initial weights)."""
        return _frames(self._main_publisher("keyframe").keyframe(precision))

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
            return await trio.to_thread.run_sync(self.trainer.digest)

    @endpoint
    async def full_weights(self) -> dict[str, Any]:
        """The fp32 weights samplers use (LoRA: merged), by HF name. A collective on the
        FSDP2 path: every rank must be called; rank 0 answers, the others return {}."""
        async with self._lock:
            return dict(await trio.to_thread.run_sync(self.trainer.master_weights))

    @endpoint
    async def adapter_weights(self) -> dict[str, Any]:
        """The LoRA adapter tensors alone (``peft`` names), for exporting an adapter; {}
        without LoRA. A collective like ``full_weights``."""
        async with self._lock:
            return dict(await trio.to_thread.run_sync(self.trainer.adapter_weights))

    @endpoint
    def size_report(self) -> dict[str, Any]:
        """This rank's parameter count, bytes (parameters, gradients, optimizer) and peak
        memory so far (see ``actors.trainer._memory``)."""
        t = self.trainer
        return size_report(t.model, t.params, t.optimizer, self.world.rank, self.world.size)
