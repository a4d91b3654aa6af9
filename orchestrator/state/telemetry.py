"""Run telemetry: traces to `traces.jsonl` (and OTLP when configured), one metrics line per step.

Actor processes inherit the trace file and its sampling through the environment
variables the runtime reads at start-up (`FLOTILLA_TRACE_*`), so every process of a
run writes its spans to the same file, one trace id follows a rollout across them, and
the decision to keep a rollout's trace (`[telemetry] trace_sample`, made where the
rollout starts) travels with its trace context. What is kept whatever the sample is
named here (`ALWAYS_KEPT`, `KEPT_IF_FAILED`): the runtime knows no span names. With
OTEL_EXPORTER_OTLP_ENDPOINT set, sampled spans also go to that collector.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from orchestrator.runtime import configure_tracing, spans_not_written

__all__ = ["ALWAYS_KEPT", "KEPT_IF_FAILED", "TRACE_FILE", "MetricsLog", "setup_run_telemetry"]

TRACE_ENV = "FLOTILLA_TRACE_FILE"
TRACE_FILE = "traces.jsonl"
# Rare and each one matters: written whatever the sample (their children follow them).
ALWAYS_KEPT = frozenset(
    {
        "startup",
        "eval",
        "train_step",
        "checkpoint",
        "weights.publish",
        "weights.apply",
        "trainer.restart",
        "actor.respawn",
        "rollout.dropped",
    }
)
# Outside the sample these are recorded (one span per rollout and process) and written only
# when they end failed; their children are not recorded (see orchestrator.runtime._traceio).
KEPT_IF_FAILED = frozenset({"rollout"})


def setup_run_telemetry(run_dir: Path, telemetry: Any = None) -> Path | None:
    """Route this process's spans, and those of actors it spawns later, to run_dir/traces.jsonl,
    sampled and capped as `telemetry` (the run config's TelemetrySection; None: its defaults)
    says. Returns the file, or None when `telemetry.traces` is off (nothing is recorded)."""
    if telemetry is None:
        from orchestrator.state.sections import TelemetrySection

        telemetry = TelemetrySection()
    if not telemetry.traces:
        os.environ.pop(TRACE_ENV, None)  # actors spawned later record nothing either
        return None
    path = run_dir / TRACE_FILE
    cap = telemetry.traces_max_mb
    configure_tracing(
        str(path),
        service_name="controller",
        sample=telemetry.trace_sample,
        always=ALWAYS_KEPT,
        tail=KEPT_IF_FAILED,
        max_bytes=None if cap is None else max(1, int(cap * 1e6)),
    )
    return path


class MetricsLog:
    """Appends one JSON object per training step to `metrics.jsonl` (flushed per line, so a
    killed run keeps every completed step), and hands it to the run's sinks (W&B, TensorBoard:
    `orchestrator.state.sinks`) after it is on disk."""

    def __init__(self, path: Path, sinks: Any = None) -> None:
        self.path = path
        self.sinks = sinks
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the log's lifetime; close() closes it

    def write(self, record: dict[str, Any]) -> None:
        """Append `record`; once `traces.jsonl` beside it hit its cap, with the number of
        spans every process left out so far (`traces_not_written`, as last counted)."""
        left_out = spans_not_written(self.path.parent / TRACE_FILE)
        if left_out:
            record = {**record, "traces_not_written": left_out}
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        if self.sinks is not None:
            self.sinks.log(record)

    def truncate(self, last_step: int) -> None:
        """Forget the steps after `last_step` (the trainer went back to a checkpoint: they
        are trained again)."""
        self._file.flush()
        rows = [r for r in self.read(self.path) if r["step"] <= last_step]
        self._file.close()
        self.path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - as in __init__

    def close(self) -> None:
        self._file.close()

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
