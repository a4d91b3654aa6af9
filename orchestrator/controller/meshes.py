"""The controller's links over actor meshes (each actor in its own process)."""

from __future__ import annotations

from typing import Any

import trio

from actors.trainer import StepResult
from actors.types import MissingTrajectories, SamplingParams, TaskSpec, Trajectory, TrajectoryRef
from hardware import PoolConfig
from orchestrator.controller.hosts import probe_host, read_hosts_file
from orchestrator.runtime import ActorDied, ActorError, Mesh
from orchestrator.runtime.host import HOST_LEFT

__all__ = ["MeshEnvs", "MeshPool", "MeshTrainer", "release_by_holder"]


async def release_by_holder(mesh: Mesh[Any], refs: list[TrajectoryRef], timeout_s: float = 10.0) -> None:
    """`release_held` on each holder of `refs` at once. A holder that is gone or does not
    answer in time is skipped: what it held went with it, or its store's bound evicts it."""
    keys: dict[int, list[str]] = {}
    for r in refs:
        if r.key:
            keys.setdefault(r.holder, []).append(r.key)

    async def one(holder: int, ks: list[str]) -> None:
        with trio.move_on_after(timeout_s):
            try:
                await mesh[holder].release_held.call_one(ks)
            except (ActorDied, ActorError):
                pass

    async with trio.open_nursery() as nursery:
        for holder, ks in keys.items():
            nursery.start_soon(one, holder, ks)


class MeshTrainer:
    """The trainer link over a one-rank `TrainerActor` mesh. Its constructor arguments
    name the run's checkpoint directory, so a respawned trainer restores from it. `envs`:
    the environment mesh that holds the trajectories a batch of refs names."""

    def __init__(self, mesh: Mesh[Any], envs: Mesh[Any] | None = None) -> None:
        self.mesh = mesh
        self.envs = envs
        self._actor = mesh[0]

    async def version(self) -> int:
        return await self._actor.version.call_one()

    async def train_step(self, batch: list[Trajectory | TrajectoryRef]) -> StepResult | MissingTrajectories:
        return await self._actor.train_step.call_one(batch, self.envs)

    async def update_path(self, receiver: str, have: int, precision: str, part_bytes: int) -> dict[str, Any]:
        return await self._actor.update_path.call_one(receiver, have, precision, part_bytes)

    async def keyframe_part(
        self, precision: str, version: int, seq: int, part_bytes: int
    ) -> tuple[dict[str, Any], list[bytes]]:
        return await self._actor.keyframe_part.call_one(precision, version, seq, part_bytes)

    async def acks(self, precision: str, held: dict[str, int]) -> None:
        await self._actor.acks.call_one(precision, held)

    async def save_checkpoint(self, directory: str) -> str:
        return await self._actor.save_checkpoint.call_one(directory)

    async def restart(self) -> int:
        self.mesh.respawn(0)
        return await self.version()  # waits until the new process is constructed

    def is_dead(self) -> bool:
        return bool(self.mesh.dead_ranks)

    async def ping(self) -> None:
        await self._actor.runtime_stats.call_one()


class MeshPool:
    """One sampler pool's link over its `SamplerActor` mesh."""

    def __init__(self, config: PoolConfig, mesh: Mesh[Any]) -> None:
        self.config = config
        self.mesh = mesh
        self._probed: dict[str, Any] = {}  # address -> HostSpec of hosts that answered a probe

    @property
    def size(self) -> int:
        return self.mesh.size

    def sampler(self, rank: int) -> Any:
        return self.mesh[rank]

    async def apply_weights(self, rank: int, updates: list[list[bytes]]) -> int:
        return await self.mesh[rank].apply_weights.call_one(updates)

    async def apply_weights_part(self, rank: int, header: dict[str, Any], frames: list[Any]) -> int:
        return await self.mesh[rank].apply_weights_part.call_one(header, frames)

    async def have_version(self, rank: int) -> int | None:
        return await self.mesh[rank].have_version.call_one()

    async def reset_weights(self, rank: int) -> None:
        await self.mesh[rank].reset_weights.call_one()

    async def rank_stats(self, rank: int) -> dict[str, Any] | None:
        if rank in self.mesh.dead_ranks:
            await trio.lowlevel.checkpoint()
            return None
        try:
            return await self.mesh[rank].stats.call_one()
        except ActorDied:
            return None

    async def ping(self, rank: int) -> None:
        await self.mesh[rank].runtime_stats.call_one()

    def starting_ranks(self) -> list[int]:
        return self.mesh.starting_ranks

    def dead_ranks(self) -> list[int]:
        return self.mesh.dead_ranks

    def state_changes(self) -> int:
        return self.mesh.state_changes

    def respawn(self, rank: int) -> None:
        self.mesh.respawn(rank)

    async def probe(self, address: str) -> str | None:
        spec, reason = await probe_host(self.config, address)
        if spec is not None:
            self._probed[address] = spec
        return None if spec is not None else reason

    def place(self, rank: int, address: str) -> None:
        self.mesh.place(rank, self._probed.pop(address))

    def host_of(self, rank: int) -> str | None:
        return self.mesh.rank_hosts[rank]

    def left(self, rank: int) -> bool:
        return HOST_LEFT in (self.mesh.death_reason(rank) or "")

    def candidates(self) -> list[str]:
        listed = read_hosts_file(self.config.hosts_file) if self.config.hosts_file else []
        return list(dict.fromkeys([*self.config.hosts, *listed]))


class MeshEnvs:
    """The environment actors; the controller picks the rank of each episode."""

    def __init__(self, mesh: Mesh[Any]) -> None:
        self.mesh = mesh

    @property
    def size(self) -> int:
        return self.mesh.size

    async def run_episode(
        self,
        pool: MeshPool,
        rank: int,
        task: TaskSpec,
        sampling: SamplingParams,
        min_version: int,
        env_rank: int,
        hold: bool = False,
    ) -> Trajectory | TrajectoryRef:
        out = await self.mesh[env_rank].run_episode.call_one(pool.sampler(rank), task, sampling, min_version, hold)
        if isinstance(out, TrajectoryRef):
            out.holder = env_rank
        return out

    async def release(self, refs: list[TrajectoryRef]) -> None:
        await release_by_holder(self.mesh, refs)

    async def ping(self, rank: int) -> None:
        await self.mesh[rank].runtime_stats.call_one()

    def starting_ranks(self) -> list[int]:
        return self.mesh.starting_ranks

    def dead_ranks(self) -> list[int]:
        return self.mesh.dead_ranks

    def state_changes(self) -> int:
        return self.mesh.state_changes

    def respawn(self, rank: int) -> None:
        self.mesh.respawn(rank)
