"""What every GPU check shares: its command line, one JSON line per part, timing.

Each check takes ``--device`` (default ``cuda``) and ``--tiny`` (small shapes: a dry run on
CPU that exercises the check's logic, not the GPU's figures), and exits 0 when every part
passed or was skipped with a reason, 1 when a part failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_args(doc: str | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run, with --tiny)")
    p.add_argument("--tiny", action="store_true", help="small shapes: checks the logic, not the figures")
    p.add_argument("--quick", action="store_true", help="fewer parts and repetitions")
    args = p.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"check": Path(sys.argv[0]).stem, "status": "failed", "reason": "torch sees no CUDA device"}))
        sys.exit(1)
    return args


class Report:
    """Collects parts; ``exit()`` ends the process with 0 unless a part failed."""

    def __init__(self, check: str) -> None:
        self.check = check
        self.failed: list[str] = []

    def part(self, name: str, ok: bool, **fields: object) -> bool:
        status = "passed" if ok else "failed"
        if not ok:
            self.failed.append(name)
        print(json.dumps({"check": f"{self.check}.{name}", "status": status, **fields}, default=str), flush=True)
        return ok

    def skip(self, name: str, reason: str) -> None:
        print(json.dumps({"check": f"{self.check}.{name}", "status": "skipped", "reason": reason}), flush=True)

    def guard(self, name: str, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)``; an exception fails part ``name`` (one line naming it), not the others."""
        try:
            fn(*args)
        except Exception as e:  # a check reports, it does not stop at the first broken part
            self.part(name, False, error=f"{type(e).__name__}: {e}"[:500])

    def exit(self) -> None:
        sys.exit(1 if self.failed else 0)


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device, reps: int = 5) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up."""
    import statistics

    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def peak_mib(device) -> float | None:
    import torch

    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20
