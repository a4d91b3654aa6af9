"""A run that makes no progress says what it waits on.

Progress is a rollout that finished or a step that was trained (`RunContext.progress_t`).
When neither happened for `[faults] stall_warn_s`, one line names what the run waits on:
the rollouts queued and in flight, the complete groups the trainer has against the batch it
needs, whether the trainer is up, each pool's usable samplers and the weights they hold
against the weights the next queued rollout needs there, and the environment actors that
answer. Once per stall: the next line comes only after progress resumed and stopped again.
A run that waits for ever (a pool that never gets the weights its rollouts need, every
sampler frozen) then tells the user why instead of hanging in silence.
"""

from __future__ import annotations

import trio

from orchestrator.controller._context import RunContext
from orchestrator.controller._producer import need_version

__all__ = ["describe_wait", "watch_progress"]


async def watch_progress(ctx: RunContext, after_s: float) -> None:
    warned_at: float | None = None  # progress_t when the last line was printed
    while True:
        await trio.sleep(max(1.0, ctx.progress_t + after_s - ctx.now()))
        if ctx.now() - ctx.progress_t >= after_s and warned_at != ctx.progress_t and not ctx.stopping:
            warned_at = ctx.progress_t
            waited = ctx.now() - ctx.progress_t
            ctx.progress.message(f"no rollout finished and no step trained for {waited:.0f} s: {describe_wait(ctx)}")


def describe_wait(ctx: RunContext) -> str:
    """What the run waits on, in one line."""
    buffer, rollout = ctx.buffer, ctx.cfg.rollout
    parts = [
        f"{buffer.queued} rollout(s) queued, {buffer.in_flight} in flight",
        f"{buffer.complete_groups()} of {rollout.prompts_per_step} complete group(s) for the next step",
        f"trainer up at v{ctx.version}" if ctx.trainer_alive.is_set() else "trainer restarting",
    ]
    head = buffer.head()
    for name, view in ctx.pools.items():
        usable = view.usable()
        frozen = sum(1 for h in view.health if not h.responsive)
        dead = len(view.link.dead_ranks()) + len(view.link.starting_ranks())
        state = f" ({frozen} unresponsive, {dead} dead or starting)" if frozen or dead else ""
        held = f", newest weights v{view.newest_version()}" if usable else ""
        needs = f" (the next queued rollout needs v{need_version(ctx, head, name)}+)" if head is not None else ""
        parts.append(
            f"pool {name}: {len(usable)} of {len(view.versions)} sampler(s) usable{state}{held}{needs}, "
            f"{sum(view.in_flight)} rollout(s) running"
        )
    parts.append(f"{len(ctx.usable_envs())} of {len(ctx.env_health)} environment actor(s) answering")
    return "; ".join(parts)
