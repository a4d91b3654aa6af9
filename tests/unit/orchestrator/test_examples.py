"""The shipped example configs load, keep the demo's two pools and the stable recipe."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.state.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples").glob("*.toml"))


def test_both_examples_are_shipped():
    assert {p.stem for p in EXAMPLES} >= {"guess_number", "arithmetic"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_loads_with_two_pools_and_min_keep(path: Path):
    cfg = load_config(path)
    assert {p.precision for p in cfg.pools} == {"bf16", "fp8"}
    assert len({p.staleness_budget for p in cfg.pools}) == 2
    # A one-token nucleus would be an absorbing state (issue 11): the examples keep two ids.
    assert cfg.recipe.min_keep >= 2 and cfg.recipe.mask_replay
