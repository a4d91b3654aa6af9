"""What a run writes after its last step: the cost report to the sinks, then `report.html`.

Called by the runner once the cost report is on disk, on a finished run and on an interrupted
one (Ctrl-C) alike. The HTML report is derived from the run directory and can be rebuilt with
`flotilla report RUN_DIR`, so a failure to draw it is reported in one line and does not turn a
finished run into a failed one; the sinks' errors do propagate (they hold data).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.state.progress import Progress
from orchestrator.state.sinks import Sinks

__all__ = ["finish_outputs"]


def finish_outputs(run_dir: Path, sinks: Sinks, cost_report: Any, step: int, progress: Progress) -> Path | None:
    """Log `cost_report` (a hardware.CostReport) to the sinks, close them, write report.html.

    Returns the report's path, or None when it could not be written.
    """
    try:
        sinks.log_cost_report(cost_report.model_dump(mode="json"), step)
    finally:
        sinks.close()
    try:
        # Imported here: plotly is only needed to draw, and a machine without it still runs.
        from orchestrator.entry.report import write_report

        path = write_report(run_dir)
    except Exception as e:
        progress.message(
            f"flotilla: report.html not written ({type(e).__name__}: {e}); rebuild it with `flotilla report {run_dir}`"
        )
        return None
    progress.message(f"flotilla: report {path}")
    return path
