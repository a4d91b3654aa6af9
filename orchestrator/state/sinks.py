"""Metric sinks: every metrics line and the cost report, also to Weights & Biases or TensorBoard.

`metrics.jsonl` stays the record of a run; a sink is a copy for the tools RL users already
watch. The run config's `[telemetry]` section turns them on:

    [telemetry]
    wandb = { project = "flotilla", mode = "offline" }   # or "online"
    tensorboard = true                                   # event files in runs/<name>/tensorboard/

Both packages are optional extras (`pip install -e '.[wandb,tensorboard]'`); asking for a sink
whose package is missing fails the run at start with a message naming the field and the extra.
A metrics line is flattened for them: nested pools become `pools/<pool>/<key>`, None values and
non-numbers are left out, booleans become 0/1, and the line's `step` is the x axis. Evaluation
lines (`eval_reward` ..., written after their step, possibly after the next step's line) go
the same way: TensorBoard takes any step per tag, and W&B plots every metric against the
logged `step` (`define_metric`) rather than its own row counter, which refuses to go back.
When a trainer restore rolls metrics.jsonl back to a checkpoint and trains those steps again,
the sinks get the new lines too and keep both values for such a step (they cannot unlog).

Crash/cancel: each sink writes through on every line (TensorBoard flushes, W&B appends to its
own log), so a killed run keeps every step it logged; `close` finishes them (W&B's offline
directory then holds the whole run and can be uploaded with `wandb sync`).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Protocol

from orchestrator.state.config import ConfigError
from orchestrator.state.sections import TelemetrySection, WandbSection

__all__ = ["MetricSink", "Sinks", "flatten", "open_sinks"]


class MetricSink(Protocol):
    """Where metrics lines go besides metrics.jsonl."""

    def log(self, record: dict[str, Any]) -> None: ...

    def log_cost_report(self, report: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numbers of a (nested) metrics line under `a/b/c` keys; see the module docstring."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, (bool, int, float)):
            out[name] = float(value)
    return out


def _cost_scalars(report: dict[str, Any]) -> dict[str, float]:
    scalars = flatten({"totals": report.get("totals", {})}, "cost/")
    for pool in report.get("pools", []):
        scalars.update(flatten({k: v for k, v in pool.items() if k != "pool"}, f"cost/pools/{pool['pool']}/"))
    if report.get("counterfactual"):
        scalars.update(flatten(report["counterfactual"], "cost/counterfactual/"))
    return scalars


class WandbSink:
    """Logs to a W&B run (offline or online) living in `run_dir/wandb/`."""

    def __init__(self, section: WandbSection, run_dir: Path, name: str, config: dict[str, Any]) -> None:
        import wandb

        # One W&B run id per run directory, so a resumed run continues the same W&B run.
        digest = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]
        run_id = re.sub(r"[^A-Za-z0-9_-]", "-", name)[:48] + "-" + digest
        self._run = wandb.init(
            project=section.project,
            entity=section.entity,
            mode=section.mode,
            dir=str(run_dir),
            name=name,
            id=run_id,
            resume="allow",
            config=config,
            settings=wandb.Settings(
                console="off",
                silent=True,
                x_disable_stats=True,
                x_save_requirements=False,
                disable_git=True,
                save_code=False,
            ),
        )
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        self.directory = Path(self._run.dir).parent

    def log(self, record: dict[str, Any]) -> None:
        self._run.log(flatten(record))

    def log_cost_report(self, report: dict[str, Any], step: int) -> None:
        self._run.summary.update(_cost_scalars(report))

    def close(self) -> None:
        self._run.finish()


class TensorBoardSink:
    """Writes event files under `run_dir/tensorboard/`, one scalar tag per metric."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory = run_dir / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.directory))

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, value in flatten(record).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()  # a killed run keeps every logged step

    def log_cost_report(self, report: dict[str, Any], step: int) -> None:
        for key, value in _cost_scalars(report).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Sinks:
    """The run's sinks as one; an empty `Sinks` does nothing."""

    def __init__(self, sinks: list[MetricSink] | None = None) -> None:
        self.sinks = list(sinks or [])

    def log(self, record: dict[str, Any]) -> None:
        for s in self.sinks:
            s.log(record)

    def log_cost_report(self, report: dict[str, Any], step: int) -> None:
        for s in self.sinks:
            s.log_cost_report(report, step)

    def close(self) -> None:
        """Close every sink (each once; closing again does nothing)."""
        sinks, self.sinks = self.sinks, []
        for s in sinks:
            s.close()


def _missing_extra(field: str, package: str) -> Exception:

    return ConfigError(f"telemetry.{field}: the {package} package is not installed (pip install 'flotilla[{field}]')")


def open_sinks(section: TelemetrySection, run_dir: Path, name: str, config: dict[str, Any]) -> Sinks:
    """The sinks `section` asks for. Raises ConfigError when one's package is not installed."""
    sinks: list[MetricSink] = []
    try:
        if section.tensorboard:
            try:
                import tensorboard  # noqa: F401 - torch's SummaryWriter needs it
            except ImportError:
                raise _missing_extra("tensorboard", "tensorboard") from None
            sinks.append(TensorBoardSink(run_dir))
        if section.wandb is not None:
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise _missing_extra("wandb", "wandb") from None
            sinks.append(WandbSink(section.wandb, run_dir, name, config))
    except BaseException:
        Sinks(sinks).close()
        raise
    return Sinks(sinks)
