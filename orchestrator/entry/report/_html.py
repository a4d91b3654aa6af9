"""Assemble one self-contained HTML page: plotly.js inlined once, each chart a div + script.

Nothing on the page is fetched from the network: plotly's offline bundle is embedded in the
page's head (about 4.8 MB), MathJax is not used, and fonts are the browser's own.
"""

from __future__ import annotations

import html
import json
from typing import Any

import plotly.io as pio
import plotly.offline

__all__ = ["page"]

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto;
       max-width: 1200px; padding: 0 24px 48px; color: #222; }
h1 { margin-bottom: 4px; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 4px; margin-top: 36px; }
table.head { border-collapse: collapse; margin: 12px 0; }
table.head td { padding: 3px 14px 3px 0; vertical-align: top; }
table.head td:first-child { color: #666; white-space: nowrap; }
.missing { background: #fff4e5; border: 1px solid #f0b45b; border-radius: 6px; padding: 8px 16px; }
.note { color: #8a4b00; background: #fff8ef; padding: 10px 14px; border-radius: 6px; }
.caption { color: #555; margin: 8px 0 0; }
.chart { min-height: 260px; margin: 8px 0 20px; }
pre { background: #f6f8fa; padding: 12px; overflow-x: auto; font-size: 12px; }
nav a { margin-right: 14px; }
"""


def _chart_html(fig: Any, div_id: str) -> str:
    height = fig.layout.height or 380
    return pio.to_html(
        fig,
        include_plotlyjs=False,
        full_html=False,
        div_id=div_id,
        default_height=f"{height}px",
        default_width="100%",
        config={"displaylogo": False, "responsive": True},
    )


def page(
    title: str,
    head_rows: list[tuple[str, str]],
    missing: list[str],
    sections: list[tuple[str, str, list[tuple[str, Any]]]],
    appendix: list[tuple[str, str]] | None = None,
) -> str:
    """The page: title, head table, what is missing, sections of charts, preformatted appendices.

    A section entry whose chart is a string shows that string as a note instead of a chart.
    The page counts its charts in `<meta name="flotilla-charts">` so a checker knows how many
    must render.
    """
    parts: list[str] = []
    n_charts = 0
    nav = " ".join(f'<a href="#{sid}">{html.escape(stitle)}</a>' for sid, stitle, _ in sections)
    for sid, stitle, items in sections:
        parts.append(f'<h2 id="{sid}">{html.escape(stitle)}</h2>')
        for caption, chart in items:
            if caption:
                parts.append(f'<p class="caption">{html.escape(caption)}</p>')
            if isinstance(chart, str):
                parts.append(f'<p class="note">{html.escape(chart)}</p>')
            else:
                n_charts += 1
                parts.append(f'<div class="chart">{_chart_html(chart, f"chart-{n_charts}")}</div>')
    head = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in head_rows)
    missing_html = ""
    if missing:
        items = "".join(f"<li>{html.escape(m)}</li>" for m in missing)
        missing_html = f'<div class="missing" id="missing"><strong>Missing or incomplete</strong><ul>{items}</ul></div>'
    extra = "".join(
        f"<h2>{html.escape(t)}</h2><details open><summary>{html.escape(t)}</summary>"
        f"<pre>{html.escape(body)}</pre></details>"
        for t, body in (appendix or [])
    )
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title>"
        f'<meta name="flotilla-charts" content="{n_charts}">'
        f"<style>{_CSS}</style>"
        f'<script type="text/javascript">{plotly.offline.get_plotlyjs()}</script>'
        f"</head><body><h1>{html.escape(title)}</h1>"
        f'<table class="head">{head}</table>{missing_html}<nav>{nav}</nav>'
        + "".join(parts)
        + extra
        + "</body></html>\n"
    )


def pretty(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True)
