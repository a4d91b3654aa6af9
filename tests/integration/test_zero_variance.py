"""`[rollout] filter_zero_variance` in real runs: zero-variance groups are dropped and
replaced, every dropped group really had equal rewards, and a run whose every group has
zero variance still finishes (the drop bound), in async and sync mode."""

from __future__ import annotations

from collections import defaultdict

import pytest
import trio

from orchestrator.entry.runner import run_async
from orchestrator.state.config import load_config
from orchestrator.state.progress import Progress
from tests.integration.conftest import read_jsonl

pytestmark = pytest.mark.timeout(300)


def _balanced(c: dict[str, int]) -> bool:
    return (
        c["groups_in"] == c["groups_trained"] + c["groups_buffered"] + c["groups_skipped"] + c["groups_zero_variance"]
    )


async def test_dropped_groups_had_equal_rewards_and_batches_stay_full(small_raw):
    raw = small_raw(name="zv", steps=3)
    raw["rollout"] |= {"filter_zero_variance": True, "max_zero_variance_drops": 1000}
    cfg = load_config(raw=raw)
    with trio.fail_after(240):
        result = await run_async(cfg, progress=Progress(cfg.steps, quiet=True))
    metrics = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert [m["rollouts"] for m in metrics] == [16, 16, 16]  # P groups of 4 each step
    c = result.counts
    assert _balanced(c) and c["groups_trained"] == 12 and c["zero_variance_kept"] == 0
    # a random init wins guess_number about a quarter of the time: some groups of four
    # lose (or win) every episode
    assert c["groups_zero_variance"] >= 1 and metrics[-1]["zero_variance_groups"] <= c["groups_zero_variance"]
    spans = read_jsonl(cfg.run_dir / "traces.jsonl")
    rewards: dict[str, list[float]] = defaultdict(list)
    for s in spans:
        # the controller's rollout span (it carries the staleness), one per finished episode
        if s["name"] == "rollout" and "staleness" in s["attributes"] and not s["attributes"]["failed"]:
            rewards[s["attributes"]["group_id"]].append(s["attributes"]["reward"])
    zv = [
        s["attributes"]["group_id"]
        for s in spans
        if s["name"] == "rollout.dropped" and s["attributes"]["reason"] == "zero_variance"
    ]
    assert len(zv) == c["groups_zero_variance"]
    for g in zv:
        assert len(rewards[g]) == 4 and len(set(rewards[g])) == 1, (g, rewards[g])


@pytest.mark.parametrize("mode", ["async", "sync"])
async def test_a_run_where_every_group_has_zero_variance_still_finishes(small_raw, mode):
    # Sums up to 63: a random init answers almost never right, so nearly every group is all 0.
    raw = small_raw(name=f"zv-all-{mode}", steps=2, mode=mode)
    raw["task"] = {"name": "arithmetic", "params": {"max_sum": 63}}
    raw["rollout"] |= {"filter_zero_variance": True, "max_zero_variance_drops": 3}
    cfg = load_config(raw=raw)
    with trio.fail_after(240):
        result = await run_async(cfg, progress=Progress(cfg.steps, quiet=True))
    assert result.steps_done == 2
    c = result.counts
    assert _balanced(c)
    # at most the bound per batch is dropped, the rest are trained as they are
    assert 1 <= c["groups_zero_variance"] <= 3 * 2 + 3, c
    assert c["zero_variance_kept"] >= 1, c
