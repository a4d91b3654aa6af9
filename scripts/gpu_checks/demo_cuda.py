"""GPU check: the demo (examples/arithmetic.toml) on ``device = "cuda"`` for 50 steps, the
trainer and both sampler pools (bf16 and fp8) on the GPU, through the real CLI in its own
process.

One JSON line: steps trained, wall time, steps/s, the mean reward of the first and last 10
steps. Passes when the run exits 0 having trained every step. ``--quick``: 20 steps;
``--device cpu --tiny``: 3 steps on CPU (a dry run of the same command).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, Report, parse_args


def demo(rep: Report, device: str, steps: int) -> None:
    sets = [f"trainer.device={device}", "name=gpu-demo"]  # the rate decays over --steps by default
    if device == "cuda":
        import torch

        from hardware import detected_gpu

        label = detected_gpu(torch.cuda.get_device_name(0))
        if label is None:
            rep.skip("arithmetic", f"GPU {torch.cuda.get_device_name(0)!r} is not in the catalog: no pool label")
            return
        sets += [f"pools.{i}.{k}={v}" for i in (0, 1) for k, v in (("device", "cuda"), ("gpu", label))]
    root = tempfile.mkdtemp(prefix="flotilla-gpu-demo-")
    cmd = [sys.executable, "-m", "orchestrator", "run", str(ROOT / "examples/arithmetic.toml"), "--quiet",
           "--steps", str(steps), "--set", f"run_root={root}"]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    metrics = Path(root) / "gpu-demo" / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    rewards = [x["reward_mean"] for x in lines if "reward_mean" in x]
    ok = proc.returncode == 0 and len(rewards) == steps
    fields: dict[str, object] = {"steps": len(rewards), "wall_s": wall, "steps_per_s": len(rewards) / wall}
    if rewards:
        fields |= {"reward_first10": sum(rewards[:10]) / len(rewards[:10]),
                   "reward_last10": sum(rewards[-10:]) / len(rewards[-10:])}  # fmt: skip
    if not ok:
        fields |= {"rc": proc.returncode, "stderr_tail": proc.stderr[-800:]}
    rep.part("arithmetic", ok, run_dir=str(Path(root) / "gpu-demo"), **fields)


if __name__ == "__main__":
    args = parse_args(__doc__)
    rep = Report("demo_cuda")
    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    rep.guard("arithmetic", lambda: demo(rep, dev, 3 if args.tiny else 20 if args.quick else 50))
    rep.exit()
