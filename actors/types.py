"""Messages between the controller, environment actors and the trainer.

``TaskSpec`` says which episode to play, ``SamplingParams`` how to sample it, and a
``Trajectory`` is what an episode produced: the token sequence exactly as the
model saw it, which tokens the sampler generated (the loss mask), the support
record of every generated token and the policy version that produced it.
All are pydantic models, so they travel on the runtime's wire as they are.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

__all__ = [
    "LAYOUTS_CHECKED",
    "MissingTrajectories",
    "SamplingParams",
    "TaskSpec",
    "Trajectory",
    "TrajectoryRef",
    "check_layouts",
]


class TaskSpec(BaseModel):
    """One episode to play: which task, which prompt, which GRPO group."""

    model_config = ConfigDict(extra="forbid")

    task: str
    """Registered task name (``guess_number``, ``arithmetic`` or a user task)."""
    prompt_id: str
    """Identifies the prompt; episodes of one prompt share it."""
    group_id: str
    """GRPO group: advantages are centred over trajectories with the same group_id."""
    seed: int = 0
    """Seeds the task instance (e.g. the secret of guess_number); same seed, same prompt."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the task's constructor (e.g. ``{"n": 16, "max_turns": 4}``)."""


class SamplingParams(BaseModel):
    """How the sampler draws tokens for an episode (the recipe's sampling settings)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0)
    """Softmax temperature; 0 means greedy (support {y}, log q = 0)."""
    top_k: int = Field(64, ge=0)
    """Keep at most this many candidates before top-p (0 = no cap)."""
    top_p: float = Field(0.97, gt=0.0, le=1.0)
    """Nucleus mass kept after top-k."""
    min_keep: int = Field(2, ge=1)
    """Top-p keeps at least this many ids (the recipe's ``min_keep``; 1 = plain nucleus)."""
    max_new_tokens: int = Field(16, ge=1)
    """Per-turn generation limit, used when the environment sets none of its own."""


SHORT_RECORD = 256  # entries up to which a layout check reads a tensor as a Python list


def _check_1d(name: str, t: Any, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"Trajectory.{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"Trajectory.{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"Trajectory.{name} must have dtype in {dtypes}, got {t.dtype}")
    return t


class Trajectory(BaseModel):
    """One episode as the model saw it, with everything the recipe's loss needs.

    Invariants (checked on construction, also on arrival over the wire):
    ``tokens`` and ``loss_mask`` have the same length L; ``loss_mask`` is True exactly
    on sampler-generated tokens (n of them); the support record has one CSR row per
    generated token, in order (``support_offsets`` has n+1 entries, starts at 0, is
    non-decreasing and ends at ``len(support_ids)`` == ``len(support_logq)``);
    ``versions`` has n entries.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    task: str
    """Task name."""
    prompt_id: str
    """Prompt identity (from the TaskSpec)."""
    group_id: str
    """GRPO group (from the TaskSpec)."""
    pool: str
    """Sampler pool that generated the tokens ("" if no token was generated)."""
    tokens: torch.Tensor
    """int64 [L]: prompt + every turn, as the model saw them."""
    loss_mask: torch.Tensor
    """bool [L]: True exactly on sampler-generated tokens."""
    support_ids: torch.Tensor
    """int32 [nnz]: CSR ids of each generated token's sampling support."""
    support_offsets: torch.Tensor
    """int32 [n+1]: CSR row offsets, one row per True in loss_mask, in order."""
    support_logq: torch.Tensor
    """float32 [nnz]: sampler log q over each support (renormalised processed probabilities)."""
    versions: torch.Tensor
    """int32 [n]: policy version of the weights that produced each generated token."""
    reward: float
    """Episode return (sum of step rewards; 0 for a failed episode)."""
    failed: bool = False
    """True when the environment raised or timed out; such trajectories are not trained on."""
    error: str | None = None
    """What went wrong when ``failed`` (one line: exception type and message)."""
    error_traceback: str | None = None
    """The end of the failure's traceback (at most ~2,000 characters), when ``failed``
    by an exception: where in the environment (or sampler call) it happened."""
    sampler_lost: bool = False
    """With ``failed``: the episode failed because its sampler died or stopped answering
    mid-episode, not because of the environment (the controller does not count it toward
    ``[task] max_failed_in_a_row``; the prompt is retried either way)."""
    turns: int
    """Assistant turns played."""
    segments: int = 1
    """Segments the conversation was split into: a new one starts where a gateway harness
    rewrote its history, or where the chat template rewrites earlier turns (e.g. drops their
    reasoning); the tokens here are the last segment's, earlier ones are not trained on."""
    seconds: float
    """Wall time of the episode."""

    @model_validator(mode="after")
    def _check_layout(self, info: ValidationInfo) -> Trajectory:
        if info.context is not None and info.context.get(LAYOUTS_CHECKED):
            return self  # one of a batch whose layouts `check_layouts` checked together
        for name, dtype in TENSOR_DTYPES.items():
            _check_1d(name, getattr(self, name), (dtype,))
        # Most trajectories are short, and each torch call costs microseconds on a small
        # tensor: up to SHORT_RECORD entries the counts and offsets are checked as Python values.
        L, mask = self.tokens.numel(), self.loss_mask
        n = mask.tolist().count(True) if mask.numel() <= SHORT_RECORD else int(mask.sum())
        if self.loss_mask.numel() != L:
            raise ValueError(f"Trajectory.loss_mask has {self.loss_mask.numel()} entries, tokens {L}")
        if self.support_offsets.numel() != n + 1:
            raise ValueError(
                f"Trajectory.support_offsets has {self.support_offsets.numel()} entries; "
                f"expected {n + 1} (one row per generated token + 1)"
            )
        if self.versions.numel() != n:
            raise ValueError(
                f"Trajectory.versions has {self.versions.numel()} entries; expected {n} (one per generated token)"
            )
        nnz = self.support_ids.numel()
        if self.support_logq.numel() != nnz:
            raise ValueError(f"Trajectory.support_logq has {self.support_logq.numel()} entries, support_ids {nnz}")
        off = self.support_offsets
        if off.numel() <= SHORT_RECORD:
            o = off.tolist()
            bad = o[0] != 0 or o[-1] != nnz or any(b < a for a, b in itertools.pairwise(o))
        else:
            bad = int(off[0]) != 0 or int(off[-1]) != nnz or bool((off[1:] < off[:-1]).any())
        if bad:
            raise ValueError(
                f"Trajectory.support_offsets must start at 0, be non-decreasing and end at len(support_ids)={nnz}"
            )
        return self

    @property
    def num_generated(self) -> int:
        """Number of sampler-generated tokens (rows of the support record)."""
        return self.versions.numel()

    def _version_range(self) -> tuple[int, int]:
        """(oldest, newest) policy version of the generated tokens, (0, 0) if none; kept
        for the ``versions`` tensor it was computed from (the controller asks often)."""
        cached = self.__dict__.get("_version_range_of")
        v = self.versions
        if cached is None or cached[0] is not v:
            if v.numel() <= SHORT_RECORD:
                vs = v.tolist()
                rng = (min(vs), max(vs)) if vs else (0, 0)
            else:
                rng = (int(v.min()), int(v.max()))
            cached = self.__dict__["_version_range_of"] = (v, rng)
        return cached[1]

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among the generated tokens (0 if none)."""
        return self._version_range()[0]

    @property
    def newest_version(self) -> int:
        """The newest policy version among the generated tokens (0 if none)."""
        return self._version_range()[1]

    def staleness(self, trainer_version: int) -> int:
        """``trainer_version`` − the oldest version among the generated tokens."""
        return trainer_version - self.oldest_version


class TrajectoryRef(BaseModel):
    """A finished trajectory that its environment actor holds: everything the controller
    decides on (admission, staleness, batching, accounting) without the tensors.

    The trainer fetches the tensors from the holder (``actors.held``); a failed episode
    holds nothing (``key`` is empty: it is never trained). ``holder`` is the rank, in the
    environment mesh, of the actor that holds it; the controller's link sets it.
    """

    model_config = ConfigDict(extra="forbid")

    key: str
    """The holder's name for it (empty: nothing held)."""
    holder: int = -1
    """Rank of the holding actor in the environment mesh."""
    task: str
    prompt_id: str
    group_id: str
    pool: str
    reward: float
    failed: bool = False
    error: str | None = None
    error_traceback: str | None = None
    sampler_lost: bool = False
    turns: int
    segments: int = 1
    seconds: float
    num_generated: int
    """Sampler-generated tokens (``Trajectory.num_generated``)."""
    num_tokens: int
    """All tokens of the sequence."""
    oldest_version: int
    newest_version: int
    nbytes: int
    """Bytes of the held tensors."""

    @classmethod
    def of(cls, traj: Trajectory, key: str) -> TrajectoryRef:
        fields = {k: getattr(traj, k) for k in _META}
        return cls(
            key=key,
            **fields,
            num_generated=traj.num_generated,
            num_tokens=traj.tokens.numel(),
            oldest_version=traj.oldest_version,
            newest_version=traj.newest_version,
            nbytes=sum(getattr(traj, k).nbytes for k in TENSOR_FIELDS),
        )

    def staleness(self, trainer_version: int) -> int:
        """``trainer_version`` − the oldest version among the generated tokens."""
        return trainer_version - self.oldest_version


class MissingTrajectories(BaseModel):
    """What a trainer answers instead of a step when it could not fetch every trajectory
    of a batch (its holder died, restarted or did not answer): nothing was trained."""

    model_config = ConfigDict(extra="forbid")

    keys: list[str]
    """The ``TrajectoryRef.key`` of every trajectory it could not fetch."""
    reason: str
    """What went wrong, one line per holder."""


TENSOR_FIELDS = ("tokens", "loss_mask", "support_ids", "support_offsets", "support_logq", "versions")
"""The tensors of a `Trajectory`."""
TENSOR_DTYPES = dict(
    zip(TENSOR_FIELDS, (torch.int64, torch.bool, torch.int32, torch.int32, torch.float32, torch.int32), strict=True)
)
"""The dtype of each tensor of a `Trajectory`."""

LAYOUTS_CHECKED = "flotilla.layouts_checked"
"""Validation context key: `Trajectory.model_validate(data, context={LAYOUTS_CHECKED:
True})` skips the per-trajectory layout check, for trajectories cut from a batch that
`check_layouts` has just checked whole."""


def check_layouts(tensors: list[torch.Tensor], lengths: torch.Tensor) -> None:
    """`Trajectory`'s layout invariants for a batch whose tensor fields are concatenated
    (`tensors`, in `TENSOR_FIELDS` order; `lengths`: int64 [n, 6], each trajectory's
    length in each, non-negative and summing to the tensors' lengths): the checks of
    `Trajectory._check_layout` in a few tensor operations for the whole batch instead of
    several per trajectory. ValueError naming the first trajectory that breaks one."""
    for (name, dtype), t in zip(TENSOR_DTYPES.items(), tensors, strict=True):
        _check_1d(name, t, (dtype,))
    if lengths.shape[0] == 0:
        return
    ln = lengths.to(torch.int64)
    tok, msk, ids, off, logq, ver = ln.unbind(1)
    mask_end = msk.cumsum(0)
    # Marked tokens before each position, summed straight from the bools into one buffer
    # (no int64 copy of the mask, no concatenation; int32 while the count fits).
    mask = tensors[1]
    marked = torch.zeros(mask.numel() + 1, dtype=torch.int32 if mask.numel() < 2**31 else torch.int64)
    torch.cumsum(mask, 0, dtype=marked.dtype, out=marked[1:])
    n = (marked[mask_end] - marked[mask_end - msk]).to(torch.int64)  # generated tokens per trajectory
    for bad, what in (
        (msk != tok, "loss_mask and tokens differ in length"),
        (off != n + 1, "support_offsets does not have one entry per generated token + 1"),
        (ver != n, "versions does not have one entry per generated token"),
        (logq != ids, "support_logq and support_ids differ in length"),
    ):
        _first_bad(bad, what)
    o = tensors[3]
    off_end = off.cumsum(0)
    off_start = off_end - off
    _first_bad(
        (o[off_start] != 0) | (o[off_end - 1] != ids), "support_offsets must start at 0 and end at len(support_ids)"
    )
    falls = o[1:] < o[:-1]
    falls[off_start[1:] - 1] = False  # one trajectory's last offset to the next one's first
    if bool(falls.any()):
        at = int(falls.nonzero()[0, 0]) + 1  # an offset below the one before it
        i = int(torch.searchsorted(off_end, torch.tensor([at]), right=True)[0])
        raise ValueError(f"trajectory {i} of the batch: support_offsets must be non-decreasing")


def _first_bad(bad: torch.Tensor, what: str) -> None:
    if bool(bad.any()):
        raise ValueError(f"trajectory {int(bad.nonzero()[0, 0])} of the batch: {what}")


_META = (
    "task",
    "prompt_id",
    "group_id",
    "pool",
    "reward",
    "failed",
    "error",
    "error_traceback",
    "sampler_lost",
    "turns",
    "segments",
    "seconds",
)
