"""`flotilla compare RUN_DIR RUN_DIR ...`: one page overlaying several runs' curves.

Reward (10-step mean) against step and wall time, cumulative cost, and mean staleness, one line
per run, for the async-vs-sync and ablation comparisons. Each run is read like a report reads
it (`load_run`), so an interrupted run or one with damaged files still appears, with its gaps
listed.
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go

from orchestrator.entry.report._charts import cost_series, rolling_mean
from orchestrator.entry.report._data import RunData, load_run
from orchestrator.entry.report._html import page
from orchestrator.state.checkpoints import write_file_atomic

__all__ = ["write_compare"]

_PALETTE = ["#08519c", "#d94801", "#238b45", "#6a51a3", "#a50f15", "#525252", "#b8860b", "#0e7c7b"]


def _label(data: RunData, taken: set[str]) -> str:
    label = data.name
    if label in taken:
        label = f"{data.name} ({data.run_dir})"
    taken.add(label)
    return label


def _figure(title: str, x_title: str, y_title: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(
        template="plotly_white",
        title=title,
        height=380,
        xaxis_title=x_title,
        yaxis_title=y_title,
        margin=dict(l=60, r=20, t=50, b=45),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=1, xanchor="right"),
    )
    return fig


def render_compare(runs: list[RunData]) -> str:
    reward_step = _figure("Reward (10-step mean) vs step", "step", "reward")
    reward_wall = _figure("Reward (10-step mean) vs wall time", "wall time (s)", "reward")
    cost = _figure("Cumulative cost vs step (dashed: each run's homogeneous counterfactual)", "step", "USD")
    stale = _figure("Mean staleness of the trained batch vs step", "step", "staleness (versions)")
    taken: set[str] = set()
    missing: list[str] = []
    head: list[tuple[str, str]] = []
    for i, data in enumerate(runs):
        label = _label(data, taken)
        color = _PALETTE[i % len(_PALETTE)]
        missing += [f"{label}: {m}" for m in data.missing]
        head.append((label, f"{(data.config or {}).get('mode', '?')} mode, {data.status}"))
        rows = data.metrics
        if not rows:
            continue
        steps = [r["step"] for r in rows]
        r10 = rolling_mean([r.get("reward_mean") for r in rows])
        line = dict(color=color)
        reward_step.add_scatter(x=steps, y=r10, mode="lines", name=label, line=line)
        reward_wall.add_scatter(x=[r["wall_total_s"] for r in rows], y=r10, mode="lines", name=label, line=line)
        per_pool, counterfactual, _ = cost_series(data)
        totals = (
            [sum(v) for v in zip(*per_pool.values(), strict=False)] if per_pool else [r.get("cost_usd") for r in rows]
        )
        cost.add_scatter(x=steps, y=totals, mode="lines", name=label, line=line)
        if counterfactual is not None:
            cost.add_scatter(
                x=steps,
                y=counterfactual,
                mode="lines",
                name=f"{label}: counterfactual",
                line=dict(color=color, dash="dash"),
            )
        stale.add_scatter(x=steps, y=[r.get("staleness_mean") for r in rows], mode="lines", name=label, line=line)
    charts = [reward_step, reward_wall, cost, stale]
    sections = [("curves", "Curves", [("", fig if fig.data else "No run has recorded steps.") for fig in charts])]
    return page(f"Flotilla: {len(runs)} runs compared", head, missing, sections)


def write_compare(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Write the comparison page of `run_dirs` to `out`; returns its path.

    Raises FileNotFoundError naming the first argument that is not a directory.
    """
    runs = [load_run(d) for d in run_dirs]
    path = Path(out)
    write_file_atomic(path, render_compare(runs).encode())
    return path
