"""`flotilla`: the command line.

    flotilla run CONFIG [--set key=value ...] [--steps N] [--mode async|sync] [--resume RUN_DIR]
    flotilla sft CONFIG [--set key=value ...]   supervised warm start from the config's [sft] table
    flotilla report RUN_DIR
    flotilla export RUN_DIR OUT_DIR [--step N] [--dtype bfloat16|float32|float16]
    flotilla compare RUN_DIR RUN_DIR ... [-o compare.html]
    flotilla config [SECTION]    every config field with its type, default and meaning
    flotilla hardware [CONFIG]
    flotilla host ...            (an actor host on another machine; see docs/remote-hosts.md)

Parsing happens before any heavy import, so `flotilla --help` is instant; torch and
transformers load only once a command needs them.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flotilla", description="Asynchronous RL for LLM agents.")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="train from a TOML config (or resume a run)")
    r.add_argument("config", nargs="?", help="run config (TOML); optional with --resume")
    r.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set rollout.group_size=4 (repeatable)",
    )
    r.add_argument("--steps", type=int, help="optimizer steps (overrides the config)")
    r.add_argument("--mode", choices=["async", "sync"], help="async (default) or the sync baseline")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    r.add_argument("--quiet", action="store_true", help="no progress lines")

    sft = sub.add_parser("sft", help="supervised fine-tuning from the config's [sft] table (a warm start for run)")
    sft.add_argument("config", help="run config (TOML) with an [sft] table")
    sft.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
    sft.add_argument("--quiet", action="store_true", help="no progress lines")

    rep = sub.add_parser("report", help="print a run's cost report; rebuild its report.html")
    rep.add_argument("run_dir")

    ex = sub.add_parser("export", help="write a run's policy as a Hugging Face model directory")
    ex.add_argument("run_dir")
    ex.add_argument("out_dir")
    ex.add_argument("--step", type=int, help="the checkpoint's step (a run keeps its latest)")
    ex.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float32 or float16")
    cmp = sub.add_parser("compare", help="one HTML page overlaying several runs' curves")
    cmp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    cmp.add_argument("-o", "--out", default="compare.html", help="output file (default: compare.html)")

    cf = sub.add_parser("config", help="every config field: type, default and what it does")
    cf.add_argument(
        "section",
        nargs="?",
        help="one section (model, task, rollout, recipe, trainer, placement, checkpoint, eval, pools, sft)",
    )

    hw = sub.add_parser("hardware", help="the GPU catalog, and a config's pools with estimated cost")
    hw.add_argument("config", nargs="?")

    host = sub.add_parser("host", help="serve actors for a controller on another machine", add_help=False)
    host.add_argument("args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["host"]:  # the host has its own options (--bind, --keys, ...)
        from orchestrator.runtime.host import main as host_main

        return host_main(argv[1:]) or 0
    args = _parser().parse_args(argv)
    if args.command == "run":
        from orchestrator.controller import TrainerLost
        from orchestrator.entry.runner import run_from_cli
        from orchestrator.state.checkpoints import CheckpointError
        from orchestrator.state.config import ConfigError

        try:
            return run_from_cli(
                args.config,
                overrides=args.overrides,
                steps=args.steps,
                mode=args.mode,
                resume=args.resume,
                quiet=args.quiet,
            )
        except (ConfigError, CheckpointError) as e:
            print(f"flotilla: {e}", file=sys.stderr)
            return 2
        except TrainerLost as e:
            print(f"flotilla: {e}", file=sys.stderr)
            return 1
    if args.command == "sft":
        from orchestrator.entry.sft import sft_from_cli
        from orchestrator.state.checkpoints import CheckpointError
        from orchestrator.state.config import ConfigError

        try:
            return sft_from_cli(args.config, args.overrides, quiet=args.quiet)
        except (ConfigError, CheckpointError) as e:
            print(f"flotilla: {e}", file=sys.stderr)
            return 2
    if args.command == "report":
        from orchestrator.entry.reports import print_report

        return print_report(args.run_dir)
    if args.command == "export":
        from orchestrator.entry.export import ExportError, export_run

        try:
            out = export_run(args.run_dir, args.out_dir, step=args.step, dtype=args.dtype)
        except (ExportError, ValueError, FileNotFoundError) as e:
            print(f"flotilla: {e}", file=sys.stderr)
            return 2
        print(f"flotilla: exported {args.run_dir} -> {out}")
        return 0
    if args.command == "compare":
        from orchestrator.entry.reports import compare_runs

        return compare_runs(args.run_dirs, args.out)
    if args.command == "config":
        from orchestrator.entry.confighelp import config_help
        from orchestrator.state.config import ConfigError

        try:
            print(config_help(args.section))
        except ConfigError as e:
            print(f"flotilla: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "hardware":
        from hardware import describe

        print(describe(args.config))
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
