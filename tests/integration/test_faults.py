"""Faults injected for real into a running controller: SIGKILL of a sampler, an env actor
and the trainer, each in its own process. The run must finish every step, lose no prompt,
and repeat at most `[checkpoint] every_steps` steps after the trainer's death."""

from __future__ import annotations

import os
import signal

import pytest
import trio

from orchestrator.entry.runner import RunHandles, run_async
from orchestrator.state.config import load_config
from orchestrator.state.progress import Progress
from tests.integration.conftest import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


async def test_sampler_env_and_trainer_kills_do_not_end_the_run(small_raw):
    raw = small_raw(name="faults", steps=9)
    raw["checkpoint"] = {"every_steps": 2, "max_restarts": 2}
    cfg = load_config(raw=raw)
    seen: dict[str, object] = {}

    async def faults(run: RunHandles) -> None:
        state, meshes = run.controller.state, run.meshes
        # Both pools at once: with one pool left the run would train on without waiting
        # for the respawn, and might end before it is seen.
        for at, keys in ((2, ("pool:b200-bf16", "pool:h100-fp8")), (3, ("env",)), (5, ("trainer",))):
            while state.step < at:
                await trio.sleep(0.05)
            old = {key: meshes[key].pids[0] for key in keys}
            if keys == ("trainer",):
                seen["step_at_trainer_kill"] = state.step
            for key in keys:
                os.kill(old[key], signal.SIGKILL)
            for key in keys:
                while meshes[key].pids[0] in (old[key], None) or run.controller.restoring_trainer:
                    await trio.sleep(0.05)
                seen[key] = meshes[key].pids[0]
            if keys == ("trainer",):
                seen["step_after_restore"] = state.step

    with trio.fail_after(500):
        result = await run_async(cfg, progress=Progress(cfg.steps, quiet=True), observer=faults)
    assert result.steps_done == 9 and not result.interrupted
    assert set(seen) >= {"pool:b200-bf16", "pool:h100-fp8", "env", "trainer"}  # each was respawned
    repeated = seen["step_at_trainer_kill"] - seen["step_after_restore"]
    assert 0 <= repeated <= 2
    rows = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert rows[-1]["trainer_restarts"] == 1
    for r in rows:
        for pool in r["pools"].values():
            assert pool["busy_s"] >= 0 and pool["tokens_per_s"] >= 0
    c = result.counts
    assert c["groups_in"] == c["groups_trained"] + c["groups_buffered"] + c["groups_skipped"]
    spans = read_jsonl(cfg.run_dir / "traces.jsonl")
    assert any(s["name"] == "trainer.restart" for s in spans)
    assert any(s["name"] == "trajectories.fetch" for s in spans)  # the trainer fetched held trajectories
