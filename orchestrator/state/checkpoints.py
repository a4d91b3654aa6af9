"""Crash-safe, checksummed run files: checkpoint replacement, resume, torn JSONL lines.

A run directory holds at most these checkpoint directories at any moment::

    checkpoint/          the current checkpoint (it only ever appears by rename)
    checkpoint.new/      a checkpoint being written (complete only once its marker exists)
    checkpoint.old/      the previous checkpoint while it is being replaced or deleted
    checkpoint.corrupt/  a checkpoint that failed verification at resume, kept for inspection

Replacing the checkpoint (`save_checkpoint_dir`) runs, in this order:

1. `stage`      remove leftovers of an interrupted save, create an empty `checkpoint.new/`;
2. `write`      the caller writes its files into it (trainer weights, controller state);
3. `fsync`      read every file back, hashing it (xxh3-128, in chunks), and fsync it and
                every directory under it;
4. `marker`     write `COMPLETE` (sequence number, caller metadata, a manifest of every
                file with its size and digest), fsync it and the directory: from here the
                new checkpoint counts;
5. `verify`     drop the files from the page cache and hash them again from the disk
                against the marker; a mismatch raises `CheckpointError` and nothing older is
                touched (the next resume skips the new one);
6. `retire`     rename `checkpoint/` to `checkpoint.old/`, fsync the run directory;
7. `promote`    rename `checkpoint.new/` to `checkpoint/`, fsync the run directory;
8. `delete`     delete `checkpoint.old/`: its marker first (fsynced), so a half-deleted
                directory never looks complete, then its files, then the directory.

So no checkpoint is deleted before a newer one has verified on disk, and a crash
(SIGKILL, power loss) at any point leaves at least one complete checkpoint.

A checkpoint is *complete* when its marker parses and every file it lists has the listed
size, and it *verifies* when, in addition, every file has the listed digest.
`latest_checkpoint` (resume) picks the newest candidate that verifies: a newer one that
does not is never loaded; it is moved to `checkpoint.corrupt/` and the fallback is
reported in one line; with no candidate that verifies but some that fail, it raises
`CheckpointError` naming the file and the mismatch. Markers written before digests
existed carry sizes only: such a checkpoint is accepted on its sizes, with a warning.

`repair_jsonl` truncates a torn last line of an append-only JSONL file (a process killed
mid-write), with a warning, so that readers of metrics.jsonl and traces.jsonl never see
half a record.

Everything here is blocking file I/O; `save_checkpoint_dir` runs it in a worker thread.
Cancellation of `save_checkpoint_dir` while the caller's `write` runs leaves an
incomplete `checkpoint.new/` that the next save or resume removes; once the synchronous
commit runs (steps 3-8) it completes in its thread and the cancellation is delivered after.
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
    "CheckpointError",
    "checkpoint_meta",
    "commit_checkpoint_dir",
    "file_digest",
    "latest_checkpoint",
    "repair_jsonl",
    "save_checkpoint_dir",
    "stage_checkpoint_dir",
    "verify_checkpoint",
    "write_file_atomic",
]

MARKER = "COMPLETE"
DIGEST = "xxh3-128"
_NEW, _OLD, _CORRUPT = ".new", ".old", ".corrupt"
_CHUNK = 8 << 20  # bytes hashed at a time: a multi-GB file is never in memory at once

StepHook = Callable[[str], None]
"""Called with a step's name right after the step (tests kill the process there)."""


class CheckpointError(ValueError):
    """A checkpoint or model file that cannot be used: the message is one line naming the
    file and the problem (a digest mismatch, an unreadable header, non-finite values...).

    Raised in an actor process it reaches the controller as an ``ActorError`` whose
    ``remote_type`` is this class's qualified name; `orchestrator.entry.runner` turns it back
    into this exception, and the CLI prints it as one line."""


def _noop(_: str) -> None:
    pass


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path, *, sync: bool = False, uncached: bool = False) -> str:
    """The xxh3-128 hex digest of a file, read in chunks of `_CHUNK` bytes.

    `sync` fsyncs the file after reading it; `uncached` first asks the kernel to drop the
    file's pages, so the bytes hashed are the ones on the disk, not the ones written."""
    import xxhash

    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        if uncached and hasattr(os, "posix_fadvise"):  # Linux; elsewhere the cache is read
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        while n := f.readinto(buf):
            h.update(view[:n])
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


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


def _read_marker(path: Path) -> dict[str, Any] | None:
    """The parsed marker of `path`, or None when it is missing or malformed (an
    interrupted save or deletion: the marker is written last and deleted first)."""
    try:
        marker = json.loads((path / MARKER).read_text())
        int(marker["seq"])
        if not isinstance(marker["files"], dict) or not isinstance(marker.get("digests", {}), dict):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return marker


def _size_problem(path: Path, marker: dict[str, Any]) -> str | None:
    for rel, size in marker["files"].items():
        f = path / rel
        if not f.is_file():
            return f"{f}: missing (the checkpoint's marker lists it)"
        if f.stat().st_size != size:
            return f"{f}: {f.stat().st_size} bytes, the checkpoint's marker records {size}"
    return None


def _digest_problem(path: Path, marker: dict[str, Any], *, uncached: bool = False) -> str | None:
    for rel, want in marker.get("digests", {}).items():
        f = path / rel
        try:
            got = file_digest(f, uncached=uncached)
        except OSError as e:
            return f"{f}: cannot be read ({e.strerror or e})"
        if got != want:
            return f"{f}: {DIGEST} digest {got} does not match {want} recorded when it was written"
    return None


def checkpoint_meta(path: Path) -> dict[str, Any] | None:
    """The marker of a complete checkpoint directory (`seq`, `meta`, `files`, and
    `digests` when written by this version), or None when `path` is missing, has no
    readable marker, or misses a file its manifest lists (sizes only; digests are
    `verify_checkpoint`'s)."""
    marker = _read_marker(path)
    if marker is None or _size_problem(path, marker) is not None:
        return None
    return marker


def verify_checkpoint(path: Path) -> str | None:
    """None when the checkpoint at `path` verifies (marker, sizes and every file's digest),
    else one line naming the file and the problem. A marker without digests (the format
    before digests) verifies on its sizes."""
    marker = _read_marker(path)
    if marker is None:
        return f"{path / MARKER}: missing or unreadable (not a complete checkpoint)"
    return _size_problem(path, marker) or _digest_problem(path, marker)


def stage_checkpoint_dir(ckpt_dir: Path, on_step: StepHook = _noop) -> Path:
    """Step 1: an empty `<ckpt_dir>.new/` to write the next checkpoint into."""
    staging = ckpt_dir.with_name(ckpt_dir.name + _NEW)
    _delete(staging, on_step)
    staging.mkdir(parents=True)
    _fsync_path(staging.parent)
    on_step("stage")
    return staging


def commit_checkpoint_dir(
    ckpt_dir: Path, staging: Path, meta: dict[str, Any] | None = None, on_step: StepHook = _noop
) -> Path:
    """Steps 3-8: make the files the caller wrote into `staging` the current checkpoint at
    `ckpt_dir`; returns `ckpt_dir`. `meta` (JSON) is kept in the marker.

    Raises CheckpointError, leaving every older checkpoint in place, when the files read
    back from the disk differ from what was hashed before the marker was written."""
    files = _files(staging)
    digests = {str(f.relative_to(staging)): file_digest(f, sync=True) for f in files}
    for d in sorted({f.parent for f in files} | {staging}, key=lambda p: len(p.parts), reverse=True):
        _fsync_path(d)
    on_step("fsync")
    previous = [
        m
        for m in (checkpoint_meta(ckpt_dir), checkpoint_meta(ckpt_dir.with_name(ckpt_dir.name + _OLD)))
        if m is not None
    ]
    seq = max((int(m["seq"]) for m in previous), default=0) + 1
    marker = {
        "seq": seq,
        "meta": meta or {},
        "digest": DIGEST,
        "digests": digests,
        "files": {str(f.relative_to(staging)): f.stat().st_size for f in files},
    }
    with open(staging / MARKER, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(marker, sort_keys=True))
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_path(staging)
    on_step("marker")
    problem = _size_problem(staging, marker) or _digest_problem(staging, marker, uncached=True)
    if problem is not None:
        raise CheckpointError(f"{problem} (read back after writing; the previous checkpoint is kept)")
    on_step("verify")
    old = ckpt_dir.with_name(ckpt_dir.name + _OLD)
    if ckpt_dir.exists():
        _delete(old, on_step)  # a leftover of an earlier interrupted save: older than the new one
        os.rename(ckpt_dir, old)
        _fsync_path(ckpt_dir.parent)
        on_step("retire")
    os.rename(staging, ckpt_dir)
    _fsync_path(ckpt_dir.parent)
    on_step("promote")
    _delete(old, on_step)
    return ckpt_dir


async def save_checkpoint_dir(
    run_dir: Path,
    write: Callable[[Path], Awaitable[None]],
    *,
    meta: dict[str, Any] | None = None,
    name: str = "checkpoint",
    on_step: StepHook = _noop,
) -> Path:
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


def _step_of(marker: dict[str, Any]) -> str:
    step = marker.get("meta", {}).get("step") if isinstance(marker.get("meta"), dict) else None
    return f"step {step}" if step is not None else f"checkpoint #{marker['seq']}"


def latest_checkpoint(
    run_dir: Path, *, name: str = "checkpoint", clean: bool = True, warn: Callable[[str], None] | None = None
) -> Path | None:
    """The newest checkpoint of a run that verifies, or None when there is no complete one.

    Candidates newer than the one returned that fail verification are never returned:
    `warn` (default: a `flotilla: warning:` line on stderr) gets one line naming the file
    and the mismatch and the checkpoint used instead. A checkpoint without digests (the
    format before digests) is accepted on its sizes, with one `warn` line saying so. Raises
    CheckpointError (one line naming the file and the mismatch) when complete candidates
    exist but none verifies; nothing is changed then.

    With `clean` (the default, for resume), leftovers are resolved first: a newer candidate
    that failed is moved to `<name>.corrupt/` (replacing an earlier one), the one returned
    is renamed to `run_dir/<name>/`, and older or incomplete candidates are deleted, so the
    returned path is always `run_dir/<name>`. Without it, nothing is changed and the
    path of the newest candidate that verifies is returned.
    """
    warn = warn or _warn
    ckpt_dir = Path(run_dir) / name
    candidates = [ckpt_dir, ckpt_dir.with_name(name + _NEW), ckpt_dir.with_name(name + _OLD)]
    marked = [(int(m["seq"]), -i, c, m) for i, c in enumerate(candidates) if (m := _read_marker(c)) is not None]
    best: tuple[Path, dict[str, Any]] | None = None
    failed: list[tuple[Path, str]] = []
    if ckpt_dir.exists() and _read_marker(ckpt_dir) is None:  # it only ever appears with its marker
        failed.append((ckpt_dir, f"{ckpt_dir / MARKER}: missing or unreadable"))
    for _, _, c, m in sorted(marked, key=lambda t: t[:2], reverse=True):  # newest first
        problem = _size_problem(c, m) or _digest_problem(c, m)
        if problem is None:
            best = (c, m)
            break
        failed.append((c, problem))
    if best is None:
        if failed:
            raise CheckpointError(f"{failed[0][1]}; no other checkpoint in {run_dir} verifies")
        if clean:
            for c in candidates[1:]:
                _delete(c)
        return None
    chosen, marker = best
    if failed:
        warn(
            f"{failed[0][1]}: not loaded; resuming from the older checkpoint ({_step_of(marker)})"
            + (f", the failed one kept as {ckpt_dir.with_name(name + _CORRUPT)}" if clean else "")
        )
    if "digests" not in marker:
        warn(f"{chosen}: written without file digests (an earlier version): checked by file sizes only")
    if not clean:
        return chosen
    if failed:
        corrupt = ckpt_dir.with_name(name + _CORRUPT)
        _delete(corrupt)
        os.rename(failed[0][0], corrupt)  # the newest failure, for inspection
        _fsync_path(ckpt_dir.parent)
        for c, _ in failed[1:]:
            _delete(c)
    if chosen != ckpt_dir:
        if ckpt_dir.exists():  # older than `chosen` (a failed one was moved aside above)
            old = candidates[2]
            if chosen != old:
                _delete(old)
                os.rename(ckpt_dir, old)
                _fsync_path(ckpt_dir.parent)
            else:
                _delete(ckpt_dir)
        os.rename(chosen, ckpt_dir)
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
