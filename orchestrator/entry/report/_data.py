"""Read a run directory into what the report draws, and say what is missing.

Everything comes from the files a run leaves (docs/architecture.md, Telemetry): `config.json`,
`metrics.jsonl`, `traces.jsonl`, `cost_report.json` and the checkpoint's model files, so a
report can be rebuilt from a finished, interrupted or still-running run at any time. No file is
required: a missing, empty or damaged one becomes a line in `RunData.missing`, and the sections
that need it say so instead of drawing a chart.

`traces.jsonl` can hold millions of spans (with `[telemetry] trace_sample = 1`), so it is read
in two streaming passes: one over the controller's `rollout` spans only (matched as text before
any JSON parsing), one over the spans of the chosen traces. Rollouts are traced at the run's
sample rate (`trace_sample` in config.json; a run without it traced every rollout): the
per-rollout charts draw the sampled ones and say the rate, and a failed rollout written from
outside the sample (`"sampled": false`, its children absent) is counted, not drawn as one.
"""

from __future__ import annotations

import contextlib
import json
import struct
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from orchestrator.runtime import spans_not_written

__all__ = ["RunData", "Span", "load_run", "read_metrics"]

_ROLLOUT_MARK = '"name": "rollout"'
_CONTROLLER_MARK = '"service": "controller"'
_DROPPED_MARK = '"name": "rollout.dropped"'


@dataclass
class Span:
    """One span of a rollout's trace, as the waterfall draws it."""

    name: str
    service: str
    trace_id: str
    span_id: str
    parent: str | None
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


@dataclass
class RunData:
    """A run directory as the report sees it."""

    run_dir: Path
    name: str
    config: dict[str, Any] | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    # Evaluation lines of metrics.jsonl ({"step", "eval_reward", ...}), each after its step.
    evals: list[dict[str, Any]] = field(default_factory=list)
    cost: dict[str, Any] | None = None
    controller_state: dict[str, Any] | None = None
    model_params: int | None = None
    model_shape: dict[str, Any] | None = None
    # Controller `rollout` spans per pool: staleness when each rollout came back.
    rollout_staleness: dict[str, list[int]] = field(default_factory=dict)
    dropped_staleness: dict[str, list[int]] = field(default_factory=dict)
    # Waterfalls: label ("slowest", "median") -> (controller rollout span, its trace's spans).
    waterfalls: dict[str, tuple[Span, list[Span]]] = field(default_factory=dict)
    start_ns: int | None = None
    end_ns: int | None = None
    missing: list[str] = field(default_factory=list)
    # Fraction of rollouts traced (config.json's telemetry.trace_sample), None when unknown.
    trace_sample: float | None = None
    sampled_rollouts: int = 0
    # Failed rollouts outside the sample: their controller span alone is in the file.
    failed_unsampled: int = 0
    # Spans left out at the file's size cap (traces.jsonl.not_written/, as last counted).
    traces_not_written: int = 0

    @property
    def steps_configured(self) -> int | None:
        return self.config.get("steps") if self.config else None

    @property
    def steps_done(self) -> int:
        return self.metrics[-1]["step"] if self.metrics else 0

    @property
    def pool_names(self) -> list[str]:
        if self.config and self.config.get("pools"):
            return [p["name"] for p in self.config["pools"]]
        names: dict[str, None] = {}
        for m in self.metrics:
            names.update(dict.fromkeys(m.get("pools", {})))
        return list(names)

    @property
    def status(self) -> str:
        """finished / interrupted / incomplete, in words."""
        configured = self.steps_configured
        done = self.steps_done
        if configured is not None and done >= configured:
            return f"finished: {done} of {configured} steps"
        of = f" of {configured}" if configured is not None else ""
        if self.cost is not None:
            return f"interrupted at step {done}{of} (checkpointed, reports written)"
        return f"incomplete at step {done}{of}: no cost report yet (the run was killed, or is still running)"


def _read_json(path: Path, what: str, missing: list[str]) -> Any:
    if not path.exists():
        missing.append(f"{path.name} is missing: {what}")
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        missing.append(f"{path.name} could not be read ({e}): {what}")
        return None


def read_metrics(path: Path, missing: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Training lines (those with `reward_mean`) and evaluation lines (`eval_reward`); what
    could not be used is appended to `missing` (never raises for a damaged file)."""
    if not path.exists():
        missing.append("metrics.jsonl is missing: no per-step charts")
        return [], []
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    rows: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            last = i == len(lines) or (i == len(lines) - 1 and not lines[-1])
            if last:
                missing.append(
                    f"metrics.jsonl: the last line ({i}) is truncated ({len(line)} bytes, "
                    f"a step being written when the run stopped); it is left out"
                )
            else:
                missing.append(f"metrics.jsonl: line {i} is not valid JSON; it is left out")
            continue
        if not isinstance(row, dict) or "step" not in row:
            missing.append(f"metrics.jsonl: line {i} has no 'step'; it is left out")
            continue
        if "reward_mean" in row:
            rows.append(row)
        elif "eval_reward" in row:
            evals.append(row)
    if not rows:
        missing.append(
            "metrics.jsonl has no training steps: the run stopped before its first "
            "step (start-up failed or was interrupted), so there are no per-step charts"
        )
    _continue_wall_time(rows)
    wall = {r["step"]: r["wall_total_s"] for r in rows}
    for e in evals:
        e["wall_total_s"] = wall.get(e["step"])
    return rows, evals


def _continue_wall_time(rows: list[dict[str, Any]]) -> None:
    """`wall_s` restarts at 0 in each session of a resumed run; `wall_total_s` continues it."""
    offset = 0.0
    prev = 0.0
    for r in rows:
        w = float(r.get("wall_s", 0.0))
        if w < prev:
            offset += prev
        prev = w
        r["wall_total_s"] = offset + w


def _safetensors_params(path: Path) -> int | None:
    """Parameter count from a safetensors header (JSON after an 8-byte length), no torch."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError):
        return None
    total = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        count = 1
        for dim in entry.get("shape", []):
            count *= dim
        total += count
    return total


def _model_info(data: RunData) -> None:
    """The model's size from the checkpoint the run wrote (or the model path it trained)."""
    candidates = [data.run_dir / "checkpoint" / "model"]
    if data.config and (data.config.get("model") or {}).get("path"):
        candidates.append(Path(data.config["model"]["path"]))
    for d in candidates:
        files = sorted(d.glob("*.safetensors")) if d.is_dir() else []
        counts = [_safetensors_params(f) for f in files]
        if files and all(c is not None for c in counts):
            data.model_params = sum(c for c in counts if c is not None)
            conf = d / "config.json"
            if conf.exists():
                with contextlib.suppress(json.JSONDecodeError):  # the size alone still shows
                    data.model_shape = json.loads(conf.read_text())
            return
    data.missing.append("no model checkpoint (checkpoint/model/*.safetensors): model size unknown")


def _span(obj: dict[str, Any]) -> Span:
    return Span(
        name=obj["name"],
        service=obj.get("service", "?"),
        trace_id=obj["trace_id"],
        span_id=obj["span_id"],
        parent=obj.get("parent_span_id"),
        start_ns=int(obj["start_ns"]),
        end_ns=int(obj["end_ns"]),
        attributes=obj.get("attributes") or {},
    )


def _read_traces(data: RunData) -> None:
    path = data.run_dir / "traces.jsonl"
    if not path.exists():
        data.missing.append(
            "traces.jsonl is missing: no rollout waterfall and no per-rollout "
            "staleness distribution (the per-step staleness from metrics is shown)"
        )
        return
    rollouts: list[Span] = []
    bad = 0
    start: int | None = None
    end: int | None = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            is_rollout = _ROLLOUT_MARK in line and _CONTROLLER_MARK in line
            is_dropped = _DROPPED_MARK in line
            if not (is_rollout or is_dropped or start is None or '"name": "startup"' in line):
                continue
            try:
                obj = json.loads(line)
                if start is None or obj.get("name") == "startup":
                    start = int(obj["start_ns"]) if start is None else min(start, int(obj["start_ns"]))
                attrs = obj.get("attributes") or {}
                if obj.get("name") == "rollout" and obj.get("service") == "controller" and obj.get("sampled") is False:
                    data.failed_unsampled += 1
                elif obj.get("name") == "rollout" and obj.get("service") == "controller" and "staleness" in attrs:
                    s = _span(obj)
                    staleness = int(attrs["staleness"])
                    rollouts.append(s)
                    data.rollout_staleness.setdefault(attrs.get("pool", "?"), []).append(staleness)
                    end = s.end_ns if end is None else max(end, s.end_ns)
                elif obj.get("name") == "rollout.dropped" and int(attrs.get("staleness", -1)) >= 0:
                    data.dropped_staleness.setdefault(attrs.get("pool", "?"), []).append(int(attrs["staleness"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                bad += 1
    if bad:
        data.missing.append(
            f"traces.jsonl: {bad} line(s) are not valid spans (e.g. one being "
            f"written when the run stopped); they are left out"
        )
    data.start_ns, data.end_ns = start, end
    data.sampled_rollouts = len(rollouts)
    if not rollouts:
        data.missing.append("traces.jsonl holds no finished controller rollout span: no waterfall")
        return
    by_time = sorted(rollouts, key=lambda s: s.end_ns - s.start_ns)
    chosen = {"slowest": by_time[-1], "median": by_time[len(by_time) // 2]}
    wanted = {s.trace_id for s in chosen.values()}
    traces: dict[str, list[Span]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not any(t in line for t in wanted):
                continue
            try:
                obj = json.loads(line)
                if obj.get("trace_id") in wanted:
                    traces.setdefault(obj["trace_id"], []).append(_span(obj))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                continue  # counted in the first pass
    for label, s in chosen.items():
        family = traces.get(s.trace_id, [])
        if family:
            data.waterfalls[label] = (s, family)


def load_run(run_dir: str | Path) -> RunData:
    """Read `run_dir`; never raises for missing or damaged files (see the module docstring).

    Raises FileNotFoundError only when `run_dir` is not a directory at all.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory")
    data = RunData(run_dir=run_dir, name=run_dir.name)
    data.config = _read_json(
        run_dir / "config.json", "no configuration section, pool prices come from the cost report", data.missing
    )
    if data.config and data.config.get("name"):
        data.name = data.config["name"]
    data.metrics, data.evals = read_metrics(run_dir / "metrics.jsonl", data.missing)
    data.cost = _read_json(
        run_dir / "cost_report.json",
        "the run has not written its reports "
        "yet (still running, or killed): no counterfactual or saving; costs "
        "come from metrics.jsonl",
        data.missing,
    )
    state_path = run_dir / "checkpoint" / "controller_state.json"
    if state_path.exists():
        try:
            data.controller_state = json.loads(state_path.read_text())
        except json.JSONDecodeError:
            data.missing.append("checkpoint/controller_state.json is not valid JSON")
    _model_info(data)
    if data.config is not None:
        telemetry = data.config.get("telemetry") or {}
        data.trace_sample = float(telemetry.get("trace_sample", 1.0))
    data.traces_not_written = spans_not_written(run_dir / "traces.jsonl")
    _read_traces(data)
    if data.end_ns is None and (run_dir / "metrics.jsonl").exists():
        data.end_ns = int((run_dir / "metrics.jsonl").stat().st_mtime * 1e9)
    if data.start_ns is None and (run_dir / "config.json").exists():
        data.start_ns = int((run_dir / "config.json").stat().st_mtime * 1e9)
    return data


def utc(ns: int | None) -> str:
    if ns is None:
        return "unknown"
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
