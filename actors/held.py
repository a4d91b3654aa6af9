"""Trajectories held where they were played, fetched by the trainer that trains them.

The controller decides on metadata alone: an environment actor puts each finished
trajectory in its ``TrajectoryStore`` and answers with a ``TrajectoryRef`` (rewards,
versions, lengths, pool; no tensors). When a batch is trained the trainer fetches its
tensors straight from the holders (``fetch_held``), and the controller releases what was
trained or dropped. So a trajectory's bytes cross one socket (environment → trainer)
instead of two through the controller's process.

Failure: a holder that died, restarted or does not answer within ``timeout_s`` makes
``fetch_held`` return ``MissingTrajectories`` naming every key it could not get; nothing
is trained, and the controller re-queues those rollouts (docs/architecture.md, Data path).
A fetched trajectory that does not match its ref (group, prompt, generated tokens) counts
as missing too.

A holder answers a fetch as one `HeldBatch`: each tensor field of every trajectory
concatenated into one tensor, so a batch travels as a few large frames per holder (through
shared memory when both ends share the machine) instead of six small ones per trajectory;
the trainer splits them back into views and validates each trajectory. The store's size is bounded (``max_held``, oldest evicted first and
counted): a controller that loses track of a ref cannot grow an actor without bound, and
an evicted ref is only ever missing, never wrong.
"""

from __future__ import annotations

import itertools
import uuid
from collections import OrderedDict
from typing import Any

import torch
import trio
from pydantic import BaseModel, ConfigDict, ValidationError

from actors.types import (
    LAYOUTS_CHECKED,
    TENSOR_DTYPES,
    TENSOR_FIELDS,
    MissingTrajectories,
    Trajectory,
    TrajectoryRef,
    check_layouts,
)
from orchestrator.runtime import ActorDied, ActorError, lend_buffer

__all__ = ["FETCH_TIMEOUT_S", "HeldBatch", "TrajectoryStore", "fetch_held"]

FETCH_TIMEOUT_S = 10.0
"""How long the trainer waits for one holder's answer before counting its trajectories
missing (a frozen holder; the controller names it unresponsive long before)."""


class TrajectoryStore:
    """Finished trajectories of one environment actor, by key, until released."""

    def __init__(self, max_held: int = 65_536) -> None:
        if max_held < 1:
            raise ValueError(f"max_held must be >= 1, got {max_held}")
        self.max_held = max_held
        self._prefix = uuid.uuid4().hex[:12]  # a restarted actor's keys never repeat
        self._next = itertools.count()
        self._held: OrderedDict[str, tuple[Trajectory, int]] = OrderedDict()
        self.held_bytes = 0
        self.evicted = 0
        self.fetched = 0

    def put(self, traj: Trajectory) -> TrajectoryRef:
        """Hold ``traj`` and return its ref; a failed episode is not held (key "")."""
        if traj.failed:
            return TrajectoryRef.of(traj, "")
        ref = TrajectoryRef.of(traj, f"{self._prefix}-{next(self._next)}")
        self._held[ref.key] = (traj, ref.nbytes)
        self.held_bytes += ref.nbytes
        while len(self._held) > self.max_held:
            _, (_, n) = self._held.popitem(last=False)
            self.held_bytes -= n
            self.evicted += 1
        return ref

    def get(self, keys: list[str]) -> list[Trajectory | None]:
        """The held trajectories of ``keys``, in order; None for a key not held."""
        out = [self._held[k][0] if k in self._held else None for k in keys]
        self.fetched += sum(t is not None for t in out)
        return out

    def release(self, keys: list[str]) -> int:
        """Forget ``keys`` (unknown ones are ignored); how many were held."""
        n = 0
        for k in keys:
            item = self._held.pop(k, None)
            if item is not None:
                self.held_bytes -= item[1]
                n += 1
        return n

    def __len__(self) -> int:
        return len(self._held)

    def stats(self) -> dict[str, int]:
        return {
            "held": len(self._held),
            "held_bytes": self.held_bytes,
            "held_evicted": self.evicted,
            "held_fetched": self.fetched,
        }


class HeldBatch(BaseModel):
    """Trajectories of one holder as one message: the fields of each found trajectory but
    its tensors (`meta`), and each tensor field of all of them concatenated (`tensors`, in
    `TENSOR_FIELDS` order) with every trajectory's length in each (`lengths`, int64 [n, 6])."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    found: list[bool]
    """Per key asked for: whether it was held."""
    meta: list[dict[str, Any]]
    lengths: torch.Tensor
    tensors: list[torch.Tensor]

    @classmethod
    def pack(cls, trajs: list[Trajectory | None]) -> HeldBatch:
        """The batch to send; its large tensors are concatenated into memory lent by the
        runtime (`lend_buffer`), so a peer on this machine gets them without another copy:
        send it once, then drop it."""
        held = [t for t in trajs if t is not None]
        fields = [[getattr(t, k) for t in held] for k in TENSOR_FIELDS]
        counts = [[x.numel() for x in col] for col in fields]
        lengths = torch.tensor(counts, dtype=torch.int64).T.reshape(-1, 6)
        tensors = [
            _concat(col, TENSOR_DTYPES[k], sum(n)) for k, col, n in zip(TENSOR_FIELDS, fields, counts, strict=True)
        ]
        return cls(
            found=[t is not None for t in trajs],
            meta=[t.model_dump(exclude=set(TENSOR_FIELDS)) for t in held],
            lengths=lengths,
            tensors=tensors,
        )

    def unpack(self) -> list[Trajectory | None]:
        """The trajectories (views into `tensors`), None where not held; ValueError naming
        the problem for a batch whose parts do not fit together."""
        n = sum(self.found)
        if len(self.meta) != n or tuple(self.lengths.shape) != (n, 6) or len(self.tensors) != 6:
            raise ValueError(f"held batch: {n} found, {len(self.meta)} meta rows, lengths {tuple(self.lengths.shape)}")
        for k, t, col in zip(TENSOR_FIELDS, self.tensors, self.lengths.T, strict=True):
            if t.dim() != 1 or t.numel() != int(col.sum()) or bool((col < 0).any()):
                raise ValueError(f"held batch: {k} holds {t.numel()} values, its lengths sum to {int(col.sum())}")
        check_layouts(self.tensors, self.lengths)
        parts = [torch.split(t, col.tolist()) for t, col in zip(self.tensors, self.lengths.T, strict=True)]
        checked = {LAYOUTS_CHECKED: True}  # just now, for the whole batch
        held = iter(
            Trajectory.model_validate(
                {**m, **{k: p[i] for k, p in zip(TENSOR_FIELDS, parts, strict=True)}}, context=checked
            )
            for i, m in enumerate(self.meta)
        )
        return [next(held) if f else None for f in self.found]


def _concat(parts: list[torch.Tensor], dtype: torch.dtype, numel: int) -> torch.Tensor:
    """``torch.cat(parts)`` written into a lent buffer (memory already mapped: no page
    faults on fresh pages, and no copy into shared memory when sent). Parts of another
    dtype are concatenated as they are, not cast: the receiver refuses them by name."""
    if not parts:
        return torch.empty(0, dtype=dtype)
    if numel == 0 or any(p.dtype != dtype for p in parts):
        return torch.cat(parts)
    out = torch.frombuffer(lend_buffer(numel * dtype.itemsize), dtype=dtype)
    return torch.cat(parts, out=out)


def _matches(t: Trajectory, ref: TrajectoryRef) -> bool:
    return t.group_id == ref.group_id and t.prompt_id == ref.prompt_id and t.num_generated == ref.num_generated


async def fetch_held(
    batch: list[Trajectory | TrajectoryRef], envs: Any, timeout_s: float = FETCH_TIMEOUT_S
) -> list[Trajectory] | MissingTrajectories:
    """``batch`` with every ref replaced by its trajectory, fetched from its holder (rank
    ``ref.holder`` of the environment mesh ``envs``; one call per holder, all at once);
    trajectories in ``batch`` stay as they are. ``MissingTrajectories`` if any could not be
    fetched."""
    out: list[Any] = list(batch)
    by_holder: dict[int, list[int]] = {}
    for i, item in enumerate(batch):
        if isinstance(item, TrajectoryRef):
            if not item.key:
                raise ValueError(f"{item.prompt_id}/{item.group_id}: a failed episode's ref holds nothing to train")
            by_holder.setdefault(item.holder, []).append(i)
    if by_holder and envs is None:
        raise ValueError("a batch of held trajectories needs the environment mesh that holds them")
    missing: list[str] = []
    reasons: list[str] = []

    async def one(holder: int, idx: list[int]) -> None:
        keys = [batch[i].key for i in idx]
        try:
            with trio.fail_after(timeout_s):
                answer = await envs[holder].fetch_held.call_one(keys)
            got = answer.unpack() if isinstance(answer, HeldBatch) else None
        except (ActorDied, ActorError, trio.TooSlowError, IndexError, ValueError, ValidationError) as e:
            missing.extend(keys)
            reasons.append(f"environment actor {holder}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            return
        if got is None or len(got) != len(keys):
            missing.extend(keys)
            reasons.append(f"environment actor {holder}: answered {type(answer).__name__} for {len(keys)} keys")
            return
        lost = 0
        for i, t in zip(idx, got, strict=True):
            ref = batch[i]
            if t is None or not _matches(t, ref):
                missing.append(ref.key)
                lost += 1
            else:
                out[i] = t
        if lost:
            reasons.append(f"environment actor {holder}: {lost} of {len(idx)} trajectories not held")

    async with trio.open_nursery() as nursery:
        for holder, idx in by_holder.items():
            nursery.start_soon(one, holder, idx)
    if missing:
        return MissingTrajectories(keys=missing, reason="; ".join(reasons))
    return out
