"""The fleet benchmark's soak (`benchmarks/fleet.py --soak N`): a long run over fakes.

The real `Controller` runs N train steps of small batches over the fake actors of
`benchmarks/_fleet.py` (real processes, real sockets), writing a real `metrics.jsonl`
(`MetricsLog`) and real crash-safe checkpoints (`DiskCheckpoints`, every `every` steps)
into a temporary run directory. Every `SAMPLE` steps it records the controller process's
RSS, its open file descriptors and the mean step time since the last sample. After a
warm-up (the first tenth of the steps) each must stay flat:

- `rss_growth`: (RSS at the end - RSS after warm-up) / RSS after warm-up;
- `fd_growth`: open descriptors at the end - after warm-up;
- `step_ms_growth`: mean step time of the last tenth / of the second tenth;
- `metrics_line_bytes_*` and `state_bytes_*`: a metrics line's and the controller state's
  size at the start and the end (both must not grow with the steps).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from hardware import CostLedger, ModelSpec, Scheduler, ThroughputModel
from orchestrator.controller import Controller, ControllerState, Links
from orchestrator.entry.runner import DiskCheckpoints
from orchestrator.runtime import open_mesh
from orchestrator.state.config import RunConfig
from orchestrator.state.progress import Progress
from orchestrator.state.telemetry import MetricsLog

__all__ = ["soak"]

SAMPLE = 100  # steps between two samples


class SampledMetrics:
    """The run's `MetricsLog`, sampling the process every `SAMPLE` steps (bounded memory:
    one row per sample)."""

    def __init__(self, log: MetricsLog, rss: Any, fds: Any) -> None:
        self.log = log
        self.rss, self.fds = rss, fds
        self.rows: list[tuple[int, float, int, float]] = []  # step, rss MB, fds, mean step ms
        self.steps = 0
        self._t = time.perf_counter()

    def write(self, record: dict[str, Any]) -> None:
        self.log.write(record)
        self.steps += 1
        if self.steps % SAMPLE == 0:
            now = time.perf_counter()
            self.rows.append((self.steps, self.rss(), self.fds(), (now - self._t) / SAMPLE * 1000))
            self._t = now

    def truncate(self, last_step: int) -> None:
        self.log.truncate(last_step)


def _config(steps: int, every: int) -> RunConfig:
    return RunConfig.model_validate(
        {
            "steps": steps,
            "rollout": {"prompts_per_step": 2, "group_size": 2, "max_buffered_groups": 2},
            "checkpoint": {"every_steps": every},
            "pools": [
                {"name": "cheap", "gpu": "L40S", "count": 2, "staleness_budget": 1, "max_concurrent_rollouts": 4},
                {"name": "dear", "gpu": "H100-SXM", "count": 2, "staleness_budget": 1, "max_concurrent_rollouts": 4},
            ],
        }
    )


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    from _fleet import DataMeter, FleetEnv, FleetEnvs, FleetPool, FleetSampler, FleetTrainer, FleetTrainerLink
    from fleet import open_fds, rss_mb

    steps = args.soak
    every = max(1, steps // 20)
    cfg = _config(steps, every)
    run_dir = Path(tempfile.mkdtemp(prefix="flotilla-soak-"))
    meter = DataMeter()
    try:
        async with (
            open_mesh(FleetTrainer, 1e6, 1 << 20, procs=1, name="trainer") as tmesh,
            open_mesh(FleetSampler, procs=1, name="samplers") as smesh,
            open_mesh(FleetEnv, 16, 32, 4, 0.0, 0, procs=1, name="envs") as emesh,
        ):
            links = Links(
                trainer=FleetTrainerLink(tmesh, meter, emesh),  # held trajectories (the default) are fetched from emesh
                pools={pc.name: FleetPool(pc, smesh, pc.count, meter) for pc in cfg.pools},
                envs=FleetEnvs(emesh, 4, meter),
            )
            log = MetricsLog(run_dir / "metrics.jsonl")
            metrics = SampledMetrics(log, rss_mb, open_fds)
            ckpt = run_dir / "checkpoint"
            state_sizes: list[int] = []

            class Checkpoints(DiskCheckpoints):
                async def save(self, trainer: Any, state: ControllerState) -> None:
                    await super().save(trainer, state)
                    state_sizes.append(len(state.model_dump_json()))

            controller = Controller(
                cfg,
                links,
                ControllerState(),
                scheduler=Scheduler(
                    cfg.pools,
                    ThroughputModel(cfg.pools, ModelSpec(total_params=1e9, active_params=1e9)),
                    mean_rollout_tokens=32,
                ),
                ledger=CostLedger(cfg.pools),
                metrics=metrics,
                progress=Progress(cfg.steps, quiet=True),
                checkpoints=Checkpoints(ckpt),
                handle_sigint=False,
            )
            t0 = time.perf_counter()
            await controller.run()
            wall = time.perf_counter() - t0
            log.close()
        lines = (run_dir / "metrics.jsonl").read_bytes().splitlines()
        ckpt_bytes = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    rows = metrics.rows
    warm = max(1, len(rows) // 10)
    tenth = max(1, len(rows) // 10)
    base, end = rows[warm - 1], rows[-1]
    second = [r[3] for r in rows[tenth : 2 * tenth]] or [rows[0][3]]
    last = [r[3] for r in rows[-tenth:]]
    return {
        "steps": controller.state.step,
        "wall_s": round(wall, 1),
        "rollouts": controller.state.buffer.rollouts_trained,
        "rss_mb_warm": round(base[1], 1),
        "rss_mb_end": round(end[1], 1),
        "rss_mb_max": round(max(r[1] for r in rows[warm - 1 :]), 1),
        "rss_growth": round((end[1] - base[1]) / base[1], 4),
        "fds_warm": base[2],
        "fds_end": end[2],
        "fd_growth": end[2] - base[2],
        "step_ms_second_tenth": round(statistics.fmean(second), 3),
        "step_ms_last_tenth": round(statistics.fmean(last), 3),
        "step_ms_growth": round(statistics.fmean(last) / statistics.fmean(second), 3),
        "metrics_lines": len(lines),
        "metrics_line_bytes_first": len(lines[0]) if lines else 0,
        "metrics_line_bytes_last": len(lines[-1]) if lines else 0,
        "checkpoints": len(state_sizes),
        "state_bytes_first": state_sizes[0] if state_sizes else 0,
        "state_bytes_last": state_sizes[-1] if state_sizes else 0,
        "checkpoint_dir_bytes": ckpt_bytes,
        "samples": [[r[0], round(r[1], 1), r[2], round(r[3], 3)] for r in rows[:: max(1, len(rows) // 20)]],
    }
