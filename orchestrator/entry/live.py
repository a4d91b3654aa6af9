"""The live status of `flotilla run` on a terminal (rich), and the choice between it and lines.

On a terminal, a panel redrawn in place shows the step and ETA, a reward sparkline, per-pool
tokens/s and staleness, drops and cost; messages (start, interrupts, respawns) print above it.
Anywhere else (a pipe, a log file, CI) the run keeps `Progress`'s one line per step, and
`--quiet` prints nothing in either case.

Resource handling: the panel redraws from a refresh thread that rich owns; `close()` stops it
and leaves the last frame on screen. The runner closes it on every exit path.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from orchestrator.state.progress import Progress

__all__ = ["LiveProgress", "make_progress", "sparkline"]

_BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 48) -> str:
    """The last `width` values as block characters scaled between their min and max."""
    vals = values[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo
    return "".join(
        _BLOCKS[0 if span == 0 else min(len(_BLOCKS) - 1, int((v - lo) / span * len(_BLOCKS)))] for v in vals
    )


def _clock(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class LiveProgress(Progress):
    """A rich panel redrawn in place; see the module docstring."""

    def __init__(self, total_steps: int, console: Any = None, refresh_per_second: float = 4) -> None:
        from rich.console import Console
        from rich.live import Live

        super().__init__(total_steps)
        self.console = console or Console(file=sys.stderr)
        self.rewards: list[float] = []
        self.last: dict[str, Any] | None = None
        self._first_step: tuple[int, float] | None = None  # (step, time) of this session's first
        self._live = Live(
            self._render(),
            console=self.console,
            refresh_per_second=refresh_per_second,
            transient=False,
            get_renderable=self._render,
        )
        self._live.start()

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left at this session's pace (None before two steps)."""
        if self.last is None or self._first_step is None:
            return None
        step0, t0 = self._first_step
        done = self.last["step"] - step0
        if done <= 0:
            return None
        now = time.monotonic() if now is None else now
        return (now - t0) / done * max(0, self.total - self.last["step"])

    def _render(self) -> Any:
        from rich.console import Group
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        elapsed = time.monotonic() - self.t0
        r = self.last
        if r is None:
            return Panel(Text(f"starting actors… {_clock(elapsed)}"), title="flotilla", expand=False)
        eta = self.eta()
        head = Table.grid(padding=(0, 2))
        head.add_row(
            Text(f"step {r['step']}/{self.total}", style="bold"),
            ProgressBar(total=self.total, completed=r["step"], width=40),
            Text(f"elapsed {_clock(elapsed)}  ETA {_clock(eta) if eta is not None else '…'}"),
        )
        mean10 = sum(self.rewards[-10:]) / len(self.rewards[-10:])
        reward = Text.assemble(
            ("reward ", "dim"),
            (f"{r['reward_mean']:.3f}", "bold"),
            ("  10-step mean ", "dim"),
            f"{mean10:.3f}  ",
            (sparkline(self.rewards), "green"),
        )
        pools = Table(box=None, padding=(0, 2), show_edge=False)
        for col in ("pool", "tok/s", "staleness mean/max", "rollouts this step"):
            pools.add_column(col, justify="left" if col == "pool" else "right")
        for name, p in sorted((r.get("pools") or {}).items()):
            sm, sx = p.get("staleness_mean"), p.get("staleness_max")
            pools.add_row(
                name,
                f"{p.get('tokens_per_s', 0.0):.0f}",
                "—" if sm is None else f"{sm:.2f} / {sx}",
                str(p.get("rollouts", 0)),
            )
        tail = Text.assemble(
            ("staleness ", "dim"),
            f"{r['staleness_mean']:.2f} (max {r['staleness_max']})  ",
            ("dropped ", "dim"),
            f"{r.get('dropped_stale', 0)} stale, {r.get('dropped_failed', 0)} failed  ",
            ("cost ", "dim"),
            (f"${r['cost_usd']:.4f}", "bold"),
        )
        return Panel(Group(head, reward, pools, tail), title="flotilla", expand=False)

    def step(self, record: dict[str, Any]) -> None:
        if self._first_step is None:
            self._first_step = (record["step"] - 1, time.monotonic())
        self.rewards.append(float(record["reward_mean"]))
        self.last = record
        self._live.refresh()

    def message(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        self._live.stop()


def make_progress(total_steps: int, *, quiet: bool = False, stream: TextIO | None = None) -> Progress:
    """Live panel when `stream` (default stderr) is a terminal, plain lines otherwise."""
    stream = stream or sys.stderr
    if not quiet and stream.isatty():
        return LiveProgress(total_steps)
    return Progress(total_steps, stream=stream, quiet=quiet)
