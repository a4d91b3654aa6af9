"""In-memory links for the controller: a trainer, sampler pools and envs without processes.

Time is trio's (tests run under `MockClock(autojump_threshold=0)`), so an episode that
"takes" 0.2 s costs nothing. Faults are injected by the test: `FakePool.kill(rank)` fails
the rank's episodes in flight with ActorDied until it is respawned; `FakePool.freeze(rank)`
makes every call on it wait until `thaw(rank)` (a stopped process); `FakeTrainer.die_at`
kills the trainer at a step.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import trio

from actors.trainer import StepResult
from actors.types import SamplingParams, TaskSpec, Trajectory
from hardware import CostLedger, ModelSpec, PoolConfig, Scheduler, ThroughputModel
from orchestrator.controller import Controller, ControllerState, Links
from orchestrator.runtime import ActorDied, ActorError
from orchestrator.state.config import RunConfig
from orchestrator.state.progress import Progress
from policies.metrics import PoolMetrics

TOKENS = 4  # generated tokens per episode


def cheap_and_dear(cheap_budget: int = 1, dear_budget: int = 1) -> list[dict[str, Any]]:
    """The two pools of `run_config`: "cheap" and "dear" (twice its price), 4 rollouts each,
    with these staleness budgets."""
    return [
        {"name": "cheap", "gpu": "cpu", "staleness_budget": cheap_budget, "max_concurrent_rollouts": 4},
        {
            "name": "dear",
            "gpu": "cpu",
            "price_per_gpu_hour": 2.0,
            "staleness_budget": dear_budget,
            "max_concurrent_rollouts": 4,
        },
    ]


def run_config(**over: Any) -> RunConfig:
    raw: dict[str, Any] = {
        "steps": 6,
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_buffered_groups": 2},
        "checkpoint": {"every_steps": 2},
        "pools": cheap_and_dear(),
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(raw.get(k), dict):
            raw[k] = {**raw[k], **v}
        else:
            raw[k] = v
    return RunConfig.model_validate(raw)


def _metrics(tokens: int) -> PoolMetrics:
    return PoolMetrics(tokens=tokens, mismatch_kl=0.0, masked_fraction=0.0, mean_weight=1.0, entropy=0.5)


class FakeTrainer:
    def __init__(self) -> None:
        self.v = 0
        self.batches: list[tuple[int, list[Trajectory]]] = []  # (version trained at, batch)
        self.gate: trio.Event | None = None  # when set: train_step waits for it
        self.entered = trio.Event()
        self.die_at: int | None = None  # the step (1-based) whose train_step kills the trainer
        self.die_after: int | None = None  # the step after which the trainer dies, between steps
        self.dead = False
        self.saved: dict[str, int] = {}  # checkpoint directory -> version
        self.restarts = 0
        self.acked: dict[str, int] = {}
        self.path_calls: list[tuple[str, int]] = []  # (receiver, have) of each update_path
        self.ack_calls = 0
        self.step_starts: list[float] = []  # trio time each train_step was entered

    def is_dead(self) -> bool:
        return self.dead

    async def ping(self) -> None:
        await trio.sleep(0.001)
        self._alive()

    def _alive(self) -> None:
        if self.dead:
            raise ActorDied("trainer", 0, "killed")

    async def version(self) -> int:
        self._alive()
        return self.v

    async def train_step(self, batch: list[Trajectory]) -> StepResult:
        self._alive()
        self.step_starts.append(trio.current_time())
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        await trio.sleep(0.1)
        if self.die_at is not None and len(self.batches) + 1 == self.die_at:
            self.die_at, self.dead = None, True
            raise ActorDied("trainer", 0, "SIGKILL")
        self.batches.append((self.v, batch))
        self.v += 1
        if self.die_after is not None and len(self.batches) == self.die_after:
            self.die_after, self.dead = None, True  # this step's result still arrives
        tokens = sum(t.num_generated for t in batch)
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
            seconds=0.1,
            overall=_metrics(tokens),
            per_pool={p: _metrics(1) for p in {t.pool for t in batch}},
        )

    async def update_path(self, receiver: str, have: int, precision: str, part_bytes: int) -> dict[str, Any]:
        """A sampler with nothing gets a two-part keyframe of the current version."""
        self._alive()
        self.path_calls.append((receiver, have))
        await trio.sleep(0.001)  # a round trip: ranks asking meanwhile share the answer
        if have < 0:
            return {"keyframe": {"version": self.v, "parts": 2, "wire_bytes": 2}, "deltas": []}
        return {"keyframe": None, "deltas": [[str(self.v).encode()]]}

    async def keyframe_part(
        self, precision: str, version: int, seq: int, part_bytes: int
    ) -> tuple[dict[str, Any], list[bytes]]:
        self._alive()
        if version != self.v:
            raise ActorError("VersionError", f"keyframe v{version} is no longer held", "")
        return {"seq": seq, "parts": 2, "version": version}, [b"k"]

    async def acks(self, precision: str, held: dict[str, int]) -> None:
        self._alive()
        self.ack_calls += 1
        await trio.sleep(0.001)
        self.acked.update(held)

    async def save_checkpoint(self, directory: str) -> str:
        self._alive()
        self.saved[directory] = self.v
        return directory

    async def restart(self) -> int:
        raise AssertionError("restored through the checkpointer")


class MemoryCheckpoints:
    """The checkpointer, in memory: the last saved trainer version and controller state."""

    def __init__(self, trainer: FakeTrainer) -> None:
        self.trainer = trainer
        self.saves: list[ControllerState] = []

    async def save(self, trainer: Any, state: ControllerState) -> None:
        await trainer.save_checkpoint(f"ckpt-{len(self.saves)}")
        self.saves.append(ControllerState.model_validate(state.model_dump()))

    async def restore(self, trainer: Any) -> tuple[int, int]:
        await trio.sleep(1.0)  # a process start
        last = self.saves[-1] if self.saves else ControllerState()
        self.trainer.dead = False
        self.trainer.restarts += 1
        self.trainer.v = last.version
        return last.version, last.step


class FakePool:
    def __init__(self, config: PoolConfig, size: int = 1) -> None:
        self.config = config
        self.held = [-1] * size  # version each rank holds
        self.dead: set[int] = set()
        self.epoch = [0] * size  # bumped by a kill: episodes of the old process fail
        self.tokens = [0] * size
        self.busy = [0.0] * size
        self.respawns = 0
        self.resets = 0
        self.frozen: set[int] = set()  # ranks that answer nothing (see freeze)
        self.down_until = -1.0  # respawns before this trio time fail (an unreachable host)
        self.respawn_calls = 0
        self.thawed = trio.Event()
        self.stats_s = 0.001  # how long a rank takes to answer for its counters

    @property
    def size(self) -> int:
        return len(self.held)

    def sampler(self, rank: int) -> tuple[FakePool, int]:
        return self, rank

    def kill(self, rank: int) -> None:
        self.dead.add(rank)
        self.epoch[rank] += 1

    def _alive(self, rank: int) -> None:
        if rank in self.dead:
            raise ActorDied(self.config.name, rank, "SIGKILL")

    async def apply_weights(self, rank: int, updates: list[list[bytes]]) -> int:
        self._alive(rank)
        await self._thawed(rank)
        await trio.sleep(0.01)
        self.held[rank] = int(updates[-1][0])
        return self.held[rank]

    async def apply_weights_part(self, rank: int, header: dict[str, Any], frames: list[Any]) -> int:
        self._alive(rank)
        await self._thawed(rank)
        await trio.sleep(0.005)
        if header["seq"] == header["parts"] - 1:
            self.held[rank] = header["version"]
        return self.held[rank]

    def host_of(self, rank: int) -> str | None:
        return None

    def left(self, rank: int) -> bool:
        return False

    async def have_version(self, rank: int) -> int | None:
        self._alive(rank)
        await self._thawed(rank)
        return self.held[rank] if self.held[rank] >= 0 else None

    async def reset_weights(self, rank: int) -> None:
        self._alive(rank)
        self.resets += 1

    async def _thawed(self, rank: int) -> None:
        """A frozen rank answers nothing until it thaws (a SIGSTOPped process)."""
        while rank in self.frozen:
            await self.thawed.wait()

    def freeze(self, rank: int) -> None:
        self.frozen.add(rank)
        self.thawed = trio.Event()

    def thaw(self, rank: int) -> None:
        self.frozen.discard(rank)
        self.thawed.set()

    async def rank_stats(self, rank: int) -> dict[str, Any] | None:
        await self._thawed(rank)
        await trio.sleep(self.stats_s)
        if rank in self.dead:
            return None
        return {
            "tokens_generated": self.tokens[rank],
            "busy_seconds": self.busy[rank],
            "requests_finished": 0,
            "prefill_batches": 0,
        }

    async def ping(self, rank: int) -> None:
        await self._thawed(rank)
        await trio.sleep(0.001)
        self._alive(rank)

    def dead_ranks(self) -> list[int]:
        return sorted(self.dead)

    def starting_ranks(self) -> list[int]:
        return []

    def state_changes(self) -> tuple[int, ...]:
        return tuple(sorted(self.dead))  # tests change `dead` directly: the lists themselves

    def respawn(self, rank: int) -> None:
        self.respawn_calls += 1
        if trio.current_time() < self.down_until:  # its host is unreachable: it stays dead
            return
        self.frozen.discard(rank)  # a fresh process
        self.dead.discard(rank)
        self.held[rank] = -1
        self.tokens[rank], self.busy[rank] = 0, 0.0  # a new process counts from zero
        self.respawns += 1


class FakeEnvs:
    """Plays an episode: waits `episode_s`, generates TOKENS tokens at the rank's version."""

    def __init__(self, episode_s: float = 0.2, fail_rate: float = 0.0, seed: int = 0) -> None:
        self.episode_s = episode_s
        self.fail_rate = fail_rate
        self.rng = random.Random(seed)
        self.started: list[tuple[str, int, int]] = []  # (pool, rank, min_version)

    size = 1

    async def run_episode(
        self,
        pool: FakePool,
        rank: int,
        task: TaskSpec,
        sampling: SamplingParams,
        min_version: int,
        env_rank: int,
        hold: bool = False,
    ) -> Trajectory:
        pool._alive(rank)
        epoch = pool.epoch[rank]
        assert pool.held[rank] >= min_version, "started on weights older than asked for"
        self.started.append((pool.config.name, rank, min_version))
        version = pool.held[rank]
        await trio.sleep(self.episode_s)
        await pool._thawed(rank)
        if pool.epoch[rank] != epoch:
            raise ActorDied(pool.config.name, rank, "SIGKILL")
        pool.tokens[rank] += TOKENS
        pool.busy[rank] += self.episode_s
        failed = self.rng.random() < self.fail_rate
        n = TOKENS
        return Trajectory(
            task=task.task,
            prompt_id=task.prompt_id,
            group_id=task.group_id,
            pool=pool.config.name,
            tokens=torch.arange(n + 1),
            loss_mask=torch.tensor([0] + [1] * n, dtype=torch.bool),
            support_ids=torch.zeros(n, dtype=torch.int32),
            support_offsets=torch.arange(n + 1, dtype=torch.int32),
            support_logq=torch.zeros(n),
            versions=torch.full((n,), version, dtype=torch.int32),
            reward=float(self.rng.random() < 0.5),
            failed=failed,
            error="Traceback...\nValueError: env exploded" if failed else None,
            turns=1,
            seconds=self.episode_s,
        )

    async def ping(self, rank: int) -> None:
        await trio.sleep(0.001)

    def dead_ranks(self) -> list[int]:
        return []

    def starting_ranks(self) -> list[int]:
        return []

    def state_changes(self) -> int:
        return 0

    def respawn(self, rank: int) -> None:
        raise AssertionError("no env rank dies in these tests")


class Metrics:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.written_at: list[float] = []  # trio time of each write

    def write(self, record: dict[str, Any]) -> None:
        self.rows.append(record)
        self.written_at.append(trio.current_time())

    def truncate(self, last_step: int) -> None:
        self.rows = [r for r in self.rows if r["step"] <= last_step]


class Harness:
    """A controller over fakes, with what the tests look at."""

    def __init__(
        self,
        cfg: RunConfig,
        state: ControllerState | None = None,
        *,
        ranks: int = 1,
        envs: FakeEnvs | None = None,
        trainer: FakeTrainer | None = None,
        checkpoints: bool = True,
        handle_sigint: bool = False,
    ) -> None:
        self.cfg = cfg
        self.trainer = trainer or FakeTrainer()
        self.pools = {p.name: FakePool(p, ranks) for p in cfg.pools}
        self.envs = envs or FakeEnvs()
        self.metrics = Metrics()
        self.scheduler = Scheduler(
            cfg.pools,
            ThroughputModel(cfg.pools, ModelSpec(total_params=1e6, active_params=1e6)),
            mean_rollout_tokens=TOKENS,
        )
        self.ledger = CostLedger(cfg.pools)
        self.checkpoints = MemoryCheckpoints(self.trainer) if checkpoints else None
        self.state = state or ControllerState()
        self.trainer.v = self.state.version
        self.controller = Controller(
            cfg,
            Links(trainer=self.trainer, pools=self.pools, envs=self.envs),
            self.state,
            scheduler=self.scheduler,
            ledger=self.ledger,
            metrics=self.metrics,
            progress=Progress(cfg.steps, quiet=True),
            checkpoints=self.checkpoints,
            handle_sigint=handle_sigint,
        )

    def trained(self) -> list[Trajectory]:
        return [t for _, batch in self.trainer.batches for t in batch]

    def staleness(self) -> list[tuple[str, int]]:
        return [(t.pool, v - t.oldest_version) for v, batch in self.trainer.batches for t in batch]
