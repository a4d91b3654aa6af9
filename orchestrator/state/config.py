"""The run configuration: one TOML file composes every component's own config model.

Each component keeps its config beside its code (``RecipeConfig`` in policies,
``PoolConfig`` in hardware, ``TrainerConfig`` in actors.trainer); this module
only composes them with the controller's own sections (``sections``), loads TOML, applies
``--set key=value`` overrides and turns validation errors into messages that
name the file and the field.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from actors.trainer import TrainerConfig
from hardware import PoolList
from orchestrator.state.sections import (
    CheckpointSection,
    EvalConfig,
    FaultsSection,
    ModelSection,
    PlacementSection,
    RolloutSection,
    SftSection,
    TaskSection,
    TelemetrySection,
)
from policies import RecipeConfig

__all__ = [
    "ConfigError",
    "RunConfig",
    "apply_overrides",
    "check_runnable",
    "load_config",
]


class ConfigError(ValueError):
    """A run config that cannot be used; the message names the file and the field."""


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = "run"
    """The run's name: outputs go to `<run_root>/<name>/`."""
    run_root: str = "runs"
    """Folder holding run directories."""
    seed: int = 0
    """Seeds task generation and sampling."""
    steps: int = Field(default=50, ge=1)
    """Optimizer steps to run."""
    mode: Literal["async", "sync"] = "async"
    """`async`: sampling and training overlap within the pools' staleness budgets. `sync`:
    generate, then train, then sync weights, on-policy: the baseline."""
    model: ModelSection = Field(default_factory=ModelSection)
    """The policy model."""
    task: TaskSection = Field(default_factory=TaskSection)
    """The environment and its task source."""
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    """Batch shape and buffering."""
    recipe: RecipeConfig = Field(default_factory=RecipeConfig)
    """The RL objective and sampling parameters (policies.RecipeConfig)."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Optimizer and micro-batching (actors.trainer.TrainerConfig); its recipe is replaced
    by the top-level [recipe]."""
    placement: PlacementSection = Field(default_factory=PlacementSection)
    """Threads and CPU pinning of the actor processes."""
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    """Periodic checkpoints and trainer restarts."""
    faults: FaultsSection = Field(default_factory=FaultsSection)
    """Liveness pings, unresponsive actors, respawn back-off and hedged stragglers."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation during training (EvalConfig)."""
    pools: PoolList = Field(min_length=1)
    """Sampler pools ([[pools]] tables, hardware.PoolConfig), names unique."""
    telemetry: TelemetrySection = Field(default_factory=TelemetrySection)
    """Metric sinks besides metrics.jsonl: W&B and TensorBoard (orchestrator.state.sinks)."""
    sft: SftSection = Field(default_factory=SftSection)
    """Supervised fine-tuning for `flotilla sft` (a warm start; `flotilla run` ignores it)."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        """A single path component, so a run's outputs cannot land outside `run_root`."""
        if not v or v in (".", "..") or any(c in v for c in "/\\\0") or v.startswith("-"):
            raise ValueError(f"run name {v!r} must be one plain folder name (no '/', '\\', '..', leading '-' or NUL)")
        return v

    @property
    def run_dir(self) -> Path:
        return Path(self.run_root) / self.name

    @model_validator(mode="after")
    def _lr_over_the_run(self) -> RunConfig:
        """An unset `trainer.lr_decay_steps` decays the rate over the whole run (to
        `lr_final_ratio * lr` at the last step), as HF Trainer's default schedule does."""
        if "lr_decay_steps" not in self.trainer.model_fields_set:
            self.trainer.lr_decay_steps = self.steps
        return self

    @model_validator(mode="after")
    def _eval_pool(self) -> RunConfig:
        names = [p.name for p in self.pools]
        if self.eval.pool is not None and self.eval.pool not in names:
            raise ValueError(f"eval.pool {self.eval.pool!r} is not a pool; pools: {names}")
        return self

    @model_validator(mode="after")
    def _sglang_supports(self) -> RunConfig:
        """SGLang's top-p keeps no minimum support size, so it cannot sample with `min_keep > 1`."""
        r = self.recipe
        for i, p in enumerate(self.pools):
            if p.backend == "sglang" and r.min_keep > 1 and r.top_p < 1.0 and r.temperature > 0:
                raise ValueError(
                    f"pools.{i}.backend: pool {p.name!r} is an SGLang pool, whose top-p has "
                    f"no minimum support size; set recipe.min_keep = 1 (now {r.min_keep}) "
                    f"or recipe.top_p = 1"
                )
        return self

    def resolved_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)


def _parse_value(text: str) -> Any:
    """A --set value is a TOML literal (1, 0.5, true, "x", [1, 2]); bare words are strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.sub=value` overrides to a raw config dict (pools by index: pools.0.price_per_gpu_hour)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value")
        node: Any = raw
        parts = key.strip().split(".")
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                try:
                    node = node[int(part)]
                except (ValueError, IndexError):
                    raise ConfigError(f"--set {item!r}: no list element {part!r}") from None
            else:
                node = node.setdefault(part, {})
            if not isinstance(node, (dict, list)):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"--set {item!r}: {where} is a value ({node!r}), not a section with fields")
        last = parts[-1]
        if isinstance(node, list):
            raise ConfigError(f"--set {item!r}: cannot replace a whole list element")
        node[last] = _parse_value(value.strip())
    return raw


def _format_error(source: str, err: ValidationError) -> str:
    if err.error_count() == 1:  # the common case, on one line
        e = err.errors()[0]
        return f"{source}: {'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}"
    lines = [f"{source}: invalid config"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        lines.append(f"  {loc}: {e['msg']}")
    return "\n".join(lines)


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, raw: dict[str, Any] | None = None
) -> RunConfig:
    """Read a TOML run config (or a raw dict), apply overrides, validate.

    Raises ConfigError naming the file and each offending field.
    """
    source = str(path) if path is not None else "<config>"
    if raw is None:
        if path is None:
            raise ConfigError("no config given")
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"{source}: cannot read: {e.strerror}") from None
        try:
            raw = tomllib.loads(text) if str(path).endswith(".toml") else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{source}: not valid {'TOML' if str(path).endswith('.toml') else 'JSON'}: {e}") from None
    raw = apply_overrides(raw, overrides or [])
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_error(source, e)) from None


def check_runnable(cfg: RunConfig) -> None:
    """What validation alone cannot know, checked before any actor starts: that this
    machine has the devices the config asks for, and that the task exists and accepts its
    params (`actors.env.check_task`). Raises ConfigError naming the field. Imports torch."""
    import torch

    from actors.env import TaskCheckError, check_task
    from hardware import check_devices

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        check_devices(list(cfg.pools), cuda)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.trainer.device == "cuda" and cuda == 0:
        raise ConfigError("trainer.device: 'cuda' but this machine has no CUDA GPU; use \"cpu\"")
    if cfg.task.dataset is not None or cfg.task.kind in ("harness", "verifiers"):
        # Rows complete the params / a harness is no registered task: orchestrator.entry.preflight
        # checks the task on its rows, the harness's entrypoint, grader and command, and a
        # verifiers environment.
        return
    try:
        check_task(cfg.task.task_name, cfg.task.params, cfg.task.modules)
    except TaskCheckError as e:
        raise ConfigError(str(e)) from None
