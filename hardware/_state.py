"""Checkpointed state of the registry's parts: validated before anything changes."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

__all__ = ["parse_state"]

M = TypeVar("M", bound=BaseModel)


def parse_state(model: type[M], state: dict[str, Any], what: str, named: Iterable[str], pools: Collection[str]) -> M:
    """`state` validated as `model`; ValueError naming `what` and the field if it is malformed,
    or the pools it names (`named`, a function of the parsed state's keys) that are not in
    `pools`: restoring them would make a pool's figures vanish or belong to another run."""
    try:
        parsed = model.model_validate(state)
    except ValidationError as e:
        raise ValueError(f"{what}: {e}") from e
    unknown = [name for name in named(parsed) if name not in pools]  # type: ignore[operator]
    if unknown:
        raise ValueError(f"{what}: unknown pool(s) {', '.join(map(repr, unknown))}; pools: {', '.join(pools)}")
    return parsed
