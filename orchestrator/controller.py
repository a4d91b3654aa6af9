"""The async controller: one trio program that drives trainer, sampler pools and environments.

It spawns a trainer actor, one sampler mesh per pool of the hardware registry and
a mesh of environment actors, then runs, in one nursery:

- the producer, which keeps enough GRPO groups in the rollout buffer and places
  each rollout on a pool chosen by the cost-aware scheduler. Each group gets the
  version the trainer will be at when the group's batch is due (groups are
  trained in order, P per step); its rollouts need weights no older than that
  minus the pool's budget, so work far ahead waits (in the controller, holding no
  sampler slot) for fresh enough weights instead of being generated, going stale
  in the buffer and dropped;
- the training loop, which takes complete groups within their pools' staleness
  budgets (dropping and re-queueing stale trajectories), runs a train step, and
  writes a metrics line;
- one weight-sync worker per sampler, which brings it to the trainer's newest
  version through the weight-sync protocol (deltas or a keyframe) while it keeps
  generating (in-flight updates);
- a SIGINT watcher: the first Ctrl-C finishes the step in progress, checkpoints,
  writes the reports and returns normally; a second one abandons the step.

`mode = "sync"` runs the same parts on-policy and in sequence: generate a batch,
train on it, sync every sampler, repeat.

Cancellation: cancelling `run_controller` tears down every actor process (each
mesh is a structured lifetime). Error handling: an actor that raises fails the
run with its ActorError; a sampler process that dies is respawned and its
rollouts retried.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from orchestrator.buffer import Drop, RolloutBuffer, Slot
from orchestrator.config import RunConfig
from orchestrator.progress import Progress
from orchestrator.runtime import ActorDied, ActorError, span
from orchestrator.telemetry import MetricsLog

__all__ = ["RunResult", "STATE_FILE"]

STATE_FILE = "controller_state.json"


@dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    version: int
    interrupted: bool
    counts: dict[str, int]
    wall_s: float


@dataclass
class _Pool:
    config: Any  # hardware.PoolConfig
    mesh: Any
    versions: list[int]
    in_flight: list[int]

    @property
    def name(self) -> str:
        return self.config.name

    def pick_rank(self) -> int:
        return min(range(len(self.in_flight)), key=lambda r: (self.in_flight[r], r))

    def receiver(self, rank: int) -> str:
        return f"{self.name}/{rank}"


@dataclass
class _Counters:
    step: int = 0
    prompts: int = 0


def _min_version(traj: Any) -> int:
    return int(traj.versions.min()) if traj.versions.numel() else 0


class _Loop:
    """The running controller; see the module docstring."""

    def __init__(self, cfg: RunConfig, trainer: Any, pools: dict[str, _Pool], envs: Any,
                 scheduler: Any, ledger: Any, progress: Progress, metrics: MetricsLog,
                 counters: _Counters, version: int, buffer_state: dict[str, int] | None) -> None:
        from actors.types import SamplingParams, TaskSpec

        self.cfg = cfg
        self.trainer = trainer
        self.pools = pools
        self.envs = envs
        self.scheduler = scheduler
        self.ledger = ledger
        self.progress = progress
        self.metrics = metrics
        self.c = counters
        self.version = version
        self.buffer = RolloutBuffer(cfg.rollout.group_size, _min_version)
        if buffer_state:
            for k, v in buffer_state.items():
                setattr(self.buffer, k, v)
        self._TaskSpec = TaskSpec
        self.sampling = SamplingParams(
            temperature=cfg.recipe.temperature, top_k=cfg.recipe.top_k, top_p=cfg.recipe.top_p,
            min_keep=cfg.recipe.min_keep,
            max_new_tokens=cfg.task.max_new_tokens)
        self._changed = trio.Event()
        self._version_bumped = trio.Event()
        self._train_pending = False
        self.stopping = False
        self.interrupted = False
        self.abandoned = False
        self._step_t0 = time.monotonic()
        self._train_started: float | None = None
        self._train_s_ewma = 0.0
        self._pool_marks: dict[str, tuple[int, float]] = {}
        self._due: dict[str, int] = {}  # group id -> trainer version when its batch is due

    # -- coordination ------------------------------------------------------------
    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _wait_change(self) -> None:
        await self._changed.wait()

    def _bump_versions(self) -> None:
        """Wake the weight-sync workers: the trainer moved on, or a sampler needs a keyframe."""
        self._version_bumped.set()
        self._version_bumped = trio.Event()

    def _budget(self, pool: str) -> int:
        if self.cfg.mode == "sync":
            return 0
        return self.pools[pool].config.staleness_budget

    def _all_synced(self) -> bool:
        return all(v >= self.version for p in self.pools.values() for v in p.versions)

    # -- producer ----------------------------------------------------------------
    def _wanted_groups(self) -> int:
        """Async mode: groups to keep buffered (the next batch plus the run-ahead allowance)."""
        return self.cfg.rollout.prompts_per_step + self.cfg.rollout.max_buffered_groups

    def _new_group(self) -> None:
        i = self.c.prompts
        self.c.prompts += 1
        group_id = f"g{i}"
        # Groups ahead of this one are trained first, P per step; a step in progress
        # (its batch already taken) bumps the version once more before them.
        ahead = self.buffer.groups_buffered // self.cfg.rollout.prompts_per_step
        self._due[group_id] = self.version + ahead + (self._train_started is not None)
        task = self._TaskSpec(task=self.cfg.task.name, prompt_id=f"p{i}", group_id=group_id,
                              seed=self.cfg.seed * 1_000_003 + i, params=self.cfg.task.params)
        self.buffer.add_group(group_id, task.prompt_id, task)

    def _demand(self) -> int:
        """Rollouts the next step still needs that have not finished (in-flight ones count as
        missing: the scheduler weighs them itself)."""
        need = self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size
        return max(0, need - self.buffer.done_rollouts())

    async def _produce(self, nursery: trio.Nursery) -> None:
        while not self.stopping:
            if self.cfg.mode == "sync":
                if self.buffer.groups_buffered == 0 and self._all_synced() and not self._train_pending:
                    for _ in range(self.cfg.rollout.prompts_per_step):
                        self._new_group()
                    self._train_pending = True
            else:
                while self.buffer.groups_buffered < self._wanted_groups():
                    self._new_group()
            slot = self.buffer.next_slot()
            if slot is None:
                await self._wait_change()
                continue
            pool = self._place()
            if pool is None:
                self.buffer.requeue(slot)
                await self._wait_change()
                continue
            min_version = self._need_version(slot, pool)
            if min(self.pools[pool].versions) < min_version:
                # Its weights are not there yet: hold the rollout here rather than let it
                # wait in the sampler, where it would take a slot that work due earlier
                # (a retry) may need.
                self.scheduler.complete(pool)
                self.buffer.requeue(slot)
                await self._wait_change()
                continue
            rank = self.pools[pool].pick_rank()
            self.pools[pool].in_flight[rank] += 1
            nursery.start_soon(self._rollout, slot, pool, rank, min_version)

    def _need_version(self, slot: Slot, pool: str) -> int:
        """The oldest weights a rollout may start on: its group's due version minus the budget."""
        due = max(self.version, self._due.get(slot.group_id, 0))
        return max(0, due - self._budget(pool))

    def _place(self) -> str | None:
        """Ask the cost-aware scheduler; it spills to dearer pools only if the trainer would wait."""
        if self._train_started is not None:  # training now: the next step starts in about this long
            horizon = max(0.0, self._train_s_ewma - (time.monotonic() - self._train_started))
        else:
            horizon = 0.0
        batch = self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size
        consume = batch / self._train_s_ewma if self._train_s_ewma > 0 else 0.0
        self.scheduler.set_trainer(self.version, self._demand(), horizon, consume, batch=batch)
        return self.scheduler.place()

    async def _rollout(self, slot: Slot, pool_name: str, rank: int, min_version: int) -> None:
        pool = self.pools[pool_name]
        task = self.buffer.task_of(slot)
        traj = None
        try:
            with span("rollout", task=task.task, prompt_id=slot.prompt_id, group_id=slot.group_id,
                      sample=slot.index, attempt=slot.attempt, pool=pool_name,
                      gpu=pool.config.gpu, precision=pool.config.precision) as s:
                traj = await self.envs.run_episode.choose(pool.mesh[rank], task, self.sampling, min_version)
                n_gen = traj.num_generated
                oldest = _min_version(traj)
                s.set_attribute("policy_version", oldest)
                s.set_attribute("policy_version_max", int(traj.versions.max()) if n_gen else 0)
                s.set_attribute("staleness", self.version - oldest)
                s.set_attribute("tokens", n_gen)
                s.set_attribute("reward", float(traj.reward))
                s.set_attribute("failed", bool(traj.failed))
        except ActorDied as e:
            # The sampler (or an env process) died: bring it back and retry the rollout.
            self.progress.message(f"actor died during a rollout on {pool_name}/{rank}: {e}; respawning")
            await self._respawn_dead(pool)
            self.buffer.requeue(slot)
        finally:
            pool.in_flight[rank] -= 1
            self.scheduler.complete(pool_name, traj.num_generated if traj is not None else None)
            if traj is not None:
                drop = self.buffer.complete(slot, traj)
                if drop is not None:
                    self._trace_drops([drop])
            self._notify()

    async def _respawn_dead(self, pool: _Pool) -> None:
        """Bring back whatever died (the sampler rank, env ranks); a respawned sampler holds no
        weights, so its sync worker sends it a keyframe before it admits new work."""
        for dead in pool.mesh.dead_ranks:
            pool.mesh.respawn(dead)
            pool.versions[dead] = -1
            self._bump_versions()
        for dead in self.envs.dead_ranks:
            self.envs.respawn(dead)
        await trio.lowlevel.checkpoint()

    def _trace_drops(self, drops: list[Drop]) -> None:
        for d in drops:
            with span("rollout.dropped", pool=d.pool, reason=d.reason, group_id=d.slot.group_id,
                      prompt_id=d.slot.prompt_id, staleness=d.staleness if d.staleness is not None else -1,
                      error=d.error or ""):
                pass

    # -- weights -----------------------------------------------------------------
    async def _sync_worker(self, pool: _Pool, rank: int) -> None:
        """Keep sampler `rank` of `pool` at the trainer's version: deltas, or a keyframe when
        it holds nothing trustworthy (start, respawn, a refused delta)."""
        receiver = pool.receiver(rank)
        while True:
            while pool.versions[rank] >= self.version:
                await self._version_bumped.wait()
            have = pool.versions[rank]
            try:
                with span("weights.apply", pool=pool.name, rank=rank, precision=pool.config.precision,
                          from_version=have, to_version=self.version) as s:
                    updates = await self.trainer.updates_for.call_one(receiver, have, pool.config.precision)
                    now = await pool.mesh[rank].apply_weights.call_one(updates)
                    s.set_attribute("messages", len(updates))
                    s.set_attribute("wire_bytes", sum(len(f) for u in updates for f in u))
            except ActorDied:
                if rank in pool.mesh.dead_ranks:
                    self.progress.message(f"sampler {receiver} died; respawning it")
                    pool.mesh.respawn(rank)
                pool.versions[rank] = -1
                continue
            except ActorError as e:
                # The sampler refused the update (hash mismatch, gap): it keeps its last good
                # weights; ask for a keyframe next.
                self.progress.message(f"sampler {receiver} refused weights ({e}); sending a keyframe")
                pool.versions[rank] = -1
                continue
            await self.trainer.ack.call_one(receiver, now)
            pool.versions[rank] = now
            self.scheduler.set_pool_version(pool.name, min(pool.versions))
            self._notify()

    # -- training ----------------------------------------------------------------
    async def _train_loop(self) -> None:
        n = self.cfg.rollout.prompts_per_step
        while self.c.step < self.cfg.steps and not self.stopping:
            groups, drops = self.buffer.take_batch(n, self.version, self._budget)
            self._trace_drops(drops)
            if not groups:
                await self._wait_change()
                continue
            await self._train_on(groups)

    async def _train_on(self, groups: list[Any]) -> None:
        for g in groups:
            self._due.pop(g.group_id, None)
        trajs = [traj for g in groups for _, traj in sorted(g.done.values(), key=lambda st: st[0].index)]
        stale = [self.version - _min_version(t) for t in trajs]
        self._train_started = time.monotonic()
        with span("train_step", version=self.version, batch=len(trajs),
                  staleness_mean=sum(stale) / len(stale), staleness_max=max(stale)) as s:
            result = await self.trainer.train_step.call_one(trajs)
            s.set_attribute("loss", result.loss)
            s.set_attribute("grad_norm", result.grad_norm)
            s.set_attribute("mismatch_kl", result.overall.mismatch_kl)
            s.set_attribute("masked_fraction", result.overall.masked_fraction)
            s.set_attribute("applied", result.applied)
        took = time.monotonic() - self._train_started
        self._train_s_ewma = took if self._train_s_ewma == 0 else 0.7 * self._train_s_ewma + 0.3 * took
        self._train_started = None
        self.version = result.version
        self.c.step += 1
        self._train_pending = False
        self._bump_versions()
        await self._account(trajs, stale, result)
        self._notify()

    async def _account(self, trajs: list[Any], stale: list[int], result: Any) -> None:
        now = time.monotonic()
        pool_stats = {}
        for name, pool in self.pools.items():
            stats = await pool.mesh.stats.call()
            busy = sum(st["busy_seconds"] for st in stats)
            tokens = sum(st["tokens_generated"] for st in stats)
            prev_tokens, prev_busy = self._pool_marks.get(name, (0, 0.0))
            d_tok, d_busy = tokens - prev_tokens, busy - prev_busy
            self._pool_marks[name] = (tokens, busy)
            self.ledger.record_busy(name, seconds=d_busy)
            if d_busy > 0 and d_tok > 0:
                self.scheduler.observe(name, tokens=d_tok, gpu_seconds=d_busy * pool.config.count)
            pool_stats[name] = {"tokens_per_s": d_tok / max(now - self._step_t0, 1e-9),
                                "busy_s": busy, "tokens": tokens,
                                "requests": sum(st["requests_finished"] for st in stats),
                                "prefill_batches": sum(st["prefill_batches"] for st in stats)}
        by_pool: dict[str, list[int]] = {}
        for t, st in zip(trajs, stale):
            by_pool.setdefault(t.pool, []).append(st)
            self.ledger.record_rollout(t.pool, tokens=int(t.versions.numel()), staleness=st)
        per_pool_metrics = result.per_pool
        for name, m in per_pool_metrics.items():
            self.ledger.record_mismatch(name, kl=m.mismatch_kl, masked_fraction=m.masked_fraction,
                                        tokens=m.tokens)
        rewards = [float(t.reward) for t in trajs]
        record = {
            "step": self.c.step, "version": self.version, "wall_s": round(now - self._t_start, 3),
            "reward_mean": sum(rewards) / len(rewards), "rollouts": len(trajs),
            "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
            "dropped_stale": self.buffer.dropped_stale, "dropped_failed": self.buffer.dropped_failed,
            "dropped_total": self.buffer.dropped_stale + self.buffer.dropped_failed,
            "loss": result.loss, "grad_norm": result.grad_norm,
            "mismatch_kl": result.overall.mismatch_kl, "masked_fraction": result.overall.masked_fraction,
            "mean_weight": result.overall.mean_weight, "entropy": result.overall.entropy,
            "train_s": result.seconds, "cost_usd": self.ledger.report().totals.cost_usd,
            "pools": {name: {**pool_stats[name],
                             "staleness_mean": (sum(by_pool[name]) / len(by_pool[name])) if name in by_pool else None,
                             "staleness_max": max(by_pool[name]) if name in by_pool else None,
                             "rollouts": len(by_pool.get(name, [])),
                             "mismatch_kl": getattr(per_pool_metrics.get(name), "mismatch_kl", None),
                             "masked_fraction": getattr(per_pool_metrics.get(name), "masked_fraction", None)}
                      for name in self.pools},
        }
        self.metrics.write(record)
        self.progress.step(record)
        self._step_t0 = now

    # -- lifetime ----------------------------------------------------------------
    async def _watch_sigint(self, cancel_scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            async for _ in signals:
                if not self.stopping:
                    self.progress.message("interrupt: finishing the current step, then checkpointing "
                                          "(Ctrl-C again to abandon it)")
                    self.stopping = self.interrupted = True
                    self._notify()
                else:
                    self.abandoned = True
                    cancel_scope.cancel()

    async def run(self) -> None:
        self._t_start = time.monotonic()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_sigint, nursery.cancel_scope)
            for pool in self.pools.values():
                for rank in range(len(pool.versions)):
                    nursery.start_soon(self._sync_worker, pool, rank)
            # Rollouts start in this same nursery: leaving it abandons the ones in flight,
            # whose slots stay counted as buffered.
            nursery.start_soon(self._produce, nursery)
            await self._train_loop()
            nursery.cancel_scope.cancel()


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)
