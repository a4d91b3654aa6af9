"""Trajectory's layout checks refuse every broken record, short (read as Python lists) and
long (checked with torch ops) alike, with the same message."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from actors.types import SHORT_RECORD, Trajectory


def _fields(n: int) -> dict[str, Any]:
    """A valid one-turn record: 3 prompt tokens, then ``n`` generated ones of two ids each."""
    return {
        "task": "t",
        "prompt_id": "p",
        "group_id": "g",
        "pool": "pool",
        "tokens": torch.arange(3 + n),
        "loss_mask": torch.tensor([False] * 3 + [True] * n),
        "support_ids": torch.zeros(2 * n, dtype=torch.int32),
        "support_offsets": torch.arange(0, 2 * n + 1, 2, dtype=torch.int32),
        "support_logq": torch.zeros(2 * n),
        "versions": torch.zeros(n, dtype=torch.int32),
        "reward": 1.0,
        "turns": 1,
        "seconds": 0.1,
    }


def _offsets(f: dict[str, Any], fix: Any) -> dict[str, Any]:
    off = f["support_offsets"].clone()
    fix(off)
    return {**f, "support_offsets": off}


def _shorter_mask(f: dict[str, Any]) -> dict[str, Any]:
    return {**f, "loss_mask": f["loss_mask"][1:]}


def _one_more_generated(f: dict[str, Any]) -> dict[str, Any]:
    mask = f["loss_mask"].clone()
    mask[0] = True
    return {**f, "loss_mask": mask}


def _first(off: torch.Tensor) -> None:
    off[0] = 1


def _last(off: torch.Tensor) -> None:
    off[-1] -= 1


def _decreasing(off: torch.Tensor) -> None:
    off[len(off) // 2] = off[len(off) // 2 + 1] + 1


BROKEN = [
    (_shorter_mask, "loss_mask has"),
    (_one_more_generated, "support_offsets has"),
    (lambda f: {**f, "versions": f["versions"][1:]}, "versions has"),
    (lambda f: {**f, "support_logq": f["support_logq"][1:]}, "support_logq has"),
    (lambda f: _offsets(f, _first), "must start at 0"),
    (lambda f: _offsets(f, _last), "must start at 0"),
    (lambda f: _offsets(f, _decreasing), "non-decreasing"),
    (lambda f: {**f, "versions": f["versions"].long()}, "dtype"),
]


@pytest.mark.parametrize("n", [4, 2 * SHORT_RECORD])
def test_valid_records_pass_and_every_broken_one_is_refused(n: int) -> None:
    f = _fields(n)
    t = Trajectory(**f)
    assert t.num_generated == n and (t.oldest_version, t.newest_version) == (0, 0)
    for breaks, message in BROKEN:
        with pytest.raises(ValueError, match=message):
            Trajectory(**breaks(f))


def test_a_record_of_no_generated_tokens_is_valid() -> None:
    f = _fields(0)
    assert f["support_offsets"].tolist() == [0]
    assert Trajectory(**f).num_generated == 0


@pytest.mark.parametrize("n", [3, 2 * SHORT_RECORD])
def test_version_range_is_the_oldest_and_newest_version(n: int) -> None:
    f = _fields(n)
    versions = torch.arange(n, dtype=torch.int32) % 7 + 2
    t = Trajectory(**{**f, "versions": versions})
    assert (t.oldest_version, t.newest_version) == (int(versions.min()), int(versions.max()))
    assert t.staleness(10) == 10 - int(versions.min())
