"""What the controller needs of the actors it drives: three narrow, typed links.

The controller never touches a mesh directly; it talks to a `TrainerLink`, one
`PoolLink` per sampler pool and an `EnvLink`. `orchestrator.controller.meshes`
implements them over runtime meshes (separate processes); tests implement them
in memory. Every call may raise `ActorDied` (the actor behind it is gone) or
`ActorError` (it raised); the controller handles both. A call may also never return (a
frozen process): the controller binds each call to the liveness of the actor it waits on
(`_liveness`) and abandons it by cancellation when that actor stops answering pings.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from actors.trainer import StepResult
from actors.types import MissingTrajectories, SamplingParams, TaskSpec, Trajectory, TrajectoryRef
from hardware import PoolConfig

if TYPE_CHECKING:
    from orchestrator.controller.state import ControllerState

__all__ = ["Checkpointer", "EnvLink", "Links", "PoolLink", "TrainerLink"]


class TrainerLink(Protocol):
    """The trainer: one optimizer step per call, and the weight-sync publisher."""

    async def version(self) -> int:
        """The policy version the trainer holds."""

    async def train_step(self, batch: list[Trajectory | TrajectoryRef]) -> StepResult | MissingTrajectories:
        """One optimizer step on `batch` (all-or-nothing), then publish the new version. The
        trainer fetches the trajectories of refs from their holders; `MissingTrajectories`
        (nothing trained) names those it could not get."""

    async def update_path(self, receiver: str, have: int, precision: str, part_bytes: int) -> dict[str, Any]:
        """The weight messages that bring `receiver` from `have` (-1: nothing) to the newest,
        with a keyframe at their start left out: `{"keyframe": None or {"version", "parts",
        "wire_bytes"}, "deltas": [frames, ...]}`; the keyframe's parts (of at most
        `part_bytes` wire bytes) come from `keyframe_part`."""

    async def keyframe_part(
        self, precision: str, version: int, seq: int, part_bytes: int
    ) -> tuple[dict[str, Any], list[bytes]]:
        """Part `seq` (header, frames) of the stored keyframe `version`; ActorError when a
        newer keyframe has replaced it."""

    async def acks(self, precision: str, held: dict[str, int]) -> None:
        """Each receiver in `held` now holds its version of `precision`: the publisher may
        forget what only they needed (a receiver it does not know yet is registered)."""

    async def save_checkpoint(self, directory: str) -> str:
        """Write the trainer's checkpoint (weights, optimizer, RNG, version) to `directory`."""

    async def restart(self) -> int:
        """Replace a dead trainer by one restored from the last checkpoint on disk (its
        initial weights if there is none); returns its version once it answers."""

    def is_dead(self) -> bool:
        """Whether the trainer's process (any rank's) is known to be gone."""

    async def ping(self) -> None:
        """Returns once the trainer's processes answer a cheap call (liveness); ActorDied
        if one is dead."""


class PoolLink(Protocol):
    """One sampler pool: `size` sampler ranks sharing a config."""

    config: PoolConfig

    @property
    def size(self) -> int: ...

    def sampler(self, rank: int) -> Any:
        """What the EnvLink needs to reach sampler `rank` (an actor handle, or a fake)."""

    async def apply_weights(self, rank: int, updates: list[list[bytes]]) -> int:
        """Apply weight messages on `rank`; the version it holds afterwards."""

    async def apply_weights_part(self, rank: int, header: dict[str, Any], frames: list[Any]) -> int:
        """Feed one part of a streamed keyframe to `rank`; the version it uses afterwards."""

    async def have_version(self, rank: int) -> int | None:
        """The version the rank's weight receiver holds; None when it needs a keyframe."""

    async def reset_weights(self, rank: int) -> None:
        """Forget the held weights' version, so an older keyframe is accepted (the trainer
        went back to a checkpoint); generation waits for the next keyframe."""

    async def rank_stats(self, rank: int) -> dict[str, Any] | None:
        """The rank's counters (`tokens_generated`, `busy_seconds`, `requests_finished`,
        `prefill_batches`), None if it is dead. Waits while the rank restarts and, for a
        frozen process, until it thaws: the controller never waits for it on a step's path."""

    async def ping(self, rank: int) -> None:
        """Returns once the rank's process answers a cheap call (liveness); ActorDied if dead."""

    def dead_ranks(self) -> list[int]: ...

    def starting_ranks(self) -> list[int]:
        """Ranks being (re)started, not constructed yet."""

    def state_changes(self) -> Hashable:
        """A value that differs (by `==`) whenever `dead_ranks` or `starting_ranks` would
        answer differently (a count of state changes will do): the controller reads it
        several times per placement decision and the rank lists only when it moved."""

    def respawn(self, rank: int) -> None:
        """Start a fresh process for `rank` (stopping the old one, also a frozen one);
        calls wait until it is constructed."""

    def host_of(self, rank: int) -> str | None:
        """The `flotilla host` address `rank` runs on; None: the controller's machine, or a
        vacant rank of an elastic pool."""

    def left(self, rank: int) -> bool:
        """Whether dead `rank` was stopped by its host leaving the run (SIGTERM: drained)."""

    # Elastic pools (`config.elastic`) only:
    def candidates(self) -> list[str]:
        """Host addresses that may join now: the pool's `hosts` and its `hosts_file`."""

    async def probe(self, address: str) -> str | None:
        """None when the host answers with the expected key (it may be placed), else why not."""

    def place(self, rank: int, address: str) -> None:
        """Start sampler `rank` on the probed host `address` (as `respawn`)."""


class EnvLink(Protocol):
    """The environment actors, which play episodes against a chosen sampler."""

    @property
    def size(self) -> int: ...

    async def run_episode(
        self,
        pool: PoolLink,
        rank: int,
        task: TaskSpec,
        sampling: SamplingParams,
        min_version: int,
        env_rank: int,
        hold: bool = False,
    ) -> Trajectory | TrajectoryRef:
        """Play `task` on environment actor `env_rank` with sampler `rank` of `pool`, weights
        no older than `min_version`. `hold`: the actor may keep the tensors and answer a
        `TrajectoryRef` (its `holder` set), which the trainer fetches; a link whose actors
        hold nothing answers the `Trajectory`."""

    async def release(self, refs: list[TrajectoryRef]) -> None:
        """Let the holders forget `refs` (trained or dropped); never raises for a holder that
        is gone."""

    async def ping(self, rank: int) -> None:
        """Returns once the rank's process answers a cheap call (liveness); ActorDied if dead."""

    def dead_ranks(self) -> list[int]: ...

    def starting_ranks(self) -> list[int]: ...

    def state_changes(self) -> Hashable:
        """As `PoolLink.state_changes`."""

    def respawn(self, rank: int) -> None: ...


class Checkpointer(Protocol):
    """Where checkpoints go: the trainer's state and the controller's, as one unit."""

    async def save(self, trainer: TrainerLink, state: ControllerState) -> None:
        """Checkpoint both; a crash at any moment leaves the previous checkpoint usable."""

    async def restore(self, trainer: TrainerLink) -> tuple[int, int]:
        """Replace a dead trainer by one restored from the last checkpoint; returns its
        (version, step)."""


@dataclass
class Links:
    trainer: TrainerLink
    pools: dict[str, PoolLink]
    envs: EnvLink
