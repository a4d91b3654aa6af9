"""Chaos faults against files and logs: corrupted checkpoints, a flood of bad wire messages.

Used by `benchmarks/chaos.py` (its "corrupted checkpoints and log floods" section):

- `corrupt_checkpoint_cases(checkpoint, work)` damages copies of a real checkpoint in
  every way below and counts those that were *loaded* — selected by resume
  (`latest_checkpoint`, which verifies the digests) and then accepted by the trainer's
  own loader (`Trainer(resume_from=...)`, what the trainer actor runs). Target 0.
  Cases: 64 bytes XORed in the middle of model.safetensors; 64 0xFF bytes (NaN) in
  model.safetensors and in optimizer.safetensors; a corrupted safetensors header; each
  of the three byte-level cases again with a digest-less marker (a checkpoint of an
  earlier version, which only the loader's checks can catch); a corrupted newest
  `checkpoint/` beside a good `checkpoint.old/` (the older one must be used and kept);
  and both corrupted (one line, nothing loaded).
- `ConsoleCapture` tees this process's stderr (file descriptor 2, which the actor
  processes inherit) through a pipe, timestamping every line, so the console of a live
  run can be measured: `lines_per_minute_max` (the most lines in any 60 s, or the rate
  over a shorter span; the per-step progress line excluded) and the longest line.
- `flood(address, n, seconds)` sends `n` malformed requests to an actor's ZeroMQ
  address from several peers, spread over `seconds`: bad JSON, unknown endpoints, and
  arguments carrying 100 kB values.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Self

__all__ = ["ConsoleCapture", "corrupt_checkpoint_cases", "flood"]

_STEP_LINE = re.compile(r"^step \d+/\d+ \|")


# -- corrupted checkpoints ---------------------------------------------------------------
def _xor_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 64):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def _nan_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))


def _bad_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[10:20] = b"\x00" * 10  # inside the JSON header that follows the 8-byte length
    path.write_bytes(bytes(data))


def _drop_digests(ckpt: Path) -> None:
    marker = ckpt / "COMPLETE"
    m = json.loads(marker.read_text())
    m.pop("digests", None)
    m.pop("digest", None)
    marker.write_text(json.dumps(m))


def _bump_seq(ckpt: Path) -> None:
    marker = ckpt / "COMPLETE"
    m = json.loads(marker.read_text())
    m["seq"] = int(m["seq"]) + 1
    marker.write_text(json.dumps(m))


_MODEL, _OPT = "model/model.safetensors", "optimizer.safetensors"
_DAMAGE = {
    "xor_model": (_MODEL, _xor_middle),
    "nan_model": (_MODEL, _nan_middle),
    "nan_optimizer": (_OPT, _nan_middle),
    "bad_header": (_MODEL, _bad_header),
}


def _try_resume(run_dir: Path) -> tuple[Path | None, str]:
    """What resume would load from `run_dir`: (the checkpoint the trainer accepted, or
    None; the last line said, with `run_dir` left out). Runs the real selection and the
    trainer's real loader."""
    from actors.trainer import TrainerConfig
    from actors.trainer._core import Trainer
    from orchestrator.state.checkpoints import CheckpointError, latest_checkpoint

    said: list[str] = []

    def last() -> str:
        return said[-1].replace(f"{run_dir}/", "") if said else ""

    try:
        chosen = latest_checkpoint(run_dir, warn=said.append)
    except CheckpointError as e:
        said.append(str(e))
        return None, last()
    if chosen is None:
        said.append("no complete checkpoint")
        return None, last()
    config = TrainerConfig.model_validate(json.loads((chosen / "trainer.json").read_text())["config"])
    try:
        Trainer(config, resume_from=str(chosen))
    except CheckpointError as e:
        said.append(str(e))
        return None, last()
    return chosen, last()


def corrupt_checkpoint_cases(checkpoint: Path, work: Path) -> dict[str, Any]:
    """Damage copies of `checkpoint` (a complete, verifying checkpoint directory) in every
    case of the module docstring; returns `corrupt_checkpoints_loaded`, the case count and
    per case what happened (`loaded`, `refused: <line>` or `fell back: <line>`)."""
    cases: dict[str, str] = {}
    loaded = 0

    def fresh(name: str) -> Path:
        run_dir = work / name
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        shutil.copytree(checkpoint, run_dir / "checkpoint")
        return run_dir

    for name, (rel, damage) in _DAMAGE.items():
        for legacy in (False, True):
            if legacy and name == "xor_model":
                continue  # finite garbage without digests: nothing can tell it from weights
            case = f"{name}_no_digests" if legacy else name
            run_dir = fresh(case)
            damage(run_dir / "checkpoint" / rel)
            if legacy:
                _drop_digests(run_dir / "checkpoint")
            chosen, said = _try_resume(run_dir)
            loaded += chosen is not None
            cases[case] = "loaded" if chosen is not None else f"refused: {said}"

    run_dir = fresh("corrupt_newest_beside_good_older")  # the good one is checkpoint.old/
    shutil.copytree(run_dir / "checkpoint", run_dir / "checkpoint.old")
    _bump_seq(run_dir / "checkpoint")
    _xor_middle(run_dir / "checkpoint" / _MODEL)
    good = (run_dir / "checkpoint.old" / _MODEL).read_bytes()
    chosen, said = _try_resume(run_dir)
    kept = chosen is not None and (chosen / _MODEL).read_bytes() == good
    loaded += chosen is None or not kept  # loaded the corrupted one, or lost the good one
    cases["corrupt_newest_beside_good_older"] = f"fell back: {said}" if kept else f"wrong: {said}"

    run_dir = fresh("all_corrupted")
    shutil.copytree(run_dir / "checkpoint", run_dir / "checkpoint.old")
    _bump_seq(run_dir / "checkpoint")
    _xor_middle(run_dir / "checkpoint" / _MODEL)
    _nan_middle(run_dir / "checkpoint.old" / _OPT)
    chosen, said = _try_resume(run_dir)
    loaded += chosen is not None
    cases["all_corrupted"] = "loaded" if chosen is not None else f"refused: {said}"
    return {
        "corrupt_checkpoints_loaded": loaded,
        "corrupt_checkpoint_cases": len(cases),
        "corrupt_checkpoint_outcomes": {k: v[:200] for k, v in cases.items()},
    }


# -- the console of a live run --------------------------------------------------------------
class ConsoleCapture:
    """Inside `with`, everything written to file descriptor 2 (this process and the actor
    processes started meanwhile, which inherit it) is timestamped line by line and still
    written to the real stderr."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self._saved = -1
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        read_fd, write_fd = os.pipe()
        self._saved = os.dup(2)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._thread = threading.Thread(target=self._pump, args=(read_fd,), daemon=True)
        self._thread.start()
        return self

    def _pump(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            for raw in pipe:
                self.lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))
                os.write(self._saved, raw)

    def __exit__(self, *exc: object) -> None:
        os.dup2(self._saved, 2)  # the pipe's last writer here is gone: the pump sees EOF
        if self._thread is not None:
            self._thread.join(timeout=10)  # a process still holding the pipe keeps it open
        if self._thread is None or not self._thread.is_alive():
            os.close(self._saved)

    def log_lines(self, start: float = 0.0, end: float = float("inf")) -> list[tuple[float, str]]:
        """Lines between `start` and `end` (monotonic seconds), per-step progress excluded."""
        return [(t, s) for t, s in self.lines if start <= t <= end and not _STEP_LINE.match(s)]

    def lines_per_minute_max(self, start: float, end: float) -> float:
        """Log lines per minute between `start` and `end`: the most in any 60 s window, or,
        for a span shorter than a minute, its count scaled to a minute."""
        times = [t for t, _ in self.log_lines(start, end)]
        if end - start < 60.0:
            return round(len(times) * 60.0 / max(end - start, 1.0), 1)
        best, lo = 0, 0
        for hi, t in enumerate(times):
            while t - times[lo] > 60.0:
                lo += 1
            best = max(best, hi - lo + 1)
        return float(best)

    def longest_line(self, start: float = 0.0, end: float = float("inf")) -> int:
        return max((len(s) for _, s in self.log_lines(start, end)), default=0)


# -- a flood of malformed wire messages ----------------------------------------------------
def _bad_message(i: int) -> list[bytes]:
    big = "x" * 100_000
    kind = i % 4
    if kind == 0:
        return [b"{not json " + big[: 1000 + i % 5000].encode()]
    if kind == 1:
        return [json.dumps({"id": i, "kind": "call", "endpoint": "no_such_" + big[: i % 3000], "args": []}).encode()]
    if kind == 2:
        return [json.dumps({"id": i, "kind": "call", "endpoint": "stats", "args": [big], "kwargs": {}}).encode()]
    return [json.dumps({"id": "x" * (i % 2000), "kind": "call"}).encode()]


async def flood(address: str, n: int = 10_000, seconds: float = 10.0, peers: int = 20) -> dict[str, Any]:
    """Send `n` malformed requests to `address` from `peers` DEALER sockets (each its own
    ZeroMQ identity), evenly over `seconds`; returns when they are sent (replies are
    drained and discarded)."""
    import trio
    import zmq

    ctx = zmq.Context.instance()
    socks = []
    for p in range(peers):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, f"flood-{p}-{os.getpid()}".encode())
        s.setsockopt(zmq.SNDHWM, 0)
        s.connect(address)
        socks.append(s)
    t0 = time.monotonic()
    try:
        batch = max(1, n // max(1, int(seconds * 20)))
        for i in range(n):
            socks[i % peers].send_multipart(_bad_message(i))
            if (i + 1) % batch == 0:
                for s in socks:
                    while s.poll(0):
                        s.recv_multipart()
                await trio.sleep(max(0.0, t0 + seconds * (i + 1) / n - time.monotonic()))
        await trio.sleep(1.0)  # the victim finishes rejecting what is queued
    finally:
        for s in socks:
            s.close(linger=0)
    return {"flood_messages": n, "flood_peers": peers, "flood_s": round(time.monotonic() - t0, 1)}
