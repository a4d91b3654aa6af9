"""PROTOCOL TEST, not a test of SGLang: a whole run whose pool is `backend = "sglang"` with
`urls` pointing at two instances of the protocol stub (tests/unit/actors/sglang_stub.py).
It shows the path config -> pool mesh -> SGLang backend -> recipe: weights reach each server
through /update_weights_from_disk with increasing versions, and the trainer trains on the
kept-id rows the servers returned."""

from __future__ import annotations

import pytest
import trio

from actors.tokenizer import VOCAB_SIZE
from orchestrator.entry.runner import run_async
from orchestrator.state.config import load_config
from orchestrator.state.progress import Progress
from tests.integration.conftest import read_jsonl
from tests.unit.actors.sglang_stub import start_stub

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def test_a_run_with_an_sglang_pool_of_two_servers(small_raw, tmp_path) -> None:
    stubs = [start_stub(vocab=VOCAB_SIZE) for _ in range(2)]
    try:
        raw = small_raw(name="sglang", steps=2)
        raw["pools"] = [
            {
                "name": "sglang-h100",
                "gpu": "H100-SXM",
                "count": 2,
                "backend": "sglang",
                "urls": [f"http://127.0.0.1:{s.server_port}" for s, _ in stubs],
                "weights_dir": str(tmp_path / "weights"),
                "staleness_budget": 2,
                "max_concurrent_rollouts": 16,
            }
        ]
        # SGLang's top-p has no minimum support size: its pools need min_keep = 1.
        raw["recipe"] = {**raw.get("recipe", {}), "min_keep": 1}
        cfg = load_config(raw=raw)
        with trio.fail_after(240):
            result = await run_async(cfg, progress=Progress(cfg.steps, quiet=True))
        assert result.steps_done == 2
        # each rank writes its updates to its own directory and keeps only the loaded one (and
        # the next, if the run ended while it was being loaded)
        for rank in (0, 1):
            kept = list((tmp_path / "weights" / f"sglang-h100-{rank}").iterdir())
            assert 1 <= len(kept) <= 2 and any((k / "model.safetensors").is_file() for k in kept), kept
        metrics = read_jsonl(cfg.run_dir / "metrics.jsonl")
        assert all(m["pools"]["sglang-h100"]["rollouts"] > 0 for m in metrics)
        assert all(m["loss"] == m["loss"] for m in metrics)  # trained on the servers' rows (not NaN)
        for _, state in stubs:
            paths = [e["path"] for e in state.log]
            assert "/generate" in paths
            updates = [e["body"] for e in state.log if e["path"] == "/update_weights_from_disk"]
            versions = [int(u["weight_version"]) for u in updates]
            assert versions == sorted(versions) and versions[0] == 0
            # every update lands while generation is paused, and generation is continued after it; the run may end while its last update is
            # being loaded (then only the shutdown's aborts follow the pause)
            assert paths[0] == "/continue_generation"  # start: clear a pause a dead owner left
            paused = False
            for p in paths[1:]:
                if p == "/pause_generation":
                    assert not paused
                    paused = True
                elif p == "/continue_generation":
                    assert paused
                    paused = False
                elif p == "/update_weights_from_disk":
                    assert paused
            gen = next(e["body"] for e in state.log if e["path"] == "/generate")
            assert gen["return_sampling_mask"] is True and gen["sampling_params"]["top_k"] == cfg.recipe.top_k
    finally:
        for server, _ in stubs:
            server.shutdown()
            server.server_close()
