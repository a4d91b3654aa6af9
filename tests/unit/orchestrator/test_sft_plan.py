"""`flotilla sft`'s batch plan and output folder (no processes)."""

from __future__ import annotations

from orchestrator.entry.sft import _batches, sft_output_dir
from orchestrator.state.config import load_config


def test_each_epoch_is_a_permutation_cut_into_batches_and_steps_cycle_the_data():
    plan = _batches(10, 4, 7, seed=3)
    assert len(plan) == 7
    assert [e for e, _ in plan] == [0, 0, 0, 1, 1, 1, 2]
    assert [len(b) for _, b in plan] == [4, 4, 2, 4, 4, 2, 4]  # the last batch of an epoch is short
    for epoch in (0, 1):
        seen = [i for e, b in plan if e == epoch for i in b]
        assert sorted(seen) == list(range(10))
    assert [b for e, b in plan if e == 0] != [b for e, b in plan if e == 1]  # a fresh order per epoch
    assert _batches(10, 4, 7, seed=3) == plan and _batches(10, 4, 7, seed=4) != plan


def test_output_folder_defaults_to_name_sft():
    pools = [{"name": "p", "gpu": "B200", "precision": "bf16", "device": "cpu"}]
    cfg = load_config(raw={"name": "x", "run_root": "r", "pools": pools, "sft": {"data": "d.jsonl"}})
    assert str(sft_output_dir(cfg)) == "r/x-sft"
    named = load_config(raw={"name": "x", "run_root": "r", "pools": pools, "sft": {"data": "d", "name": "warm"}})
    assert str(sft_output_dir(named)) == "r/warm"
