"""Where the producer runs a rollout when the pool the scheduler chose lacks the weights it
needs: a pool that has them takes it, or the producer would wait for weights that only
the rollout itself can bring (the trainer's next batch needs it). The whole run over the
same situation: test_held.py, a lost batch replayed behind later groups."""

from __future__ import annotations

import pytest

from orchestrator.controller._producer import pick_target
from orchestrator.state.buffer import Slot

from .fakes import Harness, cheap_and_dear, run_config


@pytest.mark.parametrize(
    ("budgets", "expected", "in_flight"),
    [
        ((0, 2), ("dear", 0, 2), (0, 1)),  # cheap needs v4, which no rank has: dear (v2) takes it
        ((1, 2), ("cheap", 0, 3), (1, 0)),  # cheap can run it: it keeps it
        ((0, 0), ("cheap", None, 4), (1, 0)),  # no pool has v4: it waits on the chosen pool
    ],
)
async def test_a_rollout_goes_where_its_weights_are(budgets, expected, in_flight):
    cfg = run_config(pools=cheap_and_dear(*budgets))
    ctx = Harness(cfg).controller.ctx
    ctx.state.version = 3
    for view in ctx.pools.values():
        view.versions[0] = 3
    ctx.update_scheduler()
    ctx.due["g9"] = 4  # trained at version 4
    assert ctx.scheduler.take("cheap")  # what the scheduler placed
    view, rank, need = pick_target(ctx, Slot("g9", "p9", 0), "cheap")
    assert (view.name, rank, need) == expected
    assert (ctx.scheduler.in_flight("cheap"), ctx.scheduler.in_flight("dear")) == in_flight
