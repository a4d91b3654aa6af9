"""Start, resume and finish a run: spawn the actors, drive the controller, checkpoint, report.

`run(config)` is the Python entry point (`from orchestrator import run`);
`flotilla run` calls `run_from_cli`. A run directory holds:

    config.json            the resolved config
    traces.jsonl           spans of every process (OpenTelemetry, JSONL exporter)
    metrics.jsonl          one line per training step
    checkpoint/            trainer weights + optimizer (safetensors) and controller_state.json
    cost_report.json/.md   per-pool cost, tokens, staleness, mismatch; totals and counterfactual
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from orchestrator.controller import (
    STATE_FILE,
    Controller,
    ControllerState,
    Links,
    TrainerLink,
)
from orchestrator.controller.meshes import MeshEnvs, MeshPool, MeshTrainer
from orchestrator.entry.live import make_progress
from orchestrator.entry.outputs import finish_outputs
from orchestrator.entry.pool_mesh import check_hosts, gpu_warnings, identity_env, pool_mesh
from orchestrator.entry.preflight import preflight
from orchestrator.runtime import ActorError, open_mesh, span, spans_not_written
from orchestrator.state.checkpoints import (
    CheckpointError,
    latest_checkpoint,
    repair_jsonl,
    save_checkpoint_dir,
    write_file_atomic,
)
from orchestrator.state.config import ConfigError, RunConfig, check_runnable, load_config
from orchestrator.state.progress import Progress
from orchestrator.state.sinks import open_sinks
from orchestrator.state.telemetry import TRACE_FILE, MetricsLog, setup_run_telemetry

__all__ = ["DiskCheckpoints", "RunHandles", "RunResult", "run", "run_async", "run_from_cli"]


@dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    version: int
    interrupted: bool
    counts: dict[str, int]
    wall_s: float
    failure: str | None = None
    """Why the run stopped before its last step (episodes kept failing), or None."""


def actor_env(cfg: RunConfig, cpus: list[int] | None) -> dict[str, str]:
    """The environment of an actor process of this run (thread counts, its CPUs)."""
    threads = str(cfg.placement.threads_per_actor)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    if cpus:
        env["FLOTILLA_CPUS"] = ",".join(str(c) for c in cpus)  # the actor process pins itself
    return env


def run_model_config(cfg: RunConfig) -> dict[str, Any] | str:
    """The model the run's actors build: the config's checkpoint path, or the built-in tiny model's config."""
    from actors.models import default_model_config
    from actors.tokenizer import VOCAB_SIZE

    if cfg.model.path:
        return str(Path(cfg.model.path).resolve())  # actor processes may run elsewhere
    conf = default_model_config(vocab_size=VOCAB_SIZE)
    conf.update(cfg.model.overrides)
    return conf


def _model_spec(params: int) -> Any:
    """The throughput model's view of the model (dense: every parameter is active)."""
    from hardware import ModelSpec

    return ModelSpec(total_params=params, active_params=params)


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Steps logged after the last checkpoint were lost with the interrupted run; drop them."""
    rows = MetricsLog.read(path)
    keep = [r for r in rows if r["step"] <= last_step]
    if len(keep) != len(rows):
        write_file_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep).encode())


class DiskCheckpoints:
    """Checkpoints in `runs/<name>/checkpoint/`: the trainer's files and the controller's
    state, written to a fresh directory, fsynced and swapped in by renames only when whole
    (`orchestrator.state.checkpoints`), so a crash at any moment leaves a complete checkpoint."""

    def __init__(self, directory: Path, warn: Callable[[str], None] | None = None) -> None:
        self.directory = directory
        self.warn = warn

    async def save(self, trainer: TrainerLink, state: ControllerState) -> None:
        async def write(staging: Path) -> None:
            await trainer.save_checkpoint(str(staging))
            state.save(staging)

        await save_checkpoint_dir(self.directory.parent, write, meta={"step": state.step}, name=self.directory.name)

    async def restore(self, trainer: TrainerLink) -> tuple[int, int]:
        # Finish an interrupted swap and fall back past a checkpoint that fails verification
        # (CheckpointError when none verifies: the trainer must not load a damaged one).
        latest_checkpoint(self.directory.parent, name=self.directory.name, warn=self.warn)
        version = await trainer.restart()  # its constructor reads self.directory
        step = ControllerState.load(self.directory).step if (self.directory / STATE_FILE).exists() else 0
        return version, step


@dataclass
class RunHandles:
    """A live run, for `run_async(observer=...)`: its controller and actor meshes (keys
    `trainer`, `env`, `pool:<name>`), e.g. for fault injection or a custom dashboard."""

    controller: Controller
    meshes: dict[str, Any]


_CHECKPOINT_ERROR = f"{CheckpointError.__module__}.{CheckpointError.__qualname__}"


def _checkpoint_error(exc: BaseException) -> CheckpointError | None:
    """The CheckpointError inside `exc`: itself, or raised in an actor process (an ActorError
    naming it), at any depth of the ExceptionGroups trio's nurseries wrap errors in."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, ActorError) and exc.remote_type == _CHECKPOINT_ERROR:
        return CheckpointError(exc.message)
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            if (found := _checkpoint_error(sub)) is not None:
                return found
    return None


async def run_async(
    cfg: RunConfig,
    *,
    resume: bool = False,
    progress: Progress | None = None,
    observer: Callable[[RunHandles], Awaitable[None]] | None = None,
) -> RunResult:
    """Run (or resume) training to `cfg.steps`; see the module docstring.

    Cancellation stops every actor process; an interrupt (SIGINT) finishes the step in
    progress, checkpoints and returns with `interrupted=True`. `observer`, if given, runs
    beside the controller once the actors are up, and is cancelled when the run ends.

    Errors: a checkpoint or model file that cannot be used, in this process or in an actor
    (the trainer loads its checkpoint, samplers their model), raises CheckpointError with
    its one-line message, never the ExceptionGroup it travelled in.
    """
    try:
        return await _run_async(cfg, resume=resume, progress=progress, observer=observer)
    except (CheckpointError, ActorError, BaseExceptionGroup) as e:
        found = _checkpoint_error(e)
        if found is None:
            raise
        raise found from None


async def _run_async(
    cfg: RunConfig, *, resume: bool, progress: Progress | None, observer: Callable[[RunHandles], Awaitable[None]] | None
) -> RunResult:
    from actors.env import EnvActor, EnvConfig
    from actors.trainer import TrainerGroup, trainer_mesh
    from hardware import CostLedger, Scheduler, ThroughputModel

    t0 = time.monotonic()
    check_runnable(cfg)  # devices, task and params: one line naming the field, before any actor starts
    present = await check_hosts(cfg.pools)  # a host that is down or refuses our key stops the run here
    checked = preflight(cfg)  # model, memory, task modules, datasets: before any process
    run_dir = cfg.run_dir
    ckpt_dir = run_dir / "checkpoint"
    progress = progress or Progress(cfg.steps)
    state = ControllerState()
    warn = progress.warning
    if resume:
        # Also resolves an interrupted replacement and falls back past a damaged checkpoint.
        if latest_checkpoint(run_dir, warn=warn) is None:
            raise ConfigError(f"{run_dir}: no complete checkpoint to resume from")
        try:
            state = ControllerState.load(ckpt_dir)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for log in ("metrics.jsonl", "traces.jsonl"):
            repair_jsonl(run_dir / log, warn=warn)
        _truncate_metrics(run_dir / "metrics.jsonl", state.step)
    else:
        if (run_dir / "metrics.jsonl").exists():
            raise ConfigError(
                f"{run_dir}: a run with this name exists; use --resume {run_dir} or another name (--set name=...)"
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(cfg.resolved_json())
    setup_run_telemetry(run_dir, cfg.telemetry)
    if cfg.placement.sampler_cpus:  # the controller works alongside the samplers
        os.sched_setaffinity(0, set(cfg.placement.sampler_cpus))

    model_cfg = run_model_config(cfg)
    precisions = sorted({p.precision for p in cfg.pools})
    trainer_cfg = cfg.trainer.model_copy(
        update={"recipe": cfg.recipe, "seed": cfg.model.seed, "model": model_cfg, "precisions": precisions}
    )
    env = actor_env(cfg, cfg.placement.sampler_cpus)
    scheduler = Scheduler(cfg.pools, ThroughputModel(cfg.pools, _model_spec(checked.params)))
    # Emulated pools are billed their measured busy seconds at the labelled GPU's price
    # (no throughput model given to the ledger), so the report reflects the run that happened.
    ledger = CostLedger(cfg.pools)
    if resume:
        try:
            ledger.load_state(state.ledger)
            scheduler.load_state(state.scheduler)
        except ValueError as e:
            raise ConfigError(f"{ckpt_dir / STATE_FILE}: {e}") from None

    progress.message(
        f"flotilla: run {cfg.name} → {run_dir} ({cfg.mode}, {len(cfg.pools)} pools, "
        f"{'resuming at step ' + str(state.step) if resume else 'starting'})"
    )
    sinks = open_sinks(cfg.telemetry, run_dir, cfg.name, json.loads(cfg.resolved_json()))
    metrics = MetricsLog(run_dir / "metrics.jsonl", sinks=sinks)
    # The trainer always names the checkpoint directory: a trainer respawned mid-run
    # restores from the newest checkpoint there (a fresh run's first trainer finds none).
    # Weight messages are sealed with a key only this run's trainer and samplers hold (it
    # travels in their constructor arguments: CurveZMQ-encrypted across machines).
    weights_key = secrets.token_hex(32)
    meshes: dict[str, Any] = {
        "trainer": trainer_mesh(
            trainer_cfg,
            str(ckpt_dir),
            not resume,
            weights_key=weights_key,
            name="trainer",
            env=actor_env(cfg, cfg.placement.trainer_cpus),
        ),
        "env": open_mesh(
            EnvActor,
            _env_config(
                cfg,
                EnvConfig(
                    step_timeout_s=cfg.task.episode_timeout_s,
                    max_seq_len=cfg.model.max_seq_len,
                    model_path=model_cfg if isinstance(model_cfg, str) else None,
                    chat_template_kwargs=cfg.model.chat_template_kwargs,
                    task_modules=checked.task_modules,
                ),
            ),
            procs=cfg.task.env_actors,
            name="env",
            env={**env, **identity_env(cfg.pools)},
            restart_timeout=cfg.faults.restart_timeout_s,
        ),
    }
    for pc in cfg.pools:  # samplers start without weights and wait for the trainer's keyframe
        meshes[f"pool:{pc.name}"] = pool_mesh(
            pc,
            model_cfg,
            seed=cfg.seed,
            env=env,
            max_len=cfg.model.max_seq_len,
            weights_key=weights_key,
            restart_timeout=cfg.faults.restart_timeout_s,
            present=present.get(pc.name),
        )
    checkpoints = DiskCheckpoints(ckpt_dir, warn)
    async with trio.open_nursery() as actors:
        with span("startup", pools=len(cfg.pools)):
            opened = await _open_all(actors, meshes)
        for pc in cfg.pools:
            for warning in await gpu_warnings(pc, opened[f"pool:{pc.name}"]):
                progress.message(f"flotilla: warning: {warning}")
        # Several trainer ranks (FSDP2) are one link too; the controller cannot tell.
        # The trainer fetches held trajectories from the environment actors themselves.
        tmesh, emesh = opened["trainer"], opened["env"]
        trainer = MeshTrainer(tmesh, emesh) if tmesh.size == 1 else TrainerGroup(tmesh, emesh)
        links = Links(
            trainer=trainer,
            envs=MeshEnvs(opened["env"]),
            pools={pc.name: MeshPool(pc, opened[f"pool:{pc.name}"]) for pc in cfg.pools},
        )
        state.version = await trainer.version()
        controller = Controller(
            cfg,
            links,
            state,
            scheduler=scheduler,
            ledger=ledger,
            metrics=metrics,
            progress=progress,
            checkpoints=checkpoints,
            dataset=checked.dataset,
            eval_dataset=checked.eval_dataset,
        )
        try:
            async with trio.open_nursery() as beside:
                if observer is not None:
                    beside.start_soon(observer, RunHandles(controller, opened))
                await controller.run()
                beside.cancel_scope.cancel()
            if not controller.abandoned:
                with trio.CancelScope(shield=True):
                    await controller.checkpoint()
        finally:
            metrics.close()
        actors.cancel_scope.cancel()  # leaves every mesh: its processes stop, in parallel
    cost_report = ledger.report()
    cost_report.write(run_dir)
    finish_outputs(run_dir, sinks, cost_report, state.step, progress)
    result = RunResult(
        run_dir,
        state.step,
        state.version,
        controller.interrupted,
        controller.counts(),
        time.monotonic() - t0,
        controller.failure,
    )
    how = "stopped" if result.failure else "interrupted" if result.interrupted else "done"
    progress.message(f"flotilla: {how} at step {result.steps_done}, {result.wall_s:.0f}s; reports in {run_dir}")
    left_out = spans_not_written(run_dir / TRACE_FILE)
    if left_out:
        progress.message(f"flotilla: traces.jsonl reached telemetry.traces_max_mb; {left_out} span(s) were not written")
    return result


def _env_config(cfg: RunConfig, env_config: Any) -> Any:
    """`[task] kind = "harness"` gives the environment actors the gateway's harness;
    `kind = "verifiers"` the gateway alone (each rollout opens a session of it)."""
    if cfg.task.kind == "verifiers":
        return env_config.model_copy(update={"gateway": True})
    if cfg.task.kind != "harness":
        return env_config
    from actors.gateway import HarnessConfig

    harness = HarnessConfig(
        command=cfg.task.command,
        entrypoint=cfg.task.entrypoint,
        grader=cfg.task.grader,
        timeout_s=cfg.task.episode_timeout_s,
        max_new_tokens=cfg.task.max_new_tokens,
    )
    return env_config.model_copy(update={"harness": harness})


async def _hold(mesh_cm: Any, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
    async with mesh_cm as mesh:
        task_status.started(mesh)
        await trio.sleep_forever()


async def _open_all(actors: trio.Nursery, meshes: dict[str, Any]) -> dict[str, Any]:
    """Open every mesh at once (process start-up dominates: torch imports, model builds);
    each stays open, in `actors`, until that nursery is cancelled."""
    opened: dict[str, Any] = {}

    async def open_one(key: str) -> None:
        opened[key] = await actors.start(_hold, meshes[key])

    async with trio.open_nursery() as starting:
        for key in meshes:
            starting.start_soon(open_one, key)
    return opened


def run(
    config: RunConfig | str | Path, *, overrides: list[str] | None = None, resume: bool = False, quiet: bool = False
) -> RunResult:
    """Blocking entry point: `from orchestrator import run; run("examples/guess_number.toml")`."""
    cfg = config if isinstance(config, RunConfig) else load_config(config, overrides)
    progress = make_progress(cfg.steps, quiet=quiet)
    try:
        return trio.run(lambda: run_async(cfg, resume=resume, progress=progress))
    finally:
        progress.close()


def run_from_cli(
    config: str | None, *, overrides: list[str], steps: int | None, mode: str | None, resume: str | None, quiet: bool
) -> int:
    extra = list(overrides)
    if steps is not None:
        extra.append(f"steps={steps}")
    if mode is not None:
        extra.append(f'mode="{mode}"')
    if resume:
        cfg = load_config(Path(resume) / "config.json", extra)
        if Path(resume).resolve() != cfg.run_dir.resolve():
            cfg = cfg.model_copy(update={"run_root": str(Path(resume).parent), "name": Path(resume).name})
    else:
        if config is None:
            raise ConfigError("flotilla run needs a CONFIG (or --resume RUN_DIR)")
        cfg = load_config(config, extra)
    result = run(cfg, resume=bool(resume), quiet=quiet)
    if result.failure:
        print(f"flotilla: stopped: {result.failure}", file=sys.stderr)
        return 1
    return 0
