"""What the controller's tasks share: links, state, buffer, per-pool views (`_pools`) and wake-ups."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import trio

from actors.types import SamplingParams, TaskSpec, TrajectoryRef
from hardware import CostLedger, Scheduler
from orchestrator.controller._hedge import Hedger
from orchestrator.controller._liveness import Health, respawn_due
from orchestrator.controller._pools import Loads, PoolView
from orchestrator.controller._stream import PendingAcks, SharedPaths
from orchestrator.controller.links import Checkpointer, Links
from orchestrator.controller.state import ControllerState
from orchestrator.runtime import ActorDied, span
from orchestrator.state.buffer import Drop, RolloutBuffer
from orchestrator.state.config import RunConfig
from orchestrator.state.progress import Progress

__all__ = ["DECISIONS_KEPT", "Backoff", "RunContext"]

DECISIONS_KEPT = 4096


@dataclass
class Backoff:
    """Exponential waits between retries of something that keeps failing (a dead actor):
    no loop ever spins on one."""

    first: float = 0.05
    cap: float = 2.0
    _next: float = field(default=0.0, init=False)

    async def wait(self) -> None:
        self._next = min(self.cap, self._next * 2) if self._next else self.first
        await trio.sleep(self._next)

    def reset(self) -> None:
        self._next = 0.0


class RunContext:
    """State shared by the producer, the trainer loop, the weight-sync workers and the
    signal watcher. Single trio thread: no locks; changes are announced with `notify`."""

    def __init__(
        self,
        cfg: RunConfig,
        links: Links,
        state: ControllerState,
        *,
        scheduler: Scheduler,
        ledger: CostLedger,
        metrics: Any,
        progress: Progress,
        checkpoints: Checkpointer | None = None,
    ) -> None:
        self.cfg = cfg
        self.links = links
        self.state = state
        self.scheduler = scheduler
        self.ledger = ledger
        self.metrics = metrics
        self.progress = progress
        self.checkpoints = checkpoints
        self.buffer = RolloutBuffer(
            cfg.rollout.group_size,
            counters=state.buffer,
            filter_zero_variance=cfg.rollout.filter_zero_variance,
            max_zero_variance_drops=cfg.rollout.zero_variance_drop_bound,
        )
        self.pools = {name: PoolView.of(link) for name, link in links.pools.items()}
        self._told_scheduler: dict[str, int] = {}  # the held version `update_scheduler` last told
        # Each pool's staleness budget (0 in sync mode): read several times per placement.
        self.budgets = {
            name: 0 if cfg.mode == "sync" else link.config.staleness_budget for name, link in links.pools.items()
        }
        self.env_health = [Health(f"environment actor {r}", on_flip=self._env_flipped) for r in range(links.envs.size)]
        self._env_flips = 0
        self._env_cache: tuple[Any, list[int]] | None = None
        self.trainer_health = Health("trainer")
        self.env_in_flight = Loads(links.envs.size)  # episodes running on each env rank
        self.nursery: trio.Nursery | None = None  # the controller's, for background calls
        self.sampling = SamplingParams(
            temperature=cfg.recipe.temperature,
            top_k=cfg.recipe.top_k,
            top_p=cfg.recipe.top_p,
            min_keep=cfg.recipe.min_keep,
            max_new_tokens=cfg.task.max_new_tokens,
        )
        self.due: dict[str, int] = {}  # group id -> trainer version when its batch is due
        self.replay: list[TaskSpec] = list(state.buffered)  # prompts to play before new ones
        self.dataset: Any = None  # actors.env.TaskDataset of `[task] dataset`, or None
        self.eval_dataset: Any = None  # held-out rows of `[task] eval_dataset`, or None
        self.rollout_scopes: set[trio.CancelScope] = set()
        self.hedger = Hedger(cfg.faults.hedge_after_p90, cfg.faults.hedge_min_s, self.pools)
        self.paths = SharedPaths(links.trainer)  # weight paths, one trainer call per (precision, held)
        self.acks = PendingAcks()  # applied versions the trainer is told in batches (`ack_worker`)
        # Nanoseconds (wall) of the producer's latest placement decisions (slot -> pool,
        # rank, env rank): a bounded window for benchmarks and diagnostics.
        self.decision_ns: deque[int] = deque(maxlen=DECISIONS_KEPT)
        self.stopping = False
        self.interrupted = False
        self.abandoned = False
        self.failure: str | None = None  # why the run stopped itself (episodes kept failing)
        self.failed_in_a_row = 0
        self.train_pending = False  # sync mode: a batch was issued and not trained yet
        self.train_started: float | None = None
        self.train_s_ewma = 0.0
        self.accounted = trio.Event()  # set while no trained step's record is still being written
        self.accounted.set()
        self.counters_wait = trio.CancelScope()  # cancelled: that record waits no longer for pool counters
        self.t_start = trio.current_time()
        self.step_t0 = self.t_start
        self.last_checkpoint_t = self.t_start
        self.progress_t = self.t_start  # when a rollout last finished or a step was trained (`_stall`)
        self.trainer_alive = trio.Event()
        self.trainer_alive.set()
        self.trainer_death: ActorDied | None = None  # seen by a weight-sync call (see report_trainer_death)
        self._changed = trio.Event()
        self._bumped = trio.Event()
        self.host_mark: dict[str, float] = {}  # per pool: when hosts' presence was last recorded

    def report_trainer_death(self, death: ActorDied) -> None:
        """A call other than a train step found the trainer dead (the caller checked
        ``TrainerLink.is_dead``: a sampler already respawned must not pass for it). The trainer loop restores
        it: otherwise a death between steps would go unnoticed whenever no batch is ready,
        and none gets ready while the samplers wait for weights from the dead trainer.
        Ignored while a restore is under way (it is that death, or the next one's train
        step will tell)."""
        if self.trainer_alive.is_set() and self.trainer_death is None:
            self.trainer_death = death
            self.notify()

    # -- held trajectories (actors.held) ---------------------------------------------
    def release(self, trained: list[Any] | None = None) -> None:
        """In the background, let the environment actors forget `trained` and whatever the
        buffer let go untrained since the last call (held trajectories only)."""
        refs = [t for t in [*(trained or ()), *self.buffer.take_discarded()] if isinstance(t, TrajectoryRef) and t.key]
        if refs and self.nursery is not None:
            self.nursery.start_soon(self.links.envs.release, refs)

    def drop_lost(self, lost: Any, why: str) -> None:
        """Re-queue the rollouts of buffered trajectories for which `lost(traj)` holds: their
        holder no longer has them (`why`)."""
        drops = self.buffer.drop_lost(lost)
        if drops:
            self.trace_drops(drops)
            self.progress.message(f"{len(drops)} finished rollout(s) lost before training ({why}); replaying them")
            self.notify()

    # -- wake-ups --------------------------------------------------------------------
    def notify(self) -> None:
        """Something the producer or trainer loop waits on changed."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_change(self) -> None:
        await self._changed.wait()

    def bump_versions(self) -> None:
        """Wake the weight-sync workers: the trainer moved on, or a sampler needs a keyframe."""
        self._bumped.set()
        self._bumped = trio.Event()

    async def wait_bump(self) -> None:
        await self._bumped.wait()

    # -- views -----------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.state.version

    def budget(self, pool: str) -> int:
        return self.budgets[pool]

    def all_synced(self) -> bool:
        """Every sampler that answers holds the trainer's version (sync mode waits for it;
        an unresponsive or restarting rank is not waited for)."""
        for p in self.pools.values():
            down = set(p.link.dead_ranks()) | set(p.link.starting_ranks())
            if any(v < self.version for r, v in enumerate(p.versions) if p.health[r].responsive and r not in down):
                return False
        return True

    def usable_envs(self) -> list[int]:
        """Environment ranks that can take an episode now: constructed and answering
        (recomputed only when one turned (un)responsive, died or started)."""
        envs = self.links.envs
        key = (self._env_flips, envs.state_changes())
        if self._env_cache is None or self._env_cache[0] != key:
            down = set(envs.dead_ranks()) | set(envs.starting_ranks())
            ok = [r for r, h in enumerate(self.env_health) if h.since is None and r not in down]
            self._env_cache = (key, ok)
        return self._env_cache[1]

    def pick_env(self) -> int | None:
        """The environment rank for the next episode: usable, fewest episodes in flight
        (ties: the lowest rank); None when none is."""
        return self.env_in_flight.least(self.usable_envs())

    def _env_flipped(self) -> None:
        self._env_flips += 1

    def update_scheduler(self) -> None:
        """Tell the scheduler which pools can take rollouts and the weights they hold."""
        told = self._told_scheduler  # runs once per placement decision: tell changes only
        for name, view in self.pools.items():
            held = view.held_version()
            if told.get(name) != held:
                told[name] = held
                self.scheduler.set_available(name, held >= 0)
                if held >= 0:
                    self.scheduler.set_pool_version(name, held)

    def now(self) -> float:
        return trio.current_time()

    def trace_drops(self, drops: list[Drop]) -> None:
        for d in drops:
            with span(
                "rollout.dropped",
                pool=d.pool,
                reason=d.reason,
                group_id=d.slot.group_id,
                prompt_id=d.slot.prompt_id,
                staleness=-1 if d.staleness is None else d.staleness,
                error=d.error or "",
            ):
                pass

    @property
    def failure_limit(self) -> int:
        """`[task] max_failed_in_a_row`, else 4 groups' worth of episodes beyond what can be
        in flight at once: a sampler killed mid-run fails every episode it was serving, a
        burst that must not pass for a broken environment."""
        given = self.cfg.task.max_failed_in_a_row
        if given is not None:
            return given
        in_flight = sum(p.capacity for p in self.cfg.pools)
        return 4 * self.cfg.rollout.group_size + in_flight

    def episode_ended(self, error: str | None) -> None:
        """Count an episode's outcome (``error`` None: it succeeded). `max_failed_in_a_row`
        failures with no success between them stop the run: the step in progress finishes,
        the run checkpoints, writes its reports and ends with `failure` set, naming the
        last error, instead of retrying a broken environment forever. Rollouts lost with a
        dead or frozen actor are not episodes that failed: respawning handles those."""
        if error is None:
            self.failed_in_a_row = 0
            return
        self.failed_in_a_row += 1
        limit = self.failure_limit
        if self.failed_in_a_row >= limit and self.failure is None:
            last = _one_line(error)
            self.failure = (
                f"{self.failed_in_a_row} episodes failed in a row with none succeeding "
                f"([task] max_failed_in_a_row = {limit}); the last: {last}"
            )
            self.stopping = True
            self.notify()

    def respawn_dead(self) -> None:
        """Bring back every dead sampler and env rank, each no sooner than its back-off
        allows (`_liveness.respawn_due`). A respawned sampler holds no weights: its sync
        worker sends it a keyframe before any rollout that needs them starts."""
        for pool in self.pools.values():
            for rank in pool.link.dead_ranks():
                if not self.retire_if_lost(pool, rank) and respawn_due(self, pool.health[rank]):
                    self.respawn_sampler(pool, rank)
        for rank in self.links.envs.dead_ranks():
            self.drop_lost(lambda t, rank=rank: isinstance(t, TrajectoryRef) and t.holder == rank, f"env[{rank}] died")
            if respawn_due(self, self.env_health[rank]):
                self.links.envs.respawn(rank)

    def host_stats(self, name: str, now: float) -> dict[str, Any]:
        """A pool's `up`, `hosts`, `outages`, `outage_s`, `hedges` and `hedges_won` for this
        step's metrics; records in the cost ledger the time each of its hosts was present
        since the last call."""
        pool = self.pools[name]
        dt = max(0.0, now - self.host_mark.get(name, self.t_start))
        self.host_mark[name] = now
        for host in pool.present_hosts():
            self.ledger.record_presence(name, host, dt)
        return {**pool.outage_stats(now), **self.hedger.stats(name)}

    def retire_if_lost(self, pool: PoolView, rank: int) -> bool:
        """Whether sampler `rank` of `pool` is given up: its host left the run (SIGTERM), or it
        is on a `flotilla host` and lost for `[faults] host_give_up_after_s`. Given up now:
        one line, a `sampler.outage` span (outcome "left" or "given_up"), no more respawns
        or work; an elastic pool may place another host on the rank."""
        health = pool.health[rank]
        if health.retired:
            return True
        if health.host is not None and rank in pool.link.dead_ranks() and pool.link.left(rank):
            health.retire()
            health.lost(self.now())
            health.end_outage(self.now(), pool.name, rank, outcome="left")
            self.progress.message(
                f"{health.label}: its host {health.host} left the run (drained; its rollouts go "
                f"to the other samplers); {len(pool.usable())} of the pool's {pool.link.size} samplers usable"
            )
            self.update_scheduler()
            self.notify()
            return True
        limit = self.cfg.faults.host_give_up_after_s
        if health.host is None or health.lost_at is None or self.now() - health.lost_at < limit:
            return False
        health.retire()
        seconds = health.end_outage(self.now(), pool.name, rank, outcome="given_up")
        left = len(pool.usable())
        self.progress.message(
            f"{health.label}: its host {health.host} has not answered for {seconds:.0f} s "
            f"([faults] host_give_up_after_s); giving it up, the run goes on "
            f"({left} of the pool's {pool.link.size} samplers usable)"
        )
        self.update_scheduler()
        self.notify()
        return True

    def respawn_sampler(self, pool: PoolView, rank: int) -> None:
        """A fresh process for sampler `rank` of `pool` (its old one stopped, if any)."""
        pool.link.respawn(rank)
        pool.versions[rank] = -1
        pool.marks[rank] = (0, 0.0)  # a fresh process counts from zero
        pool.stats[rank] = None
        pool.epochs[rank] += 1
        self.bump_versions()

    def cancel_rollouts(self) -> None:
        for scope in list(self.rollout_scopes):
            scope.cancel()

    def horizon(self) -> float:
        """Seconds until the trainer next wants a batch (0 when it waits now)."""
        if self.train_started is None:
            return 0.0
        return max(0.0, self.train_s_ewma - (self.now() - self.train_started))

    def consume_rate(self) -> float:
        batch = self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size
        return batch / self.train_s_ewma if self.train_s_ewma > 0 and math.isfinite(self.train_s_ewma) else 0.0


def _one_line(text: str, limit: int = 800) -> str:
    """A multi-line error (a traceback's tail) as one line: its first line and its last ones."""
    lines = [" ".join(line.split()) for line in text.splitlines() if line.strip()]
    if len(lines) > 5:
        lines = [lines[0], "…", *lines[-4:]]
    out = " | ".join(lines)
    return out if len(out) <= limit else out[: limit // 3] + " … " + out[-(2 * limit // 3) :]
