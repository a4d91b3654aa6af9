"""Entry points: the CLI, starting and resuming runs (`runner`), preflight checks, a run's
outputs and reports, export. Above the controller."""
