"""What a delta changed: per tensor, the flat indices of the elements whose value changed,
gathered from the positions the chunk decoder finds anyway (`decode_xor_into(...,
positions=True)`), so a copy of the weights elsewhere (a sampler's compute weights) can be
refreshed at those elements only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["NO_CHANGE", "Changes", "chunk_positions", "gather_changes"]

Changes = dict[str, np.ndarray | None]
"""What a delta changed, per tensor it touched: the ascending flat indices (int32, or
int64 for tensors of 2**31 elements or more) of exactly the elements whose value
changed, or None where that is not worth listing (a chunk of it was sent dense, or more
than 1/_DENSE_SHARE of the elements of one of its chunks or of the whole tensor changed):
then any element may have. A tensor the delta left alone is absent. Indices are held for
at most 1/_DENSE_SHARE of a tensor's elements (about a byte per element in int32; twice
that for a moment while a tensor's chunks are joined)."""

_DENSE_SHARE = 4

NO_CHANGE = np.empty(0, np.int64)
"""A chunk's entry when nothing in it changed."""


def chunk_positions(pos: np.ndarray | None, chunk_words: int, start: int, tensor_words: int) -> np.ndarray | None:
    """One chunk's entry: its changed positions `pos` (None: sent dense) as flat indices
    of the tensor (the chunk starts at word `start`), or None when not worth listing."""
    if pos is None or pos.size * _DENSE_SHARE > chunk_words:
        return None
    dtype = np.int32 if tensor_words <= np.iinfo(np.int32).max else np.int64
    out = pos.astype(dtype)
    out += start
    return out


def gather_changes(
    names: Sequence[str], sizes: Sequence[int], chunk_tensor: Sequence[int], found: Sequence[np.ndarray | None]
) -> Changes:
    """`Changes` from per-chunk entries (`chunk_positions` or `NO_CHANGE`), chunk k
    belonging to tensor `chunk_tensor[k]` (of `sizes[i]` words), in ascending order."""
    per_tensor: dict[int, list[np.ndarray | None]] = {}
    for i, pos in zip(chunk_tensor, found, strict=True):
        if pos is None or pos.size:
            per_tensor.setdefault(i, []).append(pos)
    out: Changes = {}
    for i, ps in per_tensor.items():
        listed = [p for p in ps if p is not None]
        whole = len(listed) < len(ps) or sum(p.size for p in listed) * _DENSE_SHARE > sizes[i]
        out[names[i]] = None if whole else listed[0] if len(listed) == 1 else np.concatenate(listed)
    return out
