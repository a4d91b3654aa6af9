"""Run telemetry: traces to `traces.jsonl` (and OTLP when configured), one metrics line per step.

Actor processes inherit the trace file through the environment variable the
runtime reads at start-up (FLOTILLA_TRACE_FILE), so every process of a run
writes its spans to the same file and one trace id follows a rollout across
them. With OTEL_EXPORTER_OTLP_ENDPOINT set, spans also go to that collector.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from orchestrator.runtime import configure_tracing

__all__ = ["MetricsLog", "setup_run_telemetry"]

TRACE_ENV = "FLOTILLA_TRACE_FILE"


def setup_run_telemetry(run_dir: Path) -> Path:
    """Route this process's spans, and those of actors it spawns later, to run_dir/traces.jsonl."""
    path = run_dir / "traces.jsonl"
    os.environ[TRACE_ENV] = str(path)
    configure_tracing(str(path), service_name="controller")
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
