"""`SupportRecord`: the sampler's kept top-k/top-p set per generated token, in CSR form.

Row t of a record describes generated token t:

    ids[offsets[t]:offsets[t+1]]   the kept token ids S_t, in rank order (descending q),
    logq[offsets[t]:offsets[t+1]]  log q_t(v) for v in S_t, the *processed* sampler
                                   probabilities renormalised over S_t (log-sum-exp = 0).

Dtypes are fixed by the wire contract: ids int32, offsets int32 (n_rows + 1 entries,
offsets[0] = 0, non-decreasing, offsets[-1] = nnz), logq float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SupportRecord"]


@dataclass(frozen=True)
class SupportRecord:
    """CSR record of the sampler's kept support per generated token.

    Construction checks shapes and dtypes only (cheap, no device sync); `check()`
    also verifies offsets and per-row uniqueness and raises `ValueError` naming the
    first bad row.
    """

    ids: Tensor
    """int32 [nnz]: kept token ids, rows concatenated, each row in rank order."""
    offsets: Tensor
    """int32 [n_rows + 1]: row t is ids[offsets[t]:offsets[t+1]]."""
    logq: Tensor
    """float32 [nnz]: log of the renormalised processed sampler probability of each id."""

    def __post_init__(self) -> None:
        for name, t, dtype in (
            ("ids", self.ids, torch.int32),
            ("offsets", self.offsets, torch.int32),
            ("logq", self.logq, torch.float32),
        ):
            if not isinstance(t, Tensor):
                raise TypeError(f"SupportRecord.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 1:
                raise ValueError(f"SupportRecord.{name} must be 1-D, got shape {tuple(t.shape)}")
            if t.dtype != dtype:
                raise ValueError(f"SupportRecord.{name} must be {dtype}, got {t.dtype}")
        if self.offsets.numel() < 1:
            raise ValueError("SupportRecord.offsets must have n_rows + 1 >= 1 entries")
        if self.ids.numel() != self.logq.numel():
            raise ValueError(f"SupportRecord.ids has {self.ids.numel()} entries but logq has {self.logq.numel()}")

    # ------------------------------------------------------------------ shape
    @property
    def n_rows(self) -> int:
        """Number of rows (generated tokens)."""
        return self.offsets.numel() - 1

    @property
    def nnz(self) -> int:
        """Total number of kept entries over all rows."""
        return self.ids.numel()

    @property
    def device(self) -> torch.device:
        """Device of the record's tensors."""
        return self.ids.device

    def counts(self) -> Tensor:
        """int64 [n_rows]: support size per row."""
        return (self.offsets[1:] - self.offsets[:-1]).long()

    def row_index(self) -> Tensor:
        """int64 [nnz]: the row each entry belongs to (CSR -> COO)."""
        return torch.repeat_interleave(
            torch.arange(self.n_rows, device=self.device), self.counts(), output_size=self.nnz
        )

    # ------------------------------------------------------------- validation
    def check(self) -> None:
        """Full validation: offsets start at 0, never decrease, end at nnz; no empty row;
        no id repeated inside a row; ids non-negative. Raises ValueError naming the row."""
        off = self.offsets.long()
        if int(off[0]) != 0:
            raise ValueError(f"SupportRecord.offsets[0] must be 0, got {int(off[0])}")
        if int(off[-1]) != self.nnz:
            raise ValueError(f"SupportRecord.offsets[-1] must equal nnz={self.nnz}, got {int(off[-1])}")
        counts = off[1:] - off[:-1]
        bad = torch.nonzero(counts <= 0).flatten()
        if bad.numel():
            raise ValueError(
                f"SupportRecord row {int(bad[0])} has {int(counts[bad[0]])} entries; "
                "every generated token needs a non-empty support"
            )
        if self.nnz and int(self.ids.min()) < 0:
            raise ValueError("SupportRecord.ids contains a negative token id")
        if self.nnz > 1:
            # Sort (row, id) pairs; a repeat shows up as equal neighbours.
            key = self.row_index() * (int(self.ids.max()) + 1) + self.ids.long()
            skey = torch.sort(key).values
            dup = torch.nonzero(skey[1:] == skey[:-1]).flatten()
            if dup.numel():
                row = int(skey[dup[0]]) // (int(self.ids.max()) + 1)
                raise ValueError(f"SupportRecord row {row} repeats a token id")

    # ------------------------------------------------------------ conversions
    def to(self, device: torch.device | str) -> SupportRecord:
        """The same record on `device`."""
        return SupportRecord(self.ids.to(device), self.offsets.to(device), self.logq.to(device))

    def rows(self, start: int, stop: int) -> SupportRecord:
        """Rows [start, stop) as a new record (offsets rebased to 0)."""
        if not 0 <= start <= stop <= self.n_rows:
            raise ValueError(f"row range [{start}, {stop}) outside [0, {self.n_rows}]")
        a, b = int(self.offsets[start]), int(self.offsets[stop])
        return SupportRecord(self.ids[a:b], (self.offsets[start : stop + 1] - a).to(torch.int32), self.logq[a:b])

    def token_index(self, tokens: Tensor) -> Tensor:
        """int64 [n_rows]: flat entry index of tokens[t] inside row t.

        Raises ValueError naming the first position whose token is not in its support
        (never silently widened, docs/architecture.md, The recipe, 2).
        """
        if tokens.dim() != 1 or tokens.numel() != self.n_rows:
            raise ValueError(f"tokens must have shape [{self.n_rows}] (one per support row), got {tuple(tokens.shape)}")
        row = self.row_index()
        hit = self.ids.long() == tokens.to(self.device).long()[row]
        n_hit = torch.zeros(self.n_rows, dtype=torch.long, device=self.device).index_add_(0, row, hit.long())
        bad = torch.nonzero(n_hit != 1).flatten()
        if bad.numel():
            t = int(bad[0])
            what = "is not in" if int(n_hit[t]) == 0 else "appears more than once in"
            raise ValueError(
                f"token {int(tokens[t])} at position {t} {what} its recorded support "
                f"({int(self.counts()[t])} ids); {bad.numel()} bad position(s) in total"
            )
        return torch.nonzero(hit).flatten()

    @staticmethod
    def cat(records: Sequence[SupportRecord]) -> SupportRecord:
        """Concatenate rows of several records (e.g. the trajectories of a micro-batch)."""
        if not records:
            raise ValueError("SupportRecord.cat needs at least one record")
        shifts = [0]
        for r in records[:-1]:
            shifts.append(shifts[-1] + r.nnz)
        offsets = [records[0].offsets[:1].long()] + [
            r.offsets[1:].long() + s for r, s in zip(records, shifts, strict=True)
        ]
        return SupportRecord(
            torch.cat([r.ids for r in records]),
            torch.cat(offsets).to(torch.int32),
            torch.cat([r.logq for r in records]),
        )
