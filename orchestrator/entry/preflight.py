"""Checks that run before any actor process starts, each failing with one line.

`preflight(cfg)` answers, in the controller's process and in seconds:

* the model: the checkpoint directory exists, its `model_type` is supported, its
  tokenizer (if any) has a chat template and fits the model's vocabulary, and
  `[model] max_seq_len` fits its positions;
* memory: the checkpoint's parameters times the bytes each process on this machine
  keeps per parameter (the trainer's fp32 weights, gradients and AdamW moments plus
  its wire snapshots; each CPU sampler's compute copy and snapshot) fits in the
  memory available now -- otherwise the message gives both sizes;
* the task: `[task] modules` import (dotted names or `.py` paths), `[task] name` is
  registered, and the task accepts its parameters (`actors.env.check_task` with
  `[task] params` merged with the first row of each dataset);
* a library kind (`actors.env.libs`): its extra is installed (else one line naming it), and
  its dataset, client class or verifiers environment loads with `[task] params`;
* the datasets load.

GPU memory is not checked here (this check sees host memory only): a CUDA trainer or
pool is counted at its host-side share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.state.config import ConfigError, RunConfig

__all__ = ["Preflight", "estimate_memory", "preflight"]

TRAINER_BYTES_PER_PARAM = 16 + 2
"""fp32 weights, gradients and two AdamW moments (4 x 4 bytes), one bf16 wire snapshot."""
SAMPLER_BYTES_PER_PARAM = 4 + 2 + 2
"""A CPU sampler's fp32 compute copy, its wire snapshot and the snapshot being received."""


@dataclass
class Preflight:
    """What the checks found, for the runner to hand on."""

    params: int
    """Model parameters."""
    task_modules: list[str] = field(default_factory=list)
    """`[task] modules` with file paths made absolute (actor processes import these)."""
    dataset: Any = None
    """The training TaskDataset, or None."""
    eval_dataset: Any = None
    """The held-out TaskDataset, or None."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def estimate_memory(params: int, cfg: RunConfig) -> int:
    """Host bytes the run's processes on this machine keep for the model."""
    need = params * TRAINER_BYTES_PER_PARAM if cfg.trainer.device == "cpu" else 0
    for pool in cfg.pools:
        if pool.device == "cpu" and not getattr(pool, "hosts", None):  # remote hosts: not here
            need += params * SAMPLER_BYTES_PER_PARAM
    return need


def _check_model(cfg: RunConfig) -> int:
    from actors.models import (
        build_model,
        checkpoint_params,
        default_model_config,
        load_model_config,
    )
    from actors.tokenizer import VOCAB_SIZE

    path = cfg.model.path
    if path is None:
        conf = default_model_config(vocab_size=VOCAB_SIZE)
        conf.update(cfg.model.overrides)
        hf = load_model_config(conf)
        params = sum(p.numel() for p in build_model(conf, seed=0).parameters())
    else:
        if not Path(path).is_dir():
            raise ConfigError(f"model.path {path!r}: no such directory")
        if cfg.model.overrides:
            raise ConfigError("model.overrides: only for the built-in model (a checkpoint's config.json is its own)")
        try:
            hf = load_model_config(path)
            params, _ = checkpoint_params(path)
        except (ValueError, FileNotFoundError, TypeError) as e:
            raise ConfigError(f"model.path {path!r}: {e}") from None
        _check_tokenizer(path, hf.vocab_size, cfg.model.chat_template_kwargs)
    positions = getattr(hf, "max_position_embeddings", None)
    if positions is not None and cfg.model.max_seq_len > positions:
        raise ConfigError(
            f"model.max_seq_len={cfg.model.max_seq_len} exceeds the model's max_position_embeddings={positions}"
        )
    return params


def _check_tokenizer(path: str, model_vocab: int, template_kwargs: dict[str, Any]) -> None:
    from actors.chat import HFChatFormat, load_chat_format

    try:
        fmt = load_chat_format(path, template_kwargs)
        if isinstance(fmt, HFChatFormat):  # the template must render (Jinja errors surface here)
            fmt.render([{"role": "user", "content": "hi"}], generation_prompt=True)
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"model.path {path!r}: tokenizer: {msg}") from None
    if isinstance(fmt, HFChatFormat) and fmt.vocab_size > model_vocab:
        raise ConfigError(
            f"model.path {path!r}: the tokenizer has {fmt.vocab_size} tokens but "
            f"the model only {model_vocab} embedding rows"
        )


def _check_memory(params: int, cfg: RunConfig) -> None:
    import psutil

    need = estimate_memory(params, cfg)
    available = psutil.virtual_memory().available
    if need > available:
        where = cfg.model.path or "the built-in model"
        raise ConfigError(
            f"model {where}: {params / 1e9:.3g}B parameters need about {_gib(need)} of memory "
            f"for the trainer and the CPU samplers on this machine; {_gib(available)} available"
        )


def _check_task(cfg: RunConfig, dataset: Any, eval_dataset: Any) -> list[str]:
    from actors.env import TaskCheckError, check_task

    modules = [str(Path(m).resolve()) if m.endswith(".py") or "/" in m else m for m in cfg.task.modules]
    if cfg.task.kind == "harness":  # no registered environment: the harness is the task
        _check_harness(cfg)
        return modules
    if cfg.task.kind == "verifiers":  # played via the gateway: load the environment once
        _check_verifiers(cfg, modules)
        return modules
    if cfg.eval.every and dataset is not None and eval_dataset is None:
        raise ConfigError("eval: task.dataset is set but task.eval_dataset is not (evaluation plays held-out rows)")
    samples = [(d.rows[0], d.where(0)) for d in (dataset, eval_dataset) if d is not None]
    if dataset is None:  # the task's own params make the instances
        samples.insert(0, ({}, ""))
    for row, where in samples:
        try:
            check_task(cfg.task.task_name, {**cfg.task.params, **row}, modules)
        except TaskCheckError as e:
            raise ConfigError(f"{e} (with {where})" if where else str(e)) from None
    return modules


def _check_verifiers(cfg: RunConfig, modules: list[str]) -> None:
    """verifiers is installed, the task modules import, and the environment loads with its
    args and has a dataset to play."""
    from actors.env import TaskModuleError, import_task_modules
    from actors.env.libs import LibraryMissing
    from actors.env.libs._verifiers import check_environment

    try:
        import_task_modules(modules)  # the environment may live in one of them
    except TaskModuleError as e:
        raise ConfigError(f"task.modules: {e}") from None
    try:
        check_environment(cfg.task.name, cfg.task.params)
    except LibraryMissing as e:
        raise ConfigError(str(e)) from None
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(
            f"task.name: verifiers environment {cfg.task.name!r} with params "
            f"{cfg.task.params} failed to load: {type(e).__name__}: {msg}"
        ) from None


def _check_harness(cfg: RunConfig) -> None:
    """The harness's entrypoint and grader import, its command's program exists."""
    import shlex
    import shutil

    from actors.gateway import resolve

    for key in ("entrypoint", "grader"):
        spec = getattr(cfg.task, key)
        if spec is not None:
            try:
                resolve(spec)
            except Exception as e:
                raise ConfigError(f"task.{key} {spec!r}: {type(e).__name__}: {e}") from None
    if cfg.task.command is not None:
        argv = shlex.split(cfg.task.command)
        if not argv or shutil.which(argv[0]) is None:
            raise ConfigError(f"task.command {cfg.task.command!r}: program {argv[0] if argv else ''!r} not found")


def _load_datasets(cfg: RunConfig) -> tuple[Any, Any]:
    from actors.env import DatasetError, TaskDataset

    out = []
    for key in ("dataset", "eval_dataset"):
        path = getattr(cfg.task, key)
        if path is None:
            out.append(None)
            continue
        try:
            out.append(TaskDataset.load(path))
        except DatasetError as e:
            raise ConfigError(f"task.{key}: {e}") from None
    return out[0], out[1]


def preflight(cfg: RunConfig) -> Preflight:
    """Run every check (see the module docstring); ConfigError names the first problem."""
    params = _check_model(cfg)
    _check_memory(params, cfg)
    dataset, eval_dataset = _load_datasets(cfg)
    modules = _check_task(cfg, dataset, eval_dataset)
    return Preflight(params=params, task_modules=modules, dataset=dataset, eval_dataset=eval_dataset)
