"""Crash-safe run files: checkpoint replacement, resume, torn JSONL lines.

A run directory holds at most three checkpoint directories at any moment::

    checkpoint/        the current checkpoint (always complete: it only ever appears by rename)
    checkpoint.new/    a checkpoint being written (complete only once its marker exists)
    checkpoint.old/    the previous checkpoint while it is being replaced or deleted

Replacing the checkpoint (`save_checkpoint_dir`) runs, in this order:

1. `stage`      remove leftovers of an interrupted save, create an empty `checkpoint.new/`;
2. `write`      the caller writes its files into it (trainer weights, controller state);
3. `fsync`      fsync every file and directory under it;
4. `marker`     write `COMPLETE` (sequence number, caller metadata, a manifest of every
                file and its size), fsync it and the directory: from here the new
                checkpoint counts;
5. `retire`     rename `checkpoint/` to `checkpoint.old/`, fsync the run directory;
6. `promote`    rename `checkpoint.new/` to `checkpoint/`, fsync the run directory;
7. `delete`     delete `checkpoint.old/`: its marker first (fsynced), so a half-deleted
                directory never looks complete, then its files, then the directory.

A crash (SIGKILL, power loss) at any point leaves at least one complete checkpoint,
and `latest_checkpoint` finds the newest one: the complete candidate with the highest
sequence number, moved back to `checkpoint/`, with the others deleted. A complete
checkpoint is one whose marker parses and whose manifest matches the files on disk.

`repair_jsonl` truncates a torn last line of an append-only JSONL file (a process killed
mid-write), with a warning, so that readers of metrics.jsonl and traces.jsonl never see
half a record.

Everything here is blocking file I/O; `save_checkpoint_dir` runs it in a worker thread.
Cancellation of `save_checkpoint_dir` while the caller's `write` runs leaves an
incomplete `checkpoint.new/` that the next save or resume removes; once the synchronous
commit runs (steps 3-7) it completes in its thread and the cancellation is delivered after.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

__all__ = [
    "MARKER",
    "checkpoint_meta",
    "commit_checkpoint_dir",
    "latest_checkpoint",
    "repair_jsonl",
    "save_checkpoint_dir",
    "stage_checkpoint_dir",
    "write_file_atomic",
]

MARKER = "COMPLETE"
_NEW, _OLD = ".new", ".old"

StepHook = Callable[[str], None]
"""Called with a step's name right after the step (tests kill the process there)."""


def _noop(_: str) -> None:
    pass


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replace `path` by `data`: write a sibling temporary file, fsync it, rename it over
    `path`, fsync the directory. A crash leaves the old or the new content, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MARKER)


def _delete(path: Path, on_step: StepHook = _noop) -> None:
    """Delete a checkpoint directory so that no intermediate state looks complete."""
    if not path.exists():
        return
    marker = path / MARKER
    if marker.exists():
        marker.unlink()
        _fsync_path(path)
        on_step("delete:marker")
    for f in _files(path):
        f.unlink()
        on_step("delete:file")
    for d in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        d.rmdir()
    path.rmdir()
    _fsync_path(path.parent)
    on_step("delete:dir")


def checkpoint_meta(path: Path) -> dict[str, Any] | None:
    """The marker of a complete checkpoint directory (`seq`, `meta`, `files`), or None when
    `path` is missing, has no readable marker, or misses a file its manifest lists."""
    try:
        marker = json.loads((path / MARKER).read_text())
        files = marker["files"]
        int(marker["seq"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for rel, size in files.items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != size:
            return None
    return marker


def stage_checkpoint_dir(ckpt_dir: Path, on_step: StepHook = _noop) -> Path:
    """Step 1: an empty `<ckpt_dir>.new/` to write the next checkpoint into."""
    staging = ckpt_dir.with_name(ckpt_dir.name + _NEW)
    _delete(staging, on_step)
    staging.mkdir(parents=True)
    _fsync_path(staging.parent)
    on_step("stage")
    return staging


def commit_checkpoint_dir(ckpt_dir: Path, staging: Path, meta: dict[str, Any] | None = None,
                          on_step: StepHook = _noop) -> Path:
    """Steps 3-7: make the files the caller wrote into `staging` the current checkpoint at
    `ckpt_dir`; returns `ckpt_dir`. `meta` (JSON) is kept in the marker."""
    files = _files(staging)
    for f in files:
        _fsync_path(f)
    for d in sorted({f.parent for f in files} | {staging}, key=lambda p: len(p.parts), reverse=True):
        _fsync_path(d)
    on_step("fsync")
    previous = [m for m in (checkpoint_meta(ckpt_dir), checkpoint_meta(ckpt_dir.with_name(ckpt_dir.name + _OLD)))
                if m is not None]
    seq = max((int(m["seq"]) for m in previous), default=0) + 1
    marker = {"seq": seq, "meta": meta or {}, "files": {str(f.relative_to(staging)): f.stat().st_size
                                                       for f in files}}
    with open(staging / MARKER, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(marker, sort_keys=True))
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_path(staging)
    on_step("marker")
    old = ckpt_dir.with_name(ckpt_dir.name + _OLD)
    if ckpt_dir.exists():
        _delete(old, on_step)  # a leftover of an earlier interrupted save: older than ckpt_dir
        os.rename(ckpt_dir, old)
        _fsync_path(ckpt_dir.parent)
        on_step("retire")
    os.rename(staging, ckpt_dir)
    _fsync_path(ckpt_dir.parent)
    on_step("promote")
    _delete(old, on_step)
    return ckpt_dir


async def save_checkpoint_dir(run_dir: Path, write: Callable[[Path], Awaitable[None]], *,
                              meta: dict[str, Any] | None = None, name: str = "checkpoint",
                              on_step: StepHook = _noop) -> Path:
    """Replace `run_dir/<name>/` crash-safely by what `write(staging_dir)` writes (see the
    module docstring); returns the checkpoint's path.

    `write` may call actors (the trainer writes its files itself; any process on this
    machine may write into the directory). If it raises, the incomplete staging directory is
    left for the next save or resume to remove, and the current checkpoint is untouched.
    """
    ckpt_dir = Path(run_dir) / name
    staging = await trio.to_thread.run_sync(stage_checkpoint_dir, ckpt_dir, on_step)
    await write(staging)
    on_step("write")
    return await trio.to_thread.run_sync(commit_checkpoint_dir, ckpt_dir, staging, meta, on_step)


def latest_checkpoint(run_dir: Path, *, name: str = "checkpoint", clean: bool = True) -> Path | None:
    """The newest complete checkpoint of a run, or None when there is none.

    With `clean` (the default, for resume), leftovers of an interrupted replacement are
    resolved first: the newest complete candidate is renamed to `run_dir/<name>/` and the
    other candidates are deleted, so the returned path is always `run_dir/<name>`.
    Without it, nothing is changed and the newest complete candidate's path is returned.
    """
    ckpt_dir = Path(run_dir) / name
    candidates = [ckpt_dir, ckpt_dir.with_name(name + _NEW), ckpt_dir.with_name(name + _OLD)]
    complete = [(int(m["seq"]), i, c) for i, c in enumerate(candidates) if (m := checkpoint_meta(c)) is not None]
    if not complete:
        if clean:
            for c in candidates[1:]:
                _delete(c)
        return None
    best = max(complete, key=lambda t: (t[0], -t[1]))[2]
    if not clean:
        return best
    if best != ckpt_dir:
        if ckpt_dir.exists():
            old = candidates[2]
            if best != old:
                _delete(old)
                os.rename(ckpt_dir, old)
                _fsync_path(ckpt_dir.parent)
        os.rename(best, ckpt_dir)
        _fsync_path(ckpt_dir.parent)
    for c in candidates[1:]:
        _delete(c)
    return ckpt_dir


def _warn(message: str) -> None:
    print(f"flotilla: warning: {message}", file=sys.stderr, flush=True)


def repair_jsonl(path: Path, *, warn: Callable[[str], None] = _warn) -> int:
    """Truncate a torn tail of an append-only JSONL file; returns the bytes removed (0 when
    the file is whole or missing), after calling `warn` with one line naming the file.

    The last line is torn when it lacks its newline or does not parse as JSON (a writer
    killed mid-line); a last line that parses but lacks its newline is kept and completed.
    Only that line is removed: a bad line earlier in the file is not
    what an interrupted append leaves, and is left for the reader to report.
    """
    path = Path(path)
    if not path.exists():
        return 0
    data = path.read_bytes()
    start = data.rfind(b"\n", 0, len(data) - 1) + 1 if data else 0  # start of the last line
    last = data[start:]
    if last and not last.endswith(b"\n") and _parses(last):  # whole record, newline lost
        with open(path, "ab") as f:
            f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
        warn(f"{path}: added the newline missing after its last record")
        return 0
    keep = len(data) if not last or not last.strip() or (last.endswith(b"\n") and _parses(last)) else start
    cut = len(data) - keep
    if cut:
        with open(path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        warn(f"{path}: removed a torn last line ({cut} bytes) left by an interrupted write")
    return cut


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True
