"""`report.html` of one run: head lines, what is missing, the charts, the config."""

from __future__ import annotations

from pathlib import Path

from orchestrator.entry.report._charts import rolling_mean, run_charts
from orchestrator.entry.report._data import RunData, load_run, utc
from orchestrator.entry.report._html import page, pretty
from orchestrator.state.checkpoints import write_file_atomic

__all__ = ["REPORT_FILE", "render_report", "write_report"]

REPORT_FILE = "report.html"


def _model_line(data: RunData) -> str:
    if data.model_params is None:
        return "unknown (no checkpoint)"
    n = data.model_params
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"
    shape = data.model_shape or {}
    bits = [
        f"{k.replace('num_hidden_layers', 'layers').replace('hidden_size', 'hidden')} {shape[k]}"
        for k in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")
        if k in shape
    ]
    return f"{size} parameters ({n:,})" + (f": {', '.join(str(b) for b in bits)}" if bits else "")


def _pools_line(data: RunData) -> str:
    pools = (data.config or {}).get("pools")
    if pools:
        return "; ".join(
            f"{p['name']}: {p.get('count', 1)}× {p.get('gpu')} {p.get('precision')} on {p.get('device')}, "
            f"${p.get('price_per_gpu_hour') or 0:.2f}/GPU-h, staleness budget {p.get('staleness_budget')}"
            for p in pools
        )
    return ", ".join(data.pool_names) or "unknown"


def head_rows(data: RunData) -> list[tuple[str, str]]:
    cfg = data.config or {}
    rows: list[tuple[str, str]] = [
        ("run", f"{data.name} ({cfg.get('mode', '?')} mode) — {data.run_dir}"),
        ("status", data.status),
        ("model", _model_line(data)),
        ("task", str((cfg.get("task") or {}).get("name", "unknown"))),
        ("pools", _pools_line(data)),
        ("start", utc(data.start_ns)),
        ("end", utc(data.end_ns)),
    ]
    if data.metrics:
        last = data.metrics[-1]
        wall = last.get("wall_total_s", 0.0)
        r10 = rolling_mean([m.get("reward_mean") for m in data.metrics])[-1]
        first = data.metrics[0].get("reward_mean")
        rows.append(
            (
                "training",
                f"{len(data.metrics)} steps in {wall:.0f} s of training; reward "
                f"{first:.3f} at step {data.metrics[0]['step']} → {r10:.3f} "
                f"(10-step mean) at step {last['step']}",
            )
        )
        rows.append(
            (
                "dropped",
                f"{last.get('dropped_stale', 0)} over budget, "
                f"{last.get('dropped_failed', 0)} failed, "
                f"{last.get('dropped_rollback', 0)} rolled back; "
                f"trainer restarts {last.get('trainer_restarts', 0)}",
            )
        )
    if data.cost:
        t = data.cost["totals"]
        line = f"${t['cost_usd']:.4f} for {t['tokens']:,} tokens, {t['gpu_hours']:.4f} GPU-hours"
        cf = data.cost.get("counterfactual")
        if cf:
            line += f"; a homogeneous {cf['gpu']} fleet: ${cf['cost_usd']:.4f} (saving {cf['saving_pct']:.1f}%)"
        rows.append(("cost", line))
    elif data.metrics:
        rows.append(("cost", f"${data.metrics[-1].get('cost_usd', 0.0):.4f} so far (metrics.jsonl)"))
    rows.append(("traces", _traces_line(data)))
    return rows


def _traces_line(data: RunData) -> str:
    telemetry = (data.config or {}).get("telemetry") or {}
    if telemetry.get("traces") is False:
        return "off (telemetry.traces = false)"
    rate = data.trace_sample
    line = (
        f"trace_sample {rate:.3g}: {data.sampled_rollouts} rollouts traced"
        if rate is not None
        else f"{data.sampled_rollouts} rollouts traced (sample rate unknown: no config.json)"
    )
    line += "; train steps, weight syncs, checkpoints, evaluations, restarts and dropped rollouts: all"
    if data.failed_unsampled:
        line += f"; {data.failed_unsampled} failed rollouts outside the sample (their own span only)"
    if data.traces_not_written:
        cap = telemetry.get("traces_max_mb")
        line += f"; {data.traces_not_written} spans not written at the file's cap ({cap} MB)"
    return line


def render_report(data: RunData) -> str:
    appendix = []
    if data.config is not None:
        appendix.append(("Config (config.json)", pretty(data.config)))
    md = data.run_dir / "cost_report.md"
    if data.cost is not None and md.exists():
        appendix.append(("Cost report (cost_report.md)", md.read_text(errors="replace")))
    return page(f"Flotilla run: {data.name}", head_rows(data), data.missing, run_charts(data), appendix)


def write_report(run_dir: str | Path, out: str | Path | None = None, *, data: RunData | None = None) -> Path:
    """Build `run_dir/report.html` (or `out`) from the run directory's files; returns its path.

    Missing or damaged files do not fail it: the page lists them (see `load_run`). The file is
    written to a temporary name and renamed, so a reader never sees half a report. Raises
    FileNotFoundError when `run_dir` is not a directory. `data`: the run as `load_run(run_dir)`
    already read it.
    """
    data = data if data is not None else load_run(run_dir)
    path = Path(out) if out is not None else Path(run_dir) / REPORT_FILE
    write_file_atomic(path, render_report(data).encode())
    return path
