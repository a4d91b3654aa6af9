"""See a run: `report.html` (charts of one run) and the comparison page of several runs.

Both are single self-contained HTML files built with plotly in offline mode (its JavaScript
bundle inlined), from the run directory's files only, so they can be rebuilt at any time:

    write_report("runs/demo")                      # runs/demo/report.html
    write_compare(["runs/a", "runs/b"], "cmp.html")
"""

from orchestrator.entry.report._compare import write_compare
from orchestrator.entry.report._data import RunData, load_run, read_metrics
from orchestrator.entry.report._run import REPORT_FILE, render_report, write_report

__all__ = ["REPORT_FILE", "RunData", "load_run", "read_metrics", "render_report", "write_compare", "write_report"]
