"""The controller: one trio program that drives the trainer, sampler pools and environments.

It runs, in one nursery: the producer (`_producer`), the trainer loop (`_training`),
one weight-sync worker per sampler (`_weights`), a supervisor that respawns dead
sampler and env ranks even when nothing is calling them, a liveness watcher per sampler
and env rank (`_liveness`: a frozen actor is named, avoided and rejoins), and the Ctrl-C watcher
(`_signals`), and with `[eval] every` the evaluation loop (`orchestrator.controller.evaluation`). `mode = "sync"` runs the same parts on-policy and in sequence: generate
a batch, train on it, sync every sampler, repeat.

Cancellation: cancelling `run` abandons the rollouts in flight (the meshes behind the
links are the caller's to close). Errors: an actor that raises fails the run with its
ActorError; dead samplers and env actors are respawned and their rollouts retried; a
dead trainer is restored from the last checkpoint up to `[checkpoint] max_restarts`
times (`TrainerLost` past that).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from hardware import CostLedger, Scheduler
from orchestrator.controller._context import RunContext
from orchestrator.controller._elastic import elastic_worker
from orchestrator.controller._liveness import watch
from orchestrator.controller._producer import produce
from orchestrator.controller._signals import request_stop, watch_sigint
from orchestrator.controller._stall import watch_progress
from orchestrator.controller._training import checkpoint, train_loop
from orchestrator.controller._weights import ack_worker, sync_worker
from orchestrator.controller.evaluation import eval_loop
from orchestrator.controller.links import Checkpointer, Links
from orchestrator.controller.state import ControllerState
from orchestrator.state.config import RunConfig
from orchestrator.state.progress import Progress

__all__ = ["Controller", "MetricsSink"]

SUPERVISE_EVERY_S = 0.5
GC_GEN0 = 50_000
"""Allocations between two young-generation collections while the controller runs."""


def _live(link: Any, rank: int) -> bool:
    """The rank is constructed: neither dead nor (re)starting."""
    return rank not in link.dead_ranks() and rank not in link.starting_ranks()


class MetricsSink:
    """Where step records go (`orchestrator.state.telemetry.MetricsLog` in a run)."""

    def write(self, record: dict[str, Any]) -> None: ...

    def truncate(self, last_step: int) -> None: ...


@dataclass
class _Wiring:
    scheduler: Scheduler
    ledger: CostLedger
    metrics: MetricsSink
    progress: Progress
    checkpoints: Checkpointer | None = None


class Controller:
    """Drives one run to `cfg.steps` over `links`, starting from `state` (see the module
    docstring). `checkpoints` None: no periodic checkpoints, and a dead trainer ends the run.
    """

    def __init__(
        self,
        cfg: RunConfig,
        links: Links,
        state: ControllerState,
        *,
        scheduler: Scheduler,
        ledger: CostLedger,
        metrics: MetricsSink,
        progress: Progress,
        checkpoints: Checkpointer | None = None,
        handle_sigint: bool = True,
        dataset: Any = None,
        eval_dataset: Any = None,
    ) -> None:
        self.ctx = RunContext(
            cfg,
            links,
            state,
            scheduler=scheduler,
            ledger=ledger,
            metrics=metrics,
            progress=progress,
            checkpoints=checkpoints,
        )
        self.ctx.dataset = dataset  # TaskDataset rows become TaskSpec.params (`task_for`)
        self.ctx.eval_dataset = eval_dataset
        self._handle_sigint = handle_sigint

    @property
    def state(self) -> ControllerState:
        return self.ctx.state

    @property
    def interrupted(self) -> bool:
        return self.ctx.interrupted

    @property
    def abandoned(self) -> bool:
        return self.ctx.abandoned

    @property
    def failure(self) -> str | None:
        """Why the run stopped itself before `cfg.steps` (episodes kept failing), or None."""
        return self.ctx.failure

    @property
    def restoring_trainer(self) -> bool:
        """A dead trainer is being restored from the last checkpoint now."""
        return not self.ctx.trainer_alive.is_set()

    def counts(self) -> dict[str, int]:
        return self.ctx.buffer.counts()

    def stop(self) -> None:
        """What the first Ctrl-C does: finish the step in progress, then return."""
        request_stop(self.ctx)

    async def checkpoint(self) -> None:
        """Checkpoint now (the run's end, an interrupt): trainer and controller state."""
        await checkpoint(self.ctx)

    async def run(self) -> None:
        # The controller holds many long-lived objects (buffered trajectories, a task per
        # rollout in flight): with the default thresholds the cyclic collector's full passes
        # over them cost it a large share of its CPU. Objects alive at the start are frozen
        # out of collection and young collections run less often; both are restored after.
        thresholds = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(max(thresholds[0], GC_GEN0), *thresholds[1:])
        try:
            await self._run()
        except BaseExceptionGroup as group:
            # One failure from a task of the run (the usual case): raise it as itself, so a
            # caller can catch TrainerLost or ActorError.
            if len(group.exceptions) == 1 and not isinstance(group.exceptions[0], BaseExceptionGroup):
                raise group.exceptions[0] from None
            raise
        finally:
            gc.set_threshold(*thresholds)
            gc.unfreeze()

    async def _run(self) -> None:
        ctx = self.ctx
        async with trio.open_nursery() as nursery:
            ctx.nursery = nursery
            if self._handle_sigint:
                await nursery.start(watch_sigint, ctx, nursery.cancel_scope)
            nursery.start_soon(self._supervise)
            if ctx.cfg.faults.stall_warn_s is not None:
                nursery.start_soon(watch_progress, ctx, ctx.cfg.faults.stall_warn_s)
            self._start_watchers(nursery)
            nursery.start_soon(ack_worker, ctx)
            for pool in ctx.pools.values():
                for rank in range(len(pool.versions)):
                    nursery.start_soon(sync_worker, ctx, pool, rank)
                if pool.link.config.elastic:
                    nursery.start_soon(elastic_worker, ctx, pool)
            # Rollouts start in this same nursery: leaving it abandons the ones in flight,
            # whose slots stay counted as buffered.
            nursery.start_soon(produce, ctx, nursery)
            evals_done = trio.Event()
            if ctx.cfg.eval.every:
                nursery.start_soon(eval_loop, ctx, evals_done)
            else:
                evals_done.set()
            await train_loop(ctx)
            if ctx.failure is None:
                await evals_done.wait()  # an evaluation due at the last step finishes first
            nursery.cancel_scope.cancel()

    def _start_watchers(self, nursery: trio.Nursery) -> None:
        """One liveness watcher per sampler rank and env rank, and one for the trainer,
        which is named but never given up on (its death is the restore path's)
        (`_liveness.watch`)."""
        ctx = self.ctx
        trainer = ctx.links.trainer
        nursery.start_soon(
            watch,
            ctx,
            ctx.trainer_health,
            trainer.ping,
            lambda: ctx.trainer_alive.is_set() and not trainer.is_dead(),
            None,
            "training waits for it",
        )
        for pool in ctx.pools.values():
            link = pool.link
            for rank, health in enumerate(pool.health):
                nursery.start_soon(
                    watch,
                    ctx,
                    health,
                    partial(link.ping, rank),
                    partial(_live, link, rank),
                    partial(ctx.respawn_sampler, pool, rank),
                    "its rollouts go to the ranks that answer; waiting for it",
                    (pool.name, rank),
                    partial(ctx.retire_if_lost, pool, rank),
                )
        envs = ctx.links.envs
        for rank, health in enumerate(ctx.env_health):
            nursery.start_soon(
                watch,
                ctx,
                health,
                partial(envs.ping, rank),
                partial(_live, envs, rank),
                partial(envs.respawn, rank),
                "its episodes go to the environment actors that answer; waiting for it",
            )

    async def _supervise(self) -> None:
        """Respawn ranks that died while nothing was calling them."""
        while True:
            await trio.sleep(SUPERVISE_EVERY_S)
            self.ctx.respawn_dead()
