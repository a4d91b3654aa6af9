"""Evaluation: held-out task instances played with the current policy, never trained on.

``[eval] every = N, episodes = M``: after every N-th training step the controller
plays M episodes of held-out tasks -- rows of ``[task] eval_dataset`` (in file order,
cycling), or, without one, the training task with seeds of its own -- on one pool
(``[eval] pool``, default the first), greedily (``temperature = 0``) or at the
configured temperature, with weights no older than the version just trained.
Episodes run through the same environment actors as training, but their
trajectories go nowhere near the rollout buffer: only their rewards are kept.

Each evaluation writes a line ``{"step", "eval_reward", "eval_version", "eval_s",
"eval_episodes", "eval_failed"}`` to metrics.jsonl, an ``eval`` span, and a line in
the run's console report.  It runs beside training (its own task in the controller's
nursery); one evaluation at a time, the next waits for it; the controller waits for
an evaluation due at the last step before it returns.

Cancellation: leaving the controller's nursery abandons an evaluation in progress
(no line is written for it).  Errors: a failed episode counts as reward 0 and in
``eval_failed``; a dead sampler or env actor fails that episode, not the run; one
that stops answering has its episode played again elsewhere.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actors.env import TaskDataset
    from orchestrator.controller._context import RunContext

__all__ = ["eval_loop", "eval_tasks"]

EVAL_SEED_OFFSET = 7_777_777
"""Seeds of held-out instances of the training task start here (training seeds are
``seed * 1_000_003 + i``; the offset keeps the two apart for any realistic run)."""


def eval_tasks(cfg: Any, dataset: TaskDataset | None, episodes: int) -> list[Any]:
    """The held-out ``TaskSpec`` list one evaluation plays (the same every time)."""
    from actors.types import TaskSpec

    out = []
    for i in range(episodes):
        params = dict(cfg.task.params)
        if dataset is not None:
            params.update(dataset.rows[i % len(dataset)])
        out.append(
            TaskSpec(
                task=cfg.task.task_name,
                prompt_id=f"eval{i}",
                group_id=f"eval{i}",
                seed=EVAL_SEED_OFFSET + cfg.seed * 1_000_003 + i,
                params=params,
            )
        )
    return out


async def evaluate(ctx: RunContext, step: int) -> dict[str, Any]:
    """Play one evaluation at the current version; return its metrics line."""
    import trio

    from actors.types import SamplingParams
    from orchestrator.runtime import ActorDied, span

    ev = ctx.cfg.eval
    pool = ctx.pools[ev.pool or next(iter(ctx.pools))]
    version = ctx.version
    sampling = SamplingParams(
        temperature=ev.temperature,
        top_k=ctx.cfg.recipe.top_k,
        top_p=ctx.cfg.recipe.top_p,
        min_keep=ctx.cfg.recipe.min_keep,
        max_new_tokens=ctx.cfg.task.max_new_tokens,
    )
    tasks = eval_tasks(ctx.cfg, ctx.eval_dataset, ev.episodes)
    rewards: list[float] = []
    failed = 0
    t0 = time.perf_counter()
    with span("eval", step=step, version=version, pool=pool.name, episodes=len(tasks)) as sp:

        async def one(task: Any) -> None:
            nonlocal failed
            from orchestrator.controller._liveness import bind

            while True:
                # Like a training rollout, an episode starts only on a rank that answers and
                # holds the weights (it holds no sampler slot while the weight sync catches up).
                while (rank := pool.pick_rank(version)) is None or (env := ctx.pick_env()) is None:
                    await ctx.wait_change()
                pool.in_flight[rank] += 1
                ctx.env_in_flight[env] += 1
                scope = trio.CancelScope()
                try:
                    with bind(scope, pool.health[rank], ctx.env_health[env]), scope:
                        traj = await ctx.links.envs.run_episode(pool.link, rank, task, sampling, version, env_rank=env)
                        failed += traj.failed
                        rewards.append(0.0 if traj.failed else float(traj.reward))
                except ActorDied:
                    failed += 1
                    rewards.append(0.0)
                finally:
                    pool.in_flight[rank] -= 1
                    ctx.env_in_flight[env] -= 1
                if not scope.cancelled_caught:
                    return  # else its sampler or env actor stopped answering: play it elsewhere

        async with trio.open_nursery() as nursery:
            for task in tasks:
                nursery.start_soon(one, task)
        reward = sum(rewards) / len(rewards)
        sp.set_attribute("reward", reward)
        sp.set_attribute("failed", failed)
    return {
        "step": step,
        "eval_reward": reward,
        "eval_version": version,
        "eval_s": time.perf_counter() - t0,
        "eval_episodes": len(rewards),
        "eval_failed": failed,
    }


async def eval_loop(ctx: RunContext, done: Any = None) -> None:
    """Evaluate after every ``[eval] every`` steps (see the module docstring); returns once
    the run's last step is trained (after its evaluation, when one is due) or it stops,
    and then sets the trio Event ``done`` (when given)."""
    try:
        await _evaluate_every(ctx)
    finally:
        if done is not None:
            done.set()


async def _evaluate_every(ctx: RunContext) -> None:
    every = ctx.cfg.eval.every
    next_step = (ctx.state.step // every + 1) * every
    while True:
        if ctx.state.step < next_step:
            if ctx.stopping or ctx.state.step >= ctx.cfg.steps:
                return
            await ctx.wait_change()
            continue
        step = ctx.state.step
        line = await evaluate(ctx, step)
        await ctx.accounted.wait()  # after the step's own line
        ctx.metrics.write(line)
        ctx.progress.message(
            f"eval @ step {step} (version {line['eval_version']}): reward "
            f"{line['eval_reward']:.3f} over {line['eval_episodes']} episodes "
            f"({line['eval_failed']} failed) in {line['eval_s']:.1f}s"
        )
        next_step = (step // every + 1) * every
