"""The trainer loop: batches within budget, one train step each, a metrics line, checkpoints.

It takes P complete groups whose every trajectory is within its pool's staleness budget
(stale ones are dropped and their slots re-queued), runs a train step, accounts tokens,
busy time and cost per pool, and writes the step's metrics line. Every
`[checkpoint] every_steps` steps or `every_s` seconds it checkpoints.

Trainer death: the batch goes back to the buffer, every rollout in flight is cancelled
and re-queued (its weights are gone), and the trainer is restored from the last
checkpoint, up to `[checkpoint] max_restarts` times; the steps since that checkpoint are
trained again. Past the limit the loop raises `TrainerLost`, naming the actor. A death
seen between steps, by a weight-sync call (`RunContext.report_trainer_death`), is
restored the same way, without waiting for a batch that could not come; so is a death
during a checkpoint save (the previous complete checkpoint survives it).

No step waits on a sampler: its counters are asked for with a deadline
(`_liveness.refresh_stats`), and a rank that misses it is accounted at a later step. Nor
does the trainer wait for that accounting: a step's metrics line is completed and written
beside the next step (one at a time, in step order), and a checkpoint or the run's end
waits for the last one.
"""

from __future__ import annotations

from typing import Any

import trio

from actors.trainer import StepResult, memory_line
from actors.types import MissingTrajectories, Trajectory, TrajectoryRef
from orchestrator.controller._context import Backoff, RunContext
from orchestrator.controller._liveness import refresh_stats
from orchestrator.runtime import ActorDied, span
from orchestrator.state.buffer import Group

__all__ = ["TrainerLost", "checkpoint", "train_loop"]


class TrainerLost(RuntimeError):
    """The trainer died more often than `[checkpoint] max_restarts` allows."""


async def train_loop(ctx: RunContext) -> None:
    n = ctx.cfg.rollout.prompts_per_step
    while ctx.state.step < ctx.cfg.steps and not ctx.stopping:
        if ctx.trainer_death is not None:  # found by a weight-sync call between steps
            await restart_trainer(ctx, ctx.trainer_death)
            continue
        groups, drops = ctx.buffer.take_batch(n, ctx.version, ctx.budget)
        ctx.trace_drops(drops)
        if drops:
            ctx.release()  # stale ones the environment actors hold
        if drops:  # their slots are queued again: the producer has work it did not see
            ctx.notify()
        if not groups:
            await ctx.wait_change()
            continue
        await _train_on(ctx, groups)
    await ctx.accounted.wait()  # the last step's record is written before the run ends


async def _train_on(ctx: RunContext, groups: list[Group]) -> None:
    trajs = [traj for g in groups for _, traj in sorted(g.done.values(), key=lambda st: st[0].index)]
    stale = [ctx.version - t.oldest_version for t in trajs]
    ctx.train_started = ctx.now()
    try:
        with span(
            "train_step",
            version=ctx.version,
            batch=len(trajs),
            staleness_mean=sum(stale) / len(stale),
            staleness_max=max(stale),
        ) as s:
            result = await ctx.links.trainer.train_step(trajs)
            if isinstance(result, MissingTrajectories):
                s.set_attribute("missing", len(result.keys))
            else:
                s.set_attribute("loss", result.loss)
                s.set_attribute("grad_norm", result.grad_norm)
                s.set_attribute("mismatch_kl", result.overall.mismatch_kl)
                s.set_attribute("masked_fraction", result.overall.masked_fraction)
                s.set_attribute("applied", result.applied)
    except ActorDied as e:
        ctx.train_started = None
        ctx.buffer.put_back(groups)
        await restart_trainer(ctx, e)
        return
    if isinstance(result, MissingTrajectories):  # nothing trained; a holder lost them
        ctx.train_started = None
        ctx.buffer.put_back(groups)
        lost = set(result.keys)
        ctx.drop_lost(lambda t: isinstance(t, TrajectoryRef) and t.key in lost, result.reason)
        ctx.respawn_dead()
        return
    took = ctx.now() - ctx.train_started
    ctx.train_s_ewma = took if ctx.train_s_ewma == 0 else 0.7 * ctx.train_s_ewma + 0.3 * took
    ctx.train_started = None
    for g in groups:
        ctx.due.pop(g.group_id, None)
    ctx.state.version = result.version
    ctx.state.step += 1
    ctx.progress_t = ctx.now()
    ctx.train_pending = False
    ctx.bump_versions()
    ctx.release(trajs)
    # The step's record is written beside the next step: its pool counters get up to
    # STATS_WAIT_S to come back, or until the next step is trained, whichever is first
    # (the trainer never waits for them). One step's accounting at a time, in step order.
    ctx.counters_wait.cancel()
    await ctx.accounted.wait()
    ctx.accounted, ctx.counters_wait = trio.Event(), trio.CancelScope()
    now = ctx.now()
    record = _step_record(ctx, trajs, stale, result, now)
    ctx.nursery.start_soon(_account, ctx, record, trajs, stale, result, now, ctx.counters_wait)
    ctx.notify()
    if _checkpoint_due(ctx):
        try:
            await checkpoint(ctx)
        except ActorDied as e:
            # The trainer died while saving: the replacement sequence keeps the previous
            # complete checkpoint, and the trainer is restored from it like any death.
            await restart_trainer(ctx, e)


def _checkpoint_due(ctx: RunContext) -> bool:
    c = ctx.cfg.checkpoint
    if ctx.checkpoints is None or ctx.state.step >= ctx.cfg.steps:
        return False  # the run's end checkpoints anyway
    by_steps = c.every_steps is not None and ctx.state.step % c.every_steps == 0
    by_time = c.every_s is not None and ctx.now() - ctx.last_checkpoint_t >= c.every_s
    return by_steps or by_time


async def checkpoint(ctx: RunContext) -> None:
    """The trainer's state and the controller's, as one checkpoint (after the last trained
    step's record, so the checkpointed ledger holds its rollouts)."""
    await ctx.accounted.wait()
    ctx.state.buffered = ctx.buffer.buffered_prompts()
    ctx.state.ledger = ctx.ledger.state()
    ctx.state.scheduler = ctx.scheduler.state()
    with span("checkpoint", step=ctx.state.step, version=ctx.version):
        await ctx.checkpoints.save(ctx.links.trainer, ctx.state)
    ctx.last_checkpoint_t = ctx.now()


async def restart_trainer(ctx: RunContext, death: ActorDied) -> None:
    limit = ctx.cfg.checkpoint.max_restarts if ctx.checkpoints is not None else 0
    ctx.trainer_alive = trio.Event()  # the producer and the sync workers hold off
    ctx.cancel_rollouts()
    backoff = Backoff()
    while True:
        if ctx.state.trainer_restarts >= limit:
            raise TrainerLost(
                f"the trainer actor died ({death.reason}) and {limit} restart(s) "
                f"are used up; the last checkpoint is in the run directory"
            )
        ctx.state.trainer_restarts += 1
        ctx.progress.message(
            f"trainer died ({death.reason}); restoring it from the last "
            f"checkpoint (restart {ctx.state.trainer_restarts} of {limit})"
        )
        try:
            with span("trainer.restart", restart=ctx.state.trainer_restarts) as s:
                assert ctx.checkpoints is not None
                version, step = await ctx.checkpoints.restore(ctx.links.trainer)
                s.set_attribute("version", version)
                s.set_attribute("step", step)
            break
        except ActorDied as again:
            death = again
            await backoff.wait()
    ctx.trainer_death = None  # whoever saw it, this restore answers it
    ctx.state.version, ctx.state.step = version, step
    await ctx.accounted.wait()  # a lost step's line is written, then cut with the others
    ctx.metrics.truncate(step)
    ctx.due.clear()  # due versions were counted from the lost steps
    ctx.paths.clear()  # the restored trainer's versions name other weights
    ctx.acks.clear()
    ctx.trace_drops(ctx.buffer.drop_newer_than(version))
    for pool in ctx.pools.values():
        for rank in range(len(pool.versions)):
            pool.versions[rank] = -2  # reset first, then a keyframe (see weights.sync_worker)
    ctx.trainer_alive.set()
    ctx.bump_versions()
    ctx.notify()


def _step_record(
    ctx: RunContext, trajs: list[Trajectory], stale: list[int], result: StepResult, now: float
) -> dict[str, Any]:
    """The step's metrics line as of its end, but for what its pools' counters add
    (`_account`); its rollouts and mismatch go to the cost ledger now."""
    for t, st in zip(trajs, stale, strict=False):
        ctx.ledger.record_rollout(t.pool, tokens=t.num_generated, staleness=st)
    for name, m in result.per_pool.items():
        ctx.ledger.record_mismatch(name, kl=m.mismatch_kl, masked_fraction=m.masked_fraction, tokens=m.tokens)
    counts = ctx.buffer.counters
    rewards = [float(t.reward) for t in trajs]
    return {
        "step": ctx.state.step,
        "version": ctx.version,
        "wall_s": round(now - ctx.t_start, 3),
        "reward_mean": sum(rewards) / len(rewards),
        "rollouts": len(trajs),
        "staleness_mean": sum(stale) / len(stale),
        "staleness_max": max(stale),
        "dropped_stale": counts.dropped_stale,
        "dropped_failed": counts.dropped_failed,
        "dropped_rollback": counts.dropped_rollback,
        "dropped_lost": counts.dropped_lost,
        "dropped_total": counts.dropped_stale + counts.dropped_failed + counts.dropped_rollback + counts.dropped_lost,
        "prompts_skipped": counts.groups_skipped,
        "zero_variance_groups": counts.groups_zero_variance,
        "zero_variance_kept": counts.zero_variance_kept,
        "trained_tokens": result.tokens,
        "trainer_restarts": ctx.state.trainer_restarts,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "mismatch_kl": result.overall.mismatch_kl,
        "masked_fraction": result.overall.masked_fraction,
        "mean_weight": result.overall.mean_weight,
        "entropy": result.overall.entropy,
        "train_s": result.seconds,
        "segments_mean": sum(t.segments for t in trajs) / len(trajs),
    }


async def _account(
    ctx: RunContext,
    record: dict[str, Any],
    trajs: list[Trajectory],
    stale: list[int],
    result: StepResult,
    now: float,
    counters_wait: trio.CancelScope,
) -> None:
    """Complete the record of the step trained at `now` with its pools' counters
    (`refresh_stats`, which waits up to STATS_WAIT_S, or until `counters_wait` is
    cancelled; calls still out land later), its cost and host presence, write it, and set
    `ctx.accounted`."""
    try:
        with counters_wait:
            async with trio.open_nursery() as nursery:  # every pool's counters at once, bounded
                for view in ctx.pools.values():
                    nursery.start_soon(refresh_stats, ctx, view)
        pool_stats = {name: _pool_step_stats(ctx, name, now) for name in ctx.pools}
        by_pool: dict[str, list[int]] = {}
        for t, st in zip(trajs, stale, strict=False):
            by_pool.setdefault(t.pool, []).append(st)
        per_pool = result.per_pool
        record["cost_usd"] = ctx.ledger.report().totals.cost_usd
        record["pools"] = {
            name: {
                **pool_stats[name],
                **ctx.host_stats(name, now),
                "staleness_mean": sum(by_pool[name]) / len(by_pool[name]) if name in by_pool else None,
                "staleness_max": max(by_pool[name]) if name in by_pool else None,
                "rollouts": len(by_pool.get(name, [])),
                "mismatch_kl": per_pool[name].mismatch_kl if name in per_pool else None,
                "masked_fraction": per_pool[name].masked_fraction if name in per_pool else None,
            }
            for name in ctx.pools
        }
        if result.memory is not None:  # a trainer process's first step: its sizes and peak
            record["trainer_memory"] = result.memory
            ctx.progress.message(memory_line(result.memory))
        ctx.metrics.write(record)
        ctx.progress.step(record)
        ctx.step_t0 = now
    finally:
        ctx.accounted.set()


def _pool_step_stats(ctx: RunContext, name: str, now: float) -> dict[str, Any]:
    """A pool's tokens and busy time since the last step, from every rank's latest counters
    (`refresh_stats`). A dead rank is skipped (and respawned); a respawned rank counts from
    zero again; a rank that did not answer in time is accounted when it does (its counters
    are cumulative)."""
    pool = ctx.pools[name]
    stats = pool.stats
    d_tok, d_busy = 0, 0.0
    tokens, busy, requests, prefills, prefix_hits = 0, 0.0, 0, 0, 0
    for rank, st in enumerate(stats):
        if st is None:
            continue
        tok, b = int(st["tokens_generated"]), float(st["busy_seconds"])
        prev_tok, prev_b = pool.marks[rank]
        if tok < prev_tok or b < prev_b:  # a new process since the last mark
            prev_tok, prev_b = 0, 0.0
        d_tok, d_busy = d_tok + tok - prev_tok, d_busy + b - prev_b
        pool.marks[rank] = (tok, b)
        tokens, busy = tokens + tok, busy + b
        requests += int(st["requests_finished"])
        prefills += int(st["prefill_batches"])
        prefix_hits += int(st.get("prefix_hits", 0))
    if pool.link.dead_ranks():
        ctx.respawn_dead()
    ctx.ledger.record_busy(name, seconds=d_busy)
    if d_busy > 0 and d_tok > 0:
        ctx.scheduler.observe(name, tokens=d_tok, gpu_seconds=d_busy * pool.link.config.count)
    return {
        "tokens_per_s": d_tok / max(now - ctx.step_t0, 1e-9),
        "busy_s": busy,
        "tokens": tokens,
        "requests": requests,
        "prefill_batches": prefills,
        "prefix_hits": prefix_hits,
    }
