"""The report's charts: plotly figures built from a `RunData`.

Each builder returns a figure, or a string saying why there is none (the section shows it in
place of the chart). Builders never raise on missing values: a metric absent from some steps
is drawn where it exists.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from orchestrator.entry.report._data import RunData, Span

__all__ = ["Chart", "rolling_mean", "run_charts"]

Chart = go.Figure | str
_TEMPLATE = "plotly_white"
_MEAN_WINDOW = 10


def rolling_mean(values: list[float | None], window: int = _MEAN_WINDOW) -> list[float | None]:
    """Mean of the last `window` present values at each position (None where none yet)."""
    out: list[float | None] = []
    recent: list[float] = []
    for v in values:
        if v is not None:
            recent.append(v)
            recent = recent[-window:]
        out.append(sum(recent) / len(recent) if recent else None)
    return out


def _col(rows: list[dict[str, Any]], key: str) -> list[Any]:
    return [r.get(key) for r in rows]


def _pool_col(rows: list[dict[str, Any]], pool: str, key: str) -> list[Any]:
    return [(r.get("pools") or {}).get(pool, {}).get(key) for r in rows]


def _layout(fig: go.Figure, title: str, height: int = 360, **kw: Any) -> go.Figure:
    fig.update_layout(
        template=_TEMPLATE,
        title=title,
        height=height,
        margin=dict(l=60, r=20, t=50, b=45),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=1, xanchor="right"),
        **kw,
    )
    return fig


def _has(rows: list[dict[str, Any]], key: str) -> bool:
    return any(r.get(key) is not None for r in rows)


def reward(data: RunData, axis: str) -> Chart:
    rows = data.metrics
    if not rows:
        return "No steps recorded: no reward curve."
    x_key, x_title = ("step", "step") if axis == "step" else ("wall_total_s", "wall time (s)")
    x = _col(rows, x_key)
    fig = go.Figure()
    r = _col(rows, "reward_mean")
    fig.add_scatter(x=x, y=r, mode="lines", name="reward (batch mean)", line=dict(color="#9ecae1"))
    fig.add_scatter(
        x=x,
        y=rolling_mean(r),
        mode="lines",
        name=f"reward, {_MEAN_WINDOW}-step mean",
        line=dict(color="#08519c", width=3),
    )
    pts = [(e.get(x_key), e["eval_reward"]) for e in data.evals if e.get(x_key) is not None]
    if pts:
        fig.add_scatter(
            x=[p[0] for p in pts],
            y=[p[1] for p in pts],
            mode="lines+markers",
            name="eval reward (held out)",
            line=dict(color="#d94801", width=2),
        )
    _layout(fig, f"Reward vs {x_title}", xaxis_title=x_title, yaxis_title="reward")
    return fig


def entropy(data: RunData) -> Chart:
    rows = data.metrics
    if not _has(rows, "entropy"):
        return "No entropy in metrics.jsonl."
    fig = go.Figure()
    e = _col(rows, "entropy")
    fig.add_scatter(x=_col(rows, "step"), y=e, mode="lines", name="entropy of p^S", line=dict(color="#a1d99b"))
    fig.add_scatter(
        x=_col(rows, "step"),
        y=rolling_mean(e),
        mode="lines",
        name=f"{_MEAN_WINDOW}-step mean",
        line=dict(color="#006d2c", width=3),
    )
    return _layout(
        fig, "Policy entropy (nats, over each token's recorded support)", xaxis_title="step", yaxis_title="entropy"
    )


def staleness_distribution(data: RunData) -> Chart:
    pools = data.rollout_staleness
    if not pools:
        rows = data.metrics
        if not rows:
            return "No rollouts in traces.jsonl and no steps: no staleness distribution."
        fig = go.Figure()
        for p in data.pool_names:
            v = [s for s in _pool_col(rows, p, "staleness_max") if s is not None]
            fig.add_histogram(x=v, name=p, opacity=0.75)
        return _layout(
            fig,
            "Staleness per pool: per-step maximum (no traces.jsonl, so not per rollout)",
            barmode="group",
            xaxis_title="staleness (versions)",
            yaxis_title="steps",
        )
    fig = go.Figure()
    rate = data.trace_sample if data.trace_sample is not None else 1.0
    for p in sorted(pools):
        if rate < 1.0:  # each sampled rollout stands for 1/rate of them; dropped ones are all there
            fig.add_histogram(
                x=pools[p],
                y=[1.0 / rate] * len(pools[p]),
                histfunc="sum",
                name=f"{p} (finished, from {len(pools[p])} sampled)",
                opacity=0.8,
                xbins=dict(size=1),
            )
        else:
            fig.add_histogram(x=pools[p], name=f"{p} (finished)", opacity=0.8, xbins=dict(size=1))
    for p in sorted(data.dropped_staleness):
        fig.add_histogram(
            x=data.dropped_staleness[p],
            name=f"{p} (dropped)",
            opacity=0.8,
            xbins=dict(size=1),
            marker_pattern_shape="/",
        )
    return _layout(
        fig,
        "Staleness of each rollout when it came back, per pool" + sample_note(data),
        barmode="group",
        xaxis_title="staleness (trainer version − oldest token version)",
        yaxis_title="rollouts" if rate >= 1.0 else "rollouts (finished: estimated from the sample)",
        xaxis=dict(dtick=1),
    )


def sample_note(data: RunData) -> str:
    """What part of the rollouts the traces hold, for a chart's title ('' when all of them)."""
    rate = data.trace_sample
    if rate is None or rate >= 1.0:
        return ""
    return f" (traced: {rate:.3g} of rollouts, trace_sample; dropped ones: all)"


def staleness_over_time(data: RunData) -> Chart:
    rows = data.metrics
    if not rows:
        return "No steps recorded: no staleness over time."
    fig = go.Figure()
    fig.add_scatter(
        x=_col(rows, "step"),
        y=_col(rows, "staleness_mean"),
        mode="lines",
        name="all pools (mean)",
        line=dict(color="black", width=3),
    )
    for p in data.pool_names:
        fig.add_scatter(
            x=_col(rows, "step"),
            y=_pool_col(rows, p, "staleness_mean"),
            mode="lines",
            name=f"{p} (mean)",
            connectgaps=False,
        )
    return _layout(
        fig, "Mean staleness of the trained batch, per pool", xaxis_title="step", yaxis_title="staleness (versions)"
    )


def dropped(data: RunData) -> Chart:
    rows = data.metrics
    if not rows:
        return "No steps recorded: no drop counts."
    fig = go.Figure()
    fig.add_scatter(
        x=_col(rows, "step"),
        y=_col(rows, "dropped_stale"),
        mode="lines",
        name="over the staleness budget",
        line=dict(color="#cb181d"),
    )
    fig.add_scatter(
        x=_col(rows, "step"),
        y=_col(rows, "dropped_failed"),
        mode="lines",
        name="failed episodes",
        line=dict(color="#6a51a3"),
    )
    if _has(rows, "dropped_rollback"):
        fig.add_scatter(
            x=_col(rows, "step"),
            y=_col(rows, "dropped_rollback"),
            mode="lines",
            name="rolled back with the trainer",
            line=dict(color="#636363"),
        )
    return _layout(
        fig,
        "Dropped trajectories (cumulative; their prompts are retried)",
        xaxis_title="step",
        yaxis_title="trajectories",
    )


def tokens_per_s(data: RunData) -> Chart:
    rows = data.metrics
    if not rows:
        return "No steps recorded: no throughput."
    fig = go.Figure()
    x = _col(rows, "wall_total_s")
    for p in data.pool_names:
        fig.add_scatter(x=x, y=_pool_col(rows, p, "tokens_per_s"), mode="lines", name=p)
    return _layout(
        fig, "Generated tokens/s per pool (over each step)", xaxis_title="wall time (s)", yaxis_title="tokens/s"
    )


def _cumulative(values: list[float | None]) -> list[float]:
    """Running total of a counter that restarts when its process restarts (resume, respawn)."""
    out, total, prev = [], 0.0, 0.0
    for v in values:
        v = prev if v is None else float(v)
        total += v - prev if v >= prev else v
        prev = v
        out.append(total)
    return out


def cost_series(data: RunData) -> tuple[dict[str, list[float]], list[float] | None, str]:
    """Cumulative cost per pool at each step, the counterfactual's, and how they were derived.

    With a cost report, each pool's curve is its busy time (or, for modelled billing, its tokens)
    so far as a share of the run's, times the pool's reported cost, so the last point is the
    report's figure; the counterfactual follows the share of all tokens generated so far. Without
    one, busy GPU-seconds × the configured price, and no counterfactual.
    """
    rows = data.metrics
    busy = {p: _cumulative(_pool_col(rows, p, "busy_s")) for p in data.pool_names}
    toks = {p: _cumulative(_pool_col(rows, p, "tokens")) for p in data.pool_names}
    per_pool: dict[str, list[float]] = {}
    if data.cost:
        reported = {c["pool"]: c for c in data.cost.get("pools", [])}
        for p in data.pool_names:
            c = reported.get(p)
            if c is None:
                continue
            basis = toks[p] if c.get("billing") == "modelled" else busy[p]
            final = basis[-1] if basis else 0.0
            per_pool[p] = [c["cost_usd"] * b / final if final else 0.0 for b in basis]
        cf = data.cost.get("counterfactual")
        all_toks = [sum(t) for t in zip(*toks.values(), strict=False)] if toks else []
        counterfactual = None
        if cf and all_toks and all_toks[-1]:
            counterfactual = [cf["cost_usd"] * t / all_toks[-1] for t in all_toks]
        return per_pool, counterfactual, "cost report, spread over steps by busy time"
    prices = {
        p["name"]: (p.get("price_per_gpu_hour") or 0.0, p.get("count", 1)) for p in (data.config or {}).get("pools", [])
    }
    for p in data.pool_names:
        price, count = prices.get(p, (0.0, 1))
        per_pool[p] = [b * count * price / 3600 for b in busy[p]]
    return per_pool, None, "busy GPU-seconds × configured price (no cost report)"


def cost(data: RunData) -> Chart:
    rows = data.metrics
    if not rows:
        return "No steps recorded: no cost curve."
    per_pool, counterfactual, basis = cost_series(data)
    x = _col(rows, "step")
    fig = go.Figure()
    for p, ys in per_pool.items():
        fig.add_scatter(x=x, y=ys, mode="lines", name=p, stackgroup="pools")
    if counterfactual is not None:
        cf = data.cost["counterfactual"]
        fig.add_scatter(
            x=x,
            y=counterfactual,
            mode="lines",
            line=dict(color="black", dash="dash", width=3),
            name=f"homogeneous {cf['gpu']} ({cf['precision']}) fleet",
        )
        actual = sum(v[-1] for v in per_pool.values())
        fig.add_annotation(
            x=x[-1],
            y=counterfactual[-1],
            text=(f"saving {cf['saving_pct']:.1f}%<br>${actual:.4f} vs ${cf['cost_usd']:.4f}"),
            showarrow=True,
            ax=-80,
            ay=-30,
            bgcolor="white",
        )
    return _layout(
        fig,
        f"Cumulative cost per pool (stacked) vs the homogeneous counterfactual — {basis}",
        xaxis_title="step",
        yaxis_title="USD",
    )


def gpu_hours(data: RunData) -> Chart:
    if data.cost:
        pools = data.cost.get("pools", [])
        names = [p["pool"] for p in pools]
        hours = [p["gpu_hours"] for p in pools]
        cf = data.cost.get("counterfactual")
        if cf:
            names.append(f"counterfactual: {cf['gpu']} fleet")
            hours.append(cf["gpu_hours"])
        title = "GPU-hours billed per pool (cost report)"
    else:
        rows = data.metrics
        if not rows:
            return "No steps and no cost report: no GPU-hours."
        counts = {p["name"]: p.get("count", 1) for p in (data.config or {}).get("pools", [])}
        names = data.pool_names
        hours = [_cumulative(_pool_col(rows, p, "busy_s"))[-1] * counts.get(p, 1) / 3600 for p in names]
        title = "GPU-hours per pool (busy time from metrics.jsonl; no cost report)"
    colors = ["#969696" if n.startswith("counterfactual") else "#4292c6" for n in names]
    fig = go.Figure(
        go.Bar(x=names, y=hours, text=[f"{h:.4f}" for h in hours], textposition="auto", marker_color=colors)
    )
    return _layout(fig, title, yaxis_title="GPU-hours", showlegend=False)


def stability(data: RunData) -> Chart:
    rows = data.metrics
    if not rows:
        return "No steps recorded: no stability metrics."
    panels = [
        ("mismatch_kl", "mismatch KL (k3)", True),
        ("masked_fraction", "masked fraction", True),
        ("mean_weight", "mean IS weight", False),
        ("grad_norm", "grad norm", False),
    ]
    fig = make_subplots(
        rows=2, cols=2, subplot_titles=[p[1] for p in panels], horizontal_spacing=0.08, vertical_spacing=0.14
    )
    x = _col(rows, "step")
    colors = ["#e6550d", "#31a354", "#756bb1", "#636363"]
    for i, (key, _, per_pool) in enumerate(panels):
        r, c = divmod(i, 2)
        fig.add_scatter(
            x=x,
            y=_col(rows, key),
            mode="lines",
            name="overall",
            legendgroup="overall",
            showlegend=i == 0,
            line=dict(color="black"),
            row=r + 1,
            col=c + 1,
        )
        if per_pool:
            for j, p in enumerate(data.pool_names):
                fig.add_scatter(
                    x=x,
                    y=_pool_col(rows, p, key),
                    mode="lines",
                    name=p,
                    legendgroup=p,
                    showlegend=i == 0,
                    line=dict(color=colors[j % len(colors)], width=1),
                    row=r + 1,
                    col=c + 1,
                )
    _layout(fig, "Stability of the off-policy recipe", height=600)
    fig.update_layout(margin=dict(t=100), legend=dict(y=1.08))
    return fig


def _tree_order(spans: list[Span]) -> list[tuple[Span, int]]:
    """Spans depth-first from the roots, children by start time; (span, depth)."""
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[Span]] = {}
    for s in spans:
        children.setdefault(s.parent if s.parent in ids else None, []).append(s)
    out: list[tuple[Span, int]] = []

    def visit(parent: str | None, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s.start_ns):
            out.append((s, depth))
            visit(s.span_id, depth + 1)

    visit(None, 0)
    return out


def waterfall(data: RunData, label: str) -> Chart:
    if label not in data.waterfalls:
        return f"No {label} rollout trace (see what is missing above)."
    root, spans = data.waterfalls[label]
    # The controller's rollout span is the trace's root on this side; anything its trace holds
    # that started before it (nothing, normally) still shows, with a negative offset.
    t0 = min(s.start_ns for s in spans)
    ordered = _tree_order(spans)
    services = sorted({s.service for s, _ in ordered}, key=lambda n: (n != "controller", not n.startswith("env"), n))
    palette = ["#08519c", "#238b45", "#d94801", "#6a51a3", "#a50f15", "#525252"]
    fig = go.Figure()
    # Plotly trims leading spaces from tick labels; no-break spaces keep the nesting visible.
    labels = [f"{chr(0xA0) * 3 * d}{s.name} #{i}" for i, (s, d) in enumerate(ordered)]
    for k, svc in enumerate(services):
        idx = [i for i, (s, _) in enumerate(ordered) if s.service == svc]
        fig.add_bar(
            y=[labels[i] for i in idx],
            x=[(ordered[i][0].end_ns - ordered[i][0].start_ns) / 1e6 for i in idx],
            base=[(ordered[i][0].start_ns - t0) / 1e6 for i in idx],
            orientation="h",
            name=svc,
            marker_color=palette[k % len(palette)],
            customdata=[[ordered[i][0].name, _attrs_text(ordered[i][0])] for i in idx],
            hovertemplate="%{customdata[0]}<br>start %{base:.2f} ms, %{x:.2f} ms<br>%{customdata[1]}<extra>"
            + svc
            + "</extra>",
        )
    a = root.attributes
    dur = (root.end_ns - root.start_ns) / 1e6
    title = (
        f"{label.capitalize()} rollout ({dur:.1f} ms): pool {a.get('pool', '?')}, "
        f"{a.get('tokens', '?')} tokens, reward {a.get('reward', '?')}, staleness {a.get('staleness', '?')}"
    )
    height = max(260, 60 + 22 * len(ordered))
    _layout(
        fig,
        title,
        height=height,
        barmode="overlay",
        xaxis_title="ms since the rollout started",
        yaxis=dict(
            autorange="reversed",
            categoryorder="array",
            categoryarray=labels,
            tickfont=dict(family="monospace", size=10),
        ),
    )
    return fig


def _attrs_text(s: Span) -> str:
    keep = ("pool", "turn", "tokens", "prompt_tokens", "reward", "staleness", "policy_version", "kind", "version_min")
    return ", ".join(f"{k}={s.attributes[k]}" for k in keep if k in s.attributes)


def _of_traced(data: RunData) -> str:
    rate = data.trace_sample
    if rate is None or rate >= 1.0:
        return "rollout of the run"
    return f"of the {data.sampled_rollouts} traced rollouts (trace_sample {rate:.3g}: a sample of the run's)"


def run_charts(data: RunData) -> list[tuple[str, str, list[tuple[str, Chart]]]]:
    """The report's sections: (id, title, [(caption, chart or reason)])."""
    return [
        ("reward", "Reward", [("", reward(data, "step")), ("", reward(data, "wall")), ("", entropy(data))]),
        (
            "staleness",
            "Staleness",
            [("", staleness_distribution(data)), ("", staleness_over_time(data)), ("", dropped(data))],
        ),
        ("throughput", "Throughput and cost", [("", tokens_per_s(data)), ("", cost(data)), ("", gpu_hours(data))]),
        ("stability", "Stability", [("", stability(data))]),
        (
            "traces",
            "Where a rollout's time goes",
            [
                (
                    f"The slowest {_of_traced(data)}, across processes (controller → env → sampler).",
                    waterfall(data, "slowest"),
                ),
                (f"The median {_of_traced(data)}.", waterfall(data, "median")),
            ],
        ),
    ]
