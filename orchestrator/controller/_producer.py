"""The producer: keeps enough GRPO groups buffered and starts their rollouts.

Each new group records the trainer version at which its batch will be trained (groups
ahead of it / P, +1 if a step is running); its rollouts need weights no older than
that minus the pool's budget. A rollout whose pool does not hold them yet is held
back here, holding no sampler slot, which work due earlier (a retry) may need; and
the producer looks past it, since the version it waits for may need the work behind
it (with `staleness_budget = 0`, a group due next can sit behind one due later).

Cancellation: leaving the nursery abandons the rollouts in flight; their slots stay
counted as buffered. A sampler or env process that dies mid-rollout is respawned and
the rollout re-queued; the trainer's restart cancels every rollout in flight (their
weights are gone) and re-queues them; so does a sampler or env actor that stops answering
(`_liveness`), and no rollout starts on one until it answers again. A straggler the next
batch waits for is hedged first (`_hedge`): a duplicate starts on another host, and the
first of the two to finish is the slot's.
"""

from __future__ import annotations

import time

import trio

from actors.types import TaskSpec, Trajectory
from orchestrator.controller._context import RunContext
from orchestrator.controller._hedge import Attempt
from orchestrator.controller._liveness import bind
from orchestrator.controller._pools import PoolView
from orchestrator.runtime import ActorDied, span
from orchestrator.state.buffer import Slot

__all__ = ["need_version", "pick_target", "produce", "task_for"]

TELL_NS = 1_000_000
"""Placement decisions the producer makes one after another, with no wait between them, see
the same trainer and pools (only other tasks change them, and none runs meanwhile) but for
the clock, which moves the trainer's horizon: the scheduler is told that state afresh after
each wait and at least every TELL_NS nanoseconds of such a run, not before every decision."""


def task_for(ctx: RunContext, i: int) -> TaskSpec:
    """Prompt `i` of the run: deterministic in the run's seed, so a replay is the same task.
    With a dataset, prompt `i` plays the row `TaskDataset.index(i, seed)` (shuffled per
    epoch), its columns merged over `[task] params`."""
    cfg = ctx.cfg
    params = dict(cfg.task.params)
    if ctx.dataset is not None:
        params.update(ctx.dataset.params(i, cfg.seed))
    return TaskSpec(
        task=cfg.task.task_name, prompt_id=f"p{i}", group_id=f"g{i}", seed=cfg.seed * 1_000_003 + i, params=params
    )


def _new_group(ctx: RunContext) -> None:
    if ctx.replay:  # buffered when the run last stopped: already counted in
        task, counted = ctx.replay.pop(0), True
    else:
        task, counted = task_for(ctx, ctx.state.prompts), False
        ctx.state.prompts += 1
    # Groups ahead of this one are trained first, P per step; a step in progress (its
    # batch already taken) bumps the version once more before them.
    ahead = ctx.buffer.groups_buffered // ctx.cfg.rollout.prompts_per_step
    ctx.due[task.group_id] = ctx.version + ahead + (ctx.train_started is not None)
    ctx.buffer.add_group(task.group_id, task.prompt_id, task, counted=counted)


def _top_up(ctx: RunContext) -> None:
    rollout = ctx.cfg.rollout
    if ctx.cfg.mode == "sync":
        if ctx.buffer.groups_buffered == 0 and ctx.all_synced() and not ctx.train_pending:
            for _ in range(rollout.prompts_per_step):
                _new_group(ctx)
            ctx.train_pending = True
        elif ctx.train_pending and ctx.train_started is None:
            # A group left before its batch was taken (zero variance, or skipped after
            # failures): refill the batch at the same version.
            while ctx.buffer.groups_buffered < rollout.prompts_per_step:
                _new_group(ctx)
    else:
        while ctx.buffer.groups_buffered < rollout.prompts_per_step + rollout.max_buffered_groups:
            _new_group(ctx)


def need_version(ctx: RunContext, slot: Slot, pool: str) -> int:
    """The oldest weights a rollout may start on: its group's due version minus the budget."""
    return max(0, _due(ctx, slot) - ctx.budgets[pool])


def _due(ctx: RunContext, slot: Slot) -> int:
    return max(ctx.version, ctx.due.get(slot.group_id, 0))


def _runnable_now(ctx: RunContext, slot: Slot) -> bool:
    """Some pool holds weights new enough for `slot` (`need_version`)."""
    due, budgets = _due(ctx, slot), ctx.budgets
    return any(view.newest_version() >= max(0, due - budgets[name]) for name, view in ctx.pools.items())


def _tell(ctx: RunContext) -> None:
    """Tell the scheduler the trainer's state and which pools can take rollouts."""
    rollout = ctx.cfg.rollout
    batch = rollout.prompts_per_step * rollout.group_size
    demand = max(0, batch - ctx.buffer.done_rollouts())  # in-flight ones: the scheduler weighs them
    ctx.scheduler.set_trainer(ctx.version, demand, ctx.horizon(), ctx.consume_rate(), batch=batch)
    ctx.update_scheduler()  # pools without a usable rank (dead, frozen, no weights) are out


def pick_target(ctx: RunContext, slot: Slot, pool: str) -> tuple[PoolView, int | None, int]:
    """(pool, rank, min_version) for `slot`, whose scheduler slot on `pool` is taken. If no
    rank of `pool` holds the weights the slot needs, the cheapest other pool with room
    whose ranks do takes it instead (its scheduler slot taken, `pool`'s freed): waiting for
    `pool` to get newer weights can wait for ever when the trainer's next batch needs this
    very rollout (a batch put back after its held trajectories were lost lands behind
    groups due later). Rank None: no pool can run it now."""
    view = ctx.pools[pool]
    need = need_version(ctx, slot, pool)
    rank = view.pick_rank(need)
    if rank is not None or view.newest_version() < 0:
        return view, rank, need  # placed, or the pool is down (not a matter of versions)
    for name in ctx.scheduler.ranking():
        other = ctx.pools[name]
        if other is view:
            continue
        need_there = need_version(ctx, slot, name)
        alt = other.pick_rank(need_there)
        if alt is not None and ctx.scheduler.take(name):
            ctx.scheduler.release(pool)
            return other, alt, need_there
    return view, None, need


def _put_back(ctx: RunContext, waiting: list[Slot], *slots: Slot) -> None:
    """`waiting`, then `slots`, back at the head of the queue in their order."""
    for s in reversed([*waiting, *slots]):
        ctx.buffer.requeue(s)
    waiting.clear()


async def _wait(ctx: RunContext, waiting: list[Slot], *slots: Slot) -> None:
    """Until something changes, or a rollout in flight may have become a straggler."""
    _put_back(ctx, waiting, *slots)
    with trio.move_on_at(ctx.hedger.wake_at()):
        await ctx.wait_change()


async def produce(ctx: RunContext, nursery: trio.Nursery) -> None:
    waiting: list[Slot] = []  # held back for newer weights; work behind them may start now
    told = None  # when the scheduler was last told the trainer's and pools' state (TELL_NS)
    try:
        while not ctx.stopping:
            _start_hedges(ctx, nursery)
            _top_up(ctx)
            slot = ctx.buffer.next_slot()
            if slot is None:
                await _wait(ctx, waiting)
                told = None
                continue
            t0 = time.perf_counter_ns()
            task = ctx.buffer.task_of(slot)
            if task is None:  # its group was skipped meanwhile
                ctx.buffer.requeue(slot)
                continue
            if not _runnable_now(ctx, slot):
                # Due at a version no pool holds yet: the slots behind it (a group due now) may
                # be what that version waits for, so look past it.
                waiting.append(slot)
                continue
            if told is None or t0 - told > TELL_NS:
                _tell(ctx)
                told = t0
            # The cost-aware scheduler spills to dearer pools only if the trainer would wait.
            pool = ctx.scheduler.place()
            if pool is None:
                await _wait(ctx, waiting, slot)
                told = None
                continue
            view, rank, min_version = pick_target(ctx, slot, pool)
            env = ctx.pick_env()
            if not ctx.trainer_alive.is_set() or rank is None or env is None:
                ctx.scheduler.release(view.name)  # held back: undone, not a finished rollout
                await _wait(ctx, waiting, slot)
                told = None
                continue
            ctx.decision_ns.append(time.perf_counter_ns() - t0)
            _launch(ctx, nursery, Attempt(slot, view, rank, env, min_version, ctx.now()), task)
    finally:
        _put_back(ctx, waiting)


def _launch(ctx: RunContext, nursery: trio.Nursery, a: Attempt, task: TaskSpec) -> None:
    """Start attempt `a` (its scheduler slot already taken), counted in flight from now."""
    a.pool.in_flight[a.rank] += 1
    ctx.env_in_flight[a.env] += 1
    ctx.rollout_scopes.add(a.scope)  # from now: a trainer restart or a twin may cancel it
    ctx.hedger.started(a)
    nursery.start_soon(_rollout, ctx, a, task)


def _start_hedges(ctx: RunContext, nursery: trio.Nursery) -> None:
    """Start a duplicate of each straggler the next batch waits for (`_hedge`), on a rank of
    another host with a free scheduler slot; one without such a rank waits for the next look."""
    now, buffer = ctx.now(), ctx.buffer
    # What the next batch waits for gains members only when a batch is taken or a group
    # comes or goes; a rollout finishing only removes one, and a retry started meanwhile
    # is seen at the next timed look (within RECHECK_S): no scan per finished rollout.
    seen = (ctx.version, buffer.groups_buffered)
    if not ctx.hedger.due(now, seen):
        return
    late = ctx.hedger.stragglers(buffer.awaited(ctx.cfg.rollout.prompts_per_step), now, seen)
    if not late or not ctx.trainer_alive.is_set():
        return
    ctx.update_scheduler()
    for a in late:
        task = buffer.task_of(a.slot)
        target = _hedge_target(ctx, a)
        env = ctx.pick_env()
        if task is None or target is None or env is None or not ctx.scheduler.take(target[0].name):
            continue
        view, rank, min_version = target
        with span(
            "rollout.hedge",
            group_id=a.slot.group_id,
            sample=a.slot.index,
            pool=view.name,
            straggler_pool=a.pool.name,
            straggler_rank=a.rank,
            running_s=round(now - a.started, 3),
        ):
            pass
        _launch(ctx, nursery, Attempt(a.slot, view, rank, env, min_version, now, hedge=True), task)


def _hedge_target(ctx: RunContext, a: Attempt) -> tuple[PoolView, int, int] | None:
    """(pool, rank, min_version) for a duplicate of `a`: the cheapest pool with a free slot
    that has a usable rank other than `a`'s, not on `a`'s host, with weights no older than
    `a` asked for nor that pool's budget allows; its least loaded such rank."""
    host = a.pool.health[a.rank].host
    for name in ctx.scheduler.ranking():
        if ctx.scheduler.in_flight(name) >= ctx.scheduler.capacity(name):
            continue
        view = ctx.pools[name]
        need = max(a.min_version, need_version(ctx, a.slot, name))
        ranks = [
            r
            for r in view.usable()
            if view.versions[r] >= need
            and not (view is a.pool and r == a.rank)
            and (host is None or view.health[r].host != host)
        ]
        if ranks:
            return view, min(ranks, key=view.in_flight.__getitem__), need
    return None


async def _notify_after(ctx: RunContext, seconds: float) -> None:
    """Wake the producer once a sampler it avoids may take rollouts again."""
    await trio.sleep(seconds)
    ctx.update_scheduler()
    ctx.notify()


async def _rollout(ctx: RunContext, a: Attempt, task: TaskSpec) -> None:
    slot, pool, rank, min_version, env, scope = a.slot, a.pool, a.rank, a.min_version, a.env, a.scope
    traj = None
    try:
        # Abandoned (re-queued) when the trainer restarts or its sampler or env actor freezes;
        # cancelled when its twin (`_start_hedges`) finishes first.
        with (
            bind(scope, pool.health[rank], ctx.env_health[env]),
            scope,
            span(
                "rollout",
                task=task.task,
                prompt_id=slot.prompt_id,
                group_id=slot.group_id,
                sample=slot.index,
                attempt=slot.attempt,
                pool=pool.name,
                gpu=pool.link.config.gpu,
                precision=pool.link.config.precision,
                hedge=a.hedge,
            ) as s,
        ):
            traj = await ctx.links.envs.run_episode(
                pool.link, rank, task, ctx.sampling, min_version, env_rank=env, hold=ctx.cfg.rollout.hold_trajectories
            )
            ctx.env_health[env].heard = ctx.now()
            s.set_attribute("policy_version", traj.oldest_version)
            s.set_attribute("policy_version_max", traj.newest_version)
            s.set_attribute("staleness", ctx.version - traj.oldest_version)
            s.set_attribute("tokens", traj.num_generated)
            s.set_attribute("reward", float(traj.reward))
            s.set_attribute("failed", bool(traj.failed))
    except ActorDied as e:
        if not a.discarded:
            ctx.progress.failure(f"rollout on {pool.receiver(rank)} lost: {e}")
        ctx.respawn_dead()
    finally:
        ctx.rollout_scopes.discard(scope)
        pool.in_flight[rank] -= 1
        ctx.env_in_flight[env] -= 1
        lost = traj is not None and traj.sampler_lost
        if not _ended(ctx, a, traj, lost):
            pass  # its twin finished first, or runs on: this attempt only freed what it held
        elif traj is None or lost:
            # Died, cancelled (trainer restart, unresponsive actor) or failed with its sampler's
            # link: it never finished, and it is retried as it was (no attempt counted, so a
            # partition costs no prompt). A sampler that lost its link gets nothing for a
            # ping interval, so retries go elsewhere before the watcher names it.
            ctx.scheduler.release(pool.name)
            ctx.buffer.requeue(slot)
            if lost:
                _avoid(ctx, pool, rank)
        else:
            ctx.progress_t = ctx.now()
            ctx.scheduler.complete(pool.name, traj.num_generated)
            ctx.episode_ended(
                f"episode {slot.prompt_id}#{slot.index}: {traj.error or 'failed'}" if traj.failed else None
            )
            drop = ctx.buffer.complete(slot, traj)
            if drop is not None and drop.reason == "zero_variance":
                ctx.due.pop(slot.group_id, None)  # gone untrained; the producer tops up
            if drop is not None:
                ctx.release()  # a zero-variance group's held trajectories
                ctx.trace_drops([drop])
                if drop.error:
                    ctx.progress.failure(f"episode {slot.prompt_id}#{slot.index} failed ({drop.reason}): {drop.error}")
        ctx.notify()


def _ended(ctx: RunContext, a: Attempt, traj: Trajectory | None, lost: bool) -> bool:
    """Tell the hedger that `a` ended; whether its outcome is its slot's. If not (its twin
    finished first, or runs on), free its scheduler slot here (`complete` if it returned a
    trajectory, `release` if not), and avoid its sampler if it lost its link."""
    finished = traj is not None and not lost
    seconds = ctx.now() - a.started if finished and not traj.failed else None
    if ctx.hedger.ended(a, finished, seconds):
        return True
    if finished:
        ctx.scheduler.complete(a.pool.name, traj.num_generated)
        ctx.release([traj])  # not trained: its holder may forget it
    else:
        ctx.scheduler.release(a.pool.name)
        if lost:
            _avoid(ctx, a.pool, a.rank)
    return False


def _avoid(ctx: RunContext, pool: PoolView, rank: int) -> None:
    """No new rollout on sampler `rank` of `pool` for a ping interval (it lost its link)."""
    pool.health[rank].avoid(ctx.now() + ctx.cfg.faults.ping_every_s)
    ctx.update_scheduler()
    if ctx.nursery is not None:
        ctx.nursery.start_soon(_notify_after, ctx, ctx.cfg.faults.ping_every_s)
