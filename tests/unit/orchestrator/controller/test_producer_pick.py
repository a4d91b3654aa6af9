"""Where the producer runs a rollout when the pool the scheduler chose lacks the weights it
needs: a pool that has them takes it, or the producer would wait for weights that only
the rollout itself can bring (the trainer's next batch needs it)."""

from __future__ import annotations

from orchestrator.controller._producer import _pick
from orchestrator.state.buffer import Slot

from .fakes import Harness, run_config


def _ctx(cheap_budget: int, dear_budget: int):
    cfg = run_config(
        pools=[
            {"name": "cheap", "gpu": "cpu", "staleness_budget": cheap_budget, "max_concurrent_rollouts": 4},
            {
                "name": "dear",
                "gpu": "cpu",
                "price_per_gpu_hour": 2.0,
                "staleness_budget": dear_budget,
                "max_concurrent_rollouts": 4,
            },
        ]
    )
    ctx = Harness(cfg).controller.ctx
    ctx.state.version = 3
    for view in ctx.pools.values():
        view.versions[0] = 3
    ctx.update_scheduler()
    return ctx


async def test_a_pool_that_holds_the_needed_weights_takes_the_rollout():
    ctx = _ctx(cheap_budget=0, dear_budget=2)
    ctx.due["g9"] = 4  # due at version 4: the cheap pool needs v4, the dear one v2
    assert ctx.scheduler.take("cheap")  # what the scheduler placed
    view, rank, need = _pick(ctx, Slot("g9", "p9", 0), "cheap")
    assert (view.name, rank, need) == ("dear", 0, 2)
    assert ctx.scheduler.in_flight("cheap") == 0 and ctx.scheduler.in_flight("dear") == 1


async def test_the_chosen_pool_keeps_a_rollout_it_can_run():
    ctx = _ctx(cheap_budget=1, dear_budget=2)
    ctx.due["g9"] = 4
    assert ctx.scheduler.take("cheap")
    view, rank, need = _pick(ctx, Slot("g9", "p9", 0), "cheap")
    assert (view.name, rank, need) == ("cheap", 0, 3)
    assert ctx.scheduler.in_flight("cheap") == 1 and ctx.scheduler.in_flight("dear") == 0


async def test_no_pool_with_the_weights_leaves_the_slot_waiting_on_the_chosen_one():
    ctx = _ctx(cheap_budget=0, dear_budget=0)
    ctx.due["g9"] = 4
    assert ctx.scheduler.take("cheap")
    view, rank, need = _pick(ctx, Slot("g9", "p9", 0), "cheap")
    assert (view.name, rank, need) == ("cheap", None, 4)
    assert ctx.scheduler.in_flight("cheap") == 1 and ctx.scheduler.in_flight("dear") == 0
