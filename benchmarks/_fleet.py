"""Fakes of the fleet benchmark (benchmarks/fleet.py): actors that compute nothing but send
real messages, and the controller's links over them.

Many logical ranks share a few processes: `FleetPool` maps sampler rank r of a pool to
process r % P of its sampler mesh, and `FleetEnvs` maps environment rank e to process
e % Q of the environment mesh; the controller sees every rank as its own actor (its own
weight version, liveness watcher and weight-sync worker) and pays for each one's calls.

- `FleetEnv.run_episode` waits `episode_s` (parked, woken by one clock task per process,
  as a real episode parks on its sampler's reply) and returns a synthetic `Trajectory` of
  `prompt` + `tokens` ids with a support row per generated token (sizes drawn once around
  `support`, so rows vary like a top-p cut does), stamped with the sampler rank's version:
  a copy of one trajectory validated when the actor starts, with the episode's names,
  reward and versions. With `hold` (the run's `[rollout] hold_trajectories`) it keeps the
  trajectory in an `actors.held.TrajectoryStore` and answers its `TrajectoryRef`, as
  `EnvActor` does.
- `FleetSampler` holds a weight version per logical rank; updates are one small frame.
- `FleetTrainer.train_step` takes the batch (fetching held trajectories from the
  environment processes, `actors.held.fetch_held`) and sleeps `len(batch) / rollouts_per_s`
  (a trainer consuming at a configured rate); its checkpoint is a file of fixed size.

The links count the bytes of trajectory data that pass through the controller process
(`DataMeter`): each trajectory arrives once from an environment actor and leaves once to
the trainer, as its tensors, or as a ref (counted as the ref's JSON, about what its wire
header carries).
"""

from __future__ import annotations

import json
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
import trio

from actors.held import HeldBatch, TrajectoryStore, fetch_held
from actors.trainer import StepResult
from actors.types import TENSOR_FIELDS, MissingTrajectories, SamplingParams, TaskSpec, Trajectory, TrajectoryRef
from hardware import PoolConfig
from orchestrator.controller.meshes import MeshTrainer, release_by_holder
from orchestrator.runtime import Actor, ActorDied, Mesh, endpoint
from policies.metrics import PoolMetrics

__all__ = [
    "DataMeter",
    "FleetEnv",
    "FleetEnvs",
    "FleetPool",
    "FleetSampler",
    "FleetTrainer",
    "FleetTrainerLink",
    "trajectory_bytes",
]


def trajectory_bytes(t: Trajectory | TrajectoryRef) -> int:
    """Bytes of a trajectory's tensors (what its frames carry on the wire), counted once."""
    if isinstance(t, TrajectoryRef):
        return t.nbytes
    n = t.__dict__.get("_fleet_bytes")
    if n is None:
        n = t.__dict__["_fleet_bytes"] = sum(
            getattr(t, k).numel() * getattr(t, k).element_size() for k in TENSOR_FIELDS
        )
    return n


def path_bytes(t: Trajectory | TrajectoryRef) -> int:
    """Bytes a trajectory puts through the controller on one hop: its tensors, or a ref's JSON."""
    return len(t.model_dump_json()) if isinstance(t, TrajectoryRef) else trajectory_bytes(t)


@dataclass
class DataMeter:
    """Trajectory data through the controller: bytes in (from environments), out (to the
    trainer), and the trajectories that carried them."""

    bytes_in: int = 0
    bytes_out: int = 0
    rollouts: int = 0  # trajectories that arrived
    traj_bytes: int = 0  # sum of trajectory_bytes over the rollouts counted in
    trained: int = 0  # trajectories sent to the trainer
    pings: int = 0  # liveness pings the controller sent to sampler and environment ranks
    # A held ref's bytes as measured when it arrived, by key, until released: the same ref
    # leaves for the trainer, and measuring it again (a JSON dump) would be the meter's own
    # CPU counted as the controller's.
    ref_bytes: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> tuple[int, int, int, int, int, int]:
        return self.bytes_in, self.bytes_out, self.rollouts, self.traj_bytes, self.trained, self.pings


def _metrics(tokens: int) -> PoolMetrics:
    return PoolMetrics(tokens=tokens, mismatch_kl=0.0, masked_fraction=0.0, mean_weight=1.0, entropy=0.5)


class FleetTrainer(Actor):
    """A trainer that takes batches at `rollouts_per_s` and publishes one-frame deltas."""

    def __init__(self, rollouts_per_s: float, checkpoint_bytes: int = 1 << 20) -> None:
        self.rate = rollouts_per_s
        self.checkpoint_bytes = checkpoint_bytes
        self.v = 0

    @endpoint
    async def version(self) -> int:
        return self.v

    @endpoint
    async def train_step(
        self, batch: list[Trajectory | TrajectoryRef], envs: Mesh | None = None
    ) -> StepResult | MissingTrajectories:
        if any(isinstance(t, TrajectoryRef) for t in batch):
            fetched = await fetch_held(batch, envs)
            if isinstance(fetched, MissingTrajectories):
                return fetched
            batch = fetched
        await trio.sleep(len(batch) / self.rate)
        self.v += 1
        tokens = sum(t.num_generated for t in batch)
        pools = {t.pool for t in batch}
        return StepResult(
            version=self.v,
            applied=True,
            loss=0.0,
            grad_norm=1.0,
            tokens=tokens,
            trajectories=len(batch),
            failed_skipped=0,
            micro_batches=1,
            reward_mean=sum(t.reward for t in batch) / len(batch),
            seconds=len(batch) / self.rate,
            overall=_metrics(tokens),
            per_pool={p: _metrics(tokens // len(pools)) for p in pools},
        )

    @endpoint
    async def update_path(self, receiver: str, have: int, precision: str, part_bytes: int) -> dict[str, Any]:
        if have < 0:
            return {"keyframe": {"version": self.v, "parts": 1, "wire_bytes": 1}, "deltas": []}
        return {"keyframe": None, "deltas": [[str(self.v).encode()]]}

    @endpoint
    async def keyframe_part(
        self, precision: str, version: int, seq: int, part_bytes: int
    ) -> tuple[dict[str, Any], list[bytes]]:
        return {"seq": seq, "parts": 1, "version": version}, [b"k"]

    @endpoint
    async def acks(self, precision: str, held: dict[str, int]) -> None:
        return None

    @endpoint
    async def save_checkpoint(self, directory: str) -> str:
        """Writes `checkpoint_bytes` of weights and the version (a checkpoint of fixed size)."""
        path = Path(directory)
        (path / "weights.bin").write_bytes(bytes(self.checkpoint_bytes))
        (path / "version.json").write_text(json.dumps({"version": self.v}))
        return directory


class FleetSampler(Actor):
    """Sampler ranks that hold a version each and generate nothing."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}

    @endpoint
    async def apply(self, rank: int, updates: list[list[bytes]]) -> int:
        self.held[rank] = int(bytes(updates[-1][0]))
        return self.held[rank]

    @endpoint
    async def apply_part(self, rank: int, header: dict[str, Any], frames: list[bytes]) -> int:
        if header["seq"] == header["parts"] - 1:
            self.held[rank] = int(header["version"])
        return self.held.get(rank, -1)

    @endpoint
    async def reset(self, rank: int) -> None:
        self.held.pop(rank, None)

    @endpoint
    async def have(self, rank: int) -> int | None:
        return self.held.get(rank)

    @endpoint
    async def stats(self, rank: int) -> dict[str, Any]:
        return {"tokens_generated": 0, "busy_seconds": 0.0, "requests_finished": 0, "prefill_batches": 0}


class _Clock:
    """Wakes each waiter `delay` seconds after it started waiting, all from one task.

    A waiter parks and is rescheduled, as a real environment's episode parks on its
    sampler's reply, instead of a `trio.sleep` each (a cancel scope with a deadline, ended
    by raising and catching `Cancelled`: several times the CPU of a park and a wake, on
    every episode of the fake). Every wait is equally long, so waiters are due in the order
    they came, and a clock that finds none sleeps one `delay`: none that comes meanwhile
    can be due before it wakes."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.due: deque[list[Any]] = deque()  # [deadline, task or None once cancelled]
        self.running = False

    async def wait(self) -> None:
        if not self.running:  # no clock task (outside an actor process, or no delay)
            await trio.sleep(self.delay)
            return
        entry = [perf_counter() + self.delay, trio.lowlevel.current_task()]
        self.due.append(entry)

        def abort(_: Any) -> trio.lowlevel.Abort:
            entry[1] = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def run(self) -> None:
        if self.delay <= 0:
            return
        self.running = True
        due = self.due
        try:
            while True:
                now = perf_counter()
                while due and due[0][0] <= now:
                    task = due.popleft()[1]
                    if task is not None:
                        trio.lowlevel.reschedule(task)
                await trio.sleep(due[0][0] - now if due else self.delay)
        finally:
            self.running = False


class FleetEnv(Actor):
    """Plays synthetic episodes: `prompt` + `tokens` ids, a support row per generated token
    of about `support` ids, after `episode_s` seconds."""

    def __init__(self, prompt: int, tokens: int, support: int, episode_s: float, seed: int) -> None:
        if tokens < 1 or support < 1 or prompt < 1:
            raise ValueError(f"prompt, tokens and support must be >= 1, got {prompt}, {tokens}, {support}")
        rng = random.Random(seed)
        sizes = [rng.randint(max(1, support // 2), max(1, support + support // 2)) for _ in range(tokens)]
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        nnz = offsets[-1]
        g = torch.Generator().manual_seed(seed)
        seq = torch.randint(0, 50_000, (prompt + tokens,), dtype=torch.int64, generator=g)
        ids = torch.randint(0, 50_000, (nnz,), dtype=torch.int32, generator=g)
        ids[torch.tensor(offsets[:-1])] = seq[prompt:].to(torch.int32)  # y_t is in S_t
        logq = -torch.rand(nnz, generator=g) * 5
        self.n = tokens
        self.rng = rng
        self.held = TrajectoryStore()
        # Every episode is this trajectory with its own names, reward and version stamp:
        # validated once here, copied per episode (a fake that costs nothing to compute).
        self.template = Trajectory(
            task="",
            prompt_id="",
            group_id="",
            pool="",
            tokens=seq,
            loss_mask=torch.cat([torch.zeros(prompt, dtype=torch.bool), torch.ones(tokens, dtype=torch.bool)]),
            support_ids=ids,
            support_offsets=torch.tensor(offsets, dtype=torch.int32),
            support_logq=logq,
            versions=torch.zeros(tokens, dtype=torch.int32),
            reward=0.0,
            turns=1,
            seconds=episode_s,
        )
        self._stamp = (0, self.template.versions)  # (version, its versions tensor), reused
        self.clock = _Clock(episode_s)

    async def on_start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self.clock.run)

    def _versions(self, version: int) -> torch.Tensor:
        if self._stamp[0] != version:  # held trajectories keep theirs: never written to
            self._stamp = (version, torch.full((self.n,), version, dtype=torch.int32))
        return self._stamp[1]

    @endpoint
    async def run_episode(
        self, pool: str, version: int, task: TaskSpec, sampling: SamplingParams, hold: bool = False
    ) -> Trajectory | TrajectoryRef:
        await self.clock.wait()
        traj = self.template.model_copy(
            update={
                "task": task.task,
                "prompt_id": task.prompt_id,
                "group_id": task.group_id,
                "pool": pool,
                "versions": self._versions(version),
                "reward": float(self.rng.random() < 0.5),
            }
        )
        return self.held.put(traj) if hold else traj

    @endpoint
    async def fetch_held(self, keys: list[str]) -> HeldBatch:
        return HeldBatch.pack(self.held.get(keys))

    @endpoint
    async def release_held(self, keys: list[str]) -> int:
        return self.held.release(keys)

    @endpoint
    async def held_count(self) -> int:
        return len(self.held)


class FleetTrainerLink(MeshTrainer):
    """The run's trainer link over a one-rank `FleetTrainer` mesh; counts the bytes it sends."""

    def __init__(self, mesh: Mesh[Any], meter: DataMeter, envs: Mesh[Any] | None = None) -> None:
        super().__init__(mesh, envs)
        self.meter = meter

    async def train_step(self, batch: list[Trajectory | TrajectoryRef]) -> StepResult | MissingTrajectories:
        sizes = self.meter.ref_bytes
        self.meter.bytes_out += sum(
            (sizes.get(t.key) or path_bytes(t)) if isinstance(t, TrajectoryRef) else path_bytes(t) for t in batch
        )
        self.meter.trained += len(batch)
        return await super().train_step(batch)

    async def restart(self) -> int:
        raise RuntimeError("the fleet benchmark's trainer is not restarted")

    def is_dead(self) -> bool:
        return bool(self.mesh.dead_ranks)

    async def ping(self) -> None:
        await self._actor.runtime_stats.call_one()


class _Multiplexed:
    """`size` logical ranks over the processes of one mesh (rank r runs in process
    r % mesh.size): their liveness and respawns, as the controller's links need them."""

    mesh: Mesh[Any]
    meter: DataMeter
    _size: int

    def _proc(self, rank: int) -> Any:
        return self.mesh[rank % self.mesh.size]

    async def ping(self, rank: int) -> None:
        self.meter.pings += 1
        await self._proc(rank).runtime_stats.call_one()

    def dead_ranks(self) -> list[int]:
        dead = self.mesh.dead_ranks
        return [r for r in range(self._size) if r % self.mesh.size in dead] if dead else []

    def starting_ranks(self) -> list[int]:
        starting = self.mesh.starting_ranks
        return [r for r in range(self._size) if r % self.mesh.size in starting] if starting else []

    def state_changes(self) -> int:
        return self.mesh.state_changes

    def respawn(self, rank: int) -> None:
        self.mesh.respawn(rank % self.mesh.size)


class FleetPool(_Multiplexed):
    """`size` logical sampler ranks over the processes of one `FleetSampler` mesh."""

    def __init__(self, config: PoolConfig, mesh: Mesh[Any], size: int, meter: DataMeter) -> None:
        self.config = config
        self.mesh = mesh
        self._size = size
        self.meter = meter
        self.held = [-1] * size  # what each rank answered last (the env fake stamps it)

    @property
    def size(self) -> int:
        return self._size

    def sampler(self, rank: int) -> Any:
        return self._proc(rank)

    async def apply_weights(self, rank: int, updates: list[list[bytes]]) -> int:
        self.held[rank] = await self._proc(rank).apply.call_one(rank, updates)
        return self.held[rank]

    async def apply_weights_part(self, rank: int, header: dict[str, Any], frames: list[Any]) -> int:
        self.held[rank] = await self._proc(rank).apply_part.call_one(rank, header, frames)
        return self.held[rank]

    async def reset_weights(self, rank: int) -> None:
        self.held[rank] = -1
        await self._proc(rank).reset.call_one(rank)

    async def rank_stats(self, rank: int) -> dict[str, Any] | None:
        try:
            return await self._proc(rank).stats.call_one(rank)
        except ActorDied:
            return None

    async def have_version(self, rank: int) -> int | None:
        return await self._proc(rank).have.call_one(rank)

    def host_of(self, rank: int) -> str | None:
        return None  # every fake rank runs on this machine

    def left(self, rank: int) -> bool:
        return False


class FleetEnvs(_Multiplexed):
    """`size` logical environment ranks over the processes of one `FleetEnv` mesh; counts
    the trajectory bytes that arrive."""

    def __init__(self, mesh: Mesh[Any], size: int, meter: DataMeter) -> None:
        self.mesh = mesh
        self._size = size
        self.meter = meter

    @property
    def size(self) -> int:
        return self._size

    async def run_episode(
        self,
        pool: FleetPool,
        rank: int,
        task: TaskSpec,
        sampling: SamplingParams,
        min_version: int,
        env_rank: int,
        hold: bool = False,
    ) -> Trajectory | TrajectoryRef:
        holder = env_rank % self.mesh.size
        traj = await self.mesh[holder].run_episode.call_one(pool.config.name, pool.held[rank], task, sampling, hold)
        if isinstance(traj, TrajectoryRef):
            traj.holder = holder
        n = path_bytes(traj)
        if isinstance(traj, TrajectoryRef) and traj.key:
            self.meter.ref_bytes[traj.key] = n
        self.meter.bytes_in += n
        self.meter.traj_bytes += trajectory_bytes(traj)
        self.meter.rollouts += 1
        return traj

    async def release(self, refs: list[TrajectoryRef]) -> None:
        sizes = self.meter.ref_bytes
        for r in refs:
            sizes.pop(r.key, None)
        await release_by_holder(self.mesh, refs)
