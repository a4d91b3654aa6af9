"""The live progress line of `flotilla run`: one line per training step on stderr."""

from __future__ import annotations

import sys
import time
from collections.abc import Hashable
from typing import Any, TextIO

from orchestrator.runtime import RateLimiter, clip

__all__ = ["Progress"]


def _rate(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


class Progress:
    """Prints `step 12/60 | reward 0.53 | stale 0.4 (max 2) | tok/s b200 1.2k h100 820 | $0.0012 | 0:42`."""

    def __init__(self, total_steps: int, stream: TextIO | None = None, quiet: bool = False) -> None:
        self.total = total_steps
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.t0 = time.monotonic()
        self._limits = RateLimiter(5.0)

    @property
    def failure_every_s(self) -> float:
        """Seconds between two lines of one key of `repeated` (and of `failure`)."""
        return self._limits.interval_s

    @failure_every_s.setter
    def failure_every_s(self, seconds: float) -> None:
        self._limits.interval_s = seconds

    def step(self, record: dict[str, Any]) -> None:
        if self.quiet:
            return
        elapsed = int(time.monotonic() - self.t0)
        pools = " ".join(
            f"{name} {_rate(p.get('tokens_per_s', 0.0))}" for name, p in sorted(record.get("pools", {}).items())
        )
        line = (
            f"step {record['step']}/{self.total} | reward {record['reward_mean']:.3f} | "
            f"stale {record['staleness_mean']:.2f} (max {record['staleness_max']}) | "
            f"dropped {record['dropped_total']} | tok/s {pools} | "
            f"${record['cost_usd']:.4f} | {elapsed // 60}:{elapsed % 60:02d}"
        )
        print(line, file=self.stream, flush=True)

    def failure(self, text: str) -> None:
        """An error that may repeat (a failing environment, a lost rollout): `repeated`
        under one key shared by all failures."""
        self.repeated("failure", text)

    def repeated(self, key: Hashable, text: str) -> None:
        """A message that may repeat (failures, respawns): printed at most once per
        `failure_every_s` per `key`, with the count of those held back since; a multi-line
        text (a traceback) shows its first and last lines, and the line is bounded
        (`orchestrator.runtime.clip`: outside values such as error texts can be long)."""
        lines = text.strip().splitlines() or [""]
        shown = lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1]}"  # traceback: its tail
        self._limits.log(key, clip(shown), self.message)

    def message(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.stream, flush=True)

    def warning(self, text: str) -> None:
        """`flotilla: warning: <text>`, shown even when quiet (a damaged checkpoint skipped
        at resume, a repaired log: what a user must learn of whatever the display)."""
        if self.quiet:
            print(f"flotilla: warning: {text}", file=self.stream, flush=True)
        else:
            self.message(f"flotilla: warning: {text}")

    def close(self) -> None:
        """Nothing to stop for plain lines (the live display overrides this)."""
