"""Task instances from a file: one JSONL/JSON/Parquet row per episode's ``TaskSpec.params``.

``[task] dataset = "data/train.jsonl"`` gives one task instance per row.  Prompt ``i``
of a run plays row ``order(epoch)[i mod n]`` with ``epoch = i // n``, where
``order(epoch)`` is a permutation seeded by the run's seed and the epoch: rows are
shuffled per epoch, every row is played once per epoch, and because the row is a
function of the prompt index alone, a resumed run (which continues at the saved
prompt index) continues at the same row.

Files are read with the ``datasets`` library's local loaders (``json`` for
``.jsonl``/``.json``, ``parquet`` for ``.parquet``); nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from orchestrator.runtime import clip

__all__ = ["DatasetError", "TaskDataset"]

_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file (and row)."""


def _check_json(path: Path) -> list[int] | None:
    """Raise DatasetError naming ``path:line`` for the first row that is not a JSON object:
    each line of a ``.jsonl`` file (read one at a time), or the items of a ``.json`` file
    holding one array (a ``.json`` file of JSON lines is checked line by line; one holding
    an object is left to the loader). Returns the line number of each row for JSON lines,
    else None."""
    if path.suffix.lower() == ".json":
        data = path.read_bytes()
        try:
            rows = json.loads(data)
        except ValueError as e:
            if data.lstrip()[:1] == b"[":
                line = getattr(e, "lineno", None)
                where = f"{path}:{line}" if line is not None else str(path)
                raise DatasetError(f"dataset {where}: not valid JSON: {clip(getattr(e, 'msg', e))}") from None
        else:
            if isinstance(rows, list):
                bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
                if bad is not None:
                    raise DatasetError(f"dataset {path}: item {bad} of its array is not a JSON object")
            return None
    lines: list[int] = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except ValueError as e:
                text = clip(raw.decode(errors="replace").strip(), 80)
                raise DatasetError(
                    f"dataset {path}:{number}: not valid JSON: {clip(getattr(e, 'msg', e))} (the line: {text})"
                ) from None
            if not isinstance(row, dict):
                raise DatasetError(f"dataset {path}:{number}: a row must be a JSON object, got {type(row).__name__}")
            lines.append(number)
    return lines


class TaskDataset:
    """The rows of one dataset file, as task parameter dicts (see the module docstring)."""

    def __init__(self, rows: list[dict[str, Any]], source: str = "<rows>", lines: list[int] | None = None) -> None:
        self.rows = rows
        self.source = source
        self._lines = lines if lines is not None and len(lines) == len(rows) else None
        if not rows:
            raise DatasetError(f"dataset {source}: no rows")
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise DatasetError(f"dataset {self.where(i)}: not an object")
        self._orders: dict[tuple[int, int], list[int]] = {}

    def where(self, i: int) -> str:
        """Where row ``i`` is: ``file:line`` for JSON lines, else ``file row i``."""
        if self._lines is not None:
            return f"{self.source}:{self._lines[i]}"
        return f"{self.source} row {i}"

    @classmethod
    def load(cls, path: str | Path) -> TaskDataset:
        """Read a local ``.jsonl``/``.json``/``.parquet`` file with ``datasets``.

        Raises DatasetError naming the file for a missing file, an unknown suffix or
        content the loader rejects.
        """
        p = Path(path)
        loader = _LOADERS.get(p.suffix.lower())
        if loader is None:
            raise DatasetError(f"dataset {path}: unknown file type {p.suffix!r} (use {', '.join(_LOADERS)})")
        if not p.is_file():
            raise DatasetError(f"dataset {path}: no such file")
        import datasets

        datasets.disable_progress_bars()
        # A bad row is named by its line, which the loader does not do.
        lines = _check_json(p) if loader == "json" else None
        try:
            ds = datasets.load_dataset(loader, data_files=str(p.resolve()), split="train", keep_in_memory=True)
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DatasetError(f"dataset {path}: cannot be read: {clip(msg)}") from e
        # Rows as plain Python: they travel to the env actors inside TaskSpec.params (JSON).
        rows = [{k: v for k, v in row.items() if v is not None} for row in ds.to_list()]
        return cls(rows, str(path), lines)

    def __len__(self) -> int:
        return len(self.rows)

    def index(self, i: int, seed: int) -> int:
        """Row played by prompt ``i`` of a run seeded ``seed``."""
        epoch, pos = divmod(i, len(self.rows))
        key = (seed, epoch)
        order = self._orders.get(key)
        if order is None:
            order = list(range(len(self.rows)))
            random.Random(f"{seed}/{epoch}").shuffle(order)
            self._orders = {key: order}  # one epoch at a time is all a run needs
        return order[pos]

    def params(self, i: int, seed: int) -> dict[str, Any]:
        """The task parameters of prompt ``i`` (a copy of its row)."""
        return dict(self.rows[self.index(i, seed)])
