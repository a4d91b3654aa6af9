"""The run config's sections of the controller's own: model, task, rollout, placement,
checkpoints, faults, evaluation, telemetry and SFT. ``config`` composes them with the
components' own models into ``RunConfig``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "CheckpointSection",
    "EvalConfig",
    "FaultsSection",
    "ModelSection",
    "PlacementSection",
    "RolloutSection",
    "SftSection",
    "TaskSection",
    "TelemetrySection",
    "WandbSection",
]


class EvalConfig(BaseModel):
    """The ``[eval]`` section."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    every: int = Field(default=0, ge=0)
    """Evaluate after every this many training steps; 0 turns evaluation off."""
    episodes: int = Field(default=16, ge=1)
    """Held-out episodes per evaluation."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature of evaluation episodes; 0 is greedy."""
    pool: str | None = None
    """The sampler pool that plays evaluation episodes (None: the first pool)."""


class WandbSection(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    project: str = Field(min_length=1)
    """W&B project the run is logged to."""
    mode: Literal["offline", "online"] = "offline"
    """`offline`: write only under `runs/<name>/wandb/` (upload later with `wandb sync`);
    `online`: stream to the W&B server (needs network and a login)."""
    entity: str | None = None
    """W&B entity (user or team); None: the logged-in user's default."""


class TelemetrySection(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    wandb: WandbSection | None = None
    """Log every metrics line and the cost report to Weights & Biases (extra `wandb`):
    `{ project = "...", mode = "offline" | "online", entity = "..." (optional) }`; offline runs
    live in `runs/<name>/wandb/`."""
    tensorboard: bool = False
    """Write TensorBoard event files under `runs/<name>/tensorboard/` (extra `tensorboard`)."""
    traces: bool = True
    """Write `traces.jsonl` (and OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set); false: no
    spans are recorded at all."""
    trace_sample: float = Field(default=0.01, ge=0.0, le=1.0)
    """Fraction of rollouts (and other root traces) whose spans are written, decided once
    per trace and followed by every process it crosses, so a sampled rollout keeps all its
    spans. Written whatever the fraction: train steps, weight publishes and applies,
    checkpoints, evaluations, restarts and respawns, dropped rollouts, and the `rollout`
    spans of failed rollouts (without their children when outside the sample). 1 writes
    every span."""
    traces_max_mb: float | None = Field(default=1024.0, gt=0.0)
    """Cap on `traces.jsonl` in MB (10^6 bytes): spans past it are not written but counted
    (`traces_not_written` in the metrics lines once it happens). None: no cap."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ModelSection(_Section):
    path: str | None = None
    """A local Hugging Face checkpoint directory: config.json (qwen3, qwen2, llama or mistral),
    *.safetensors (sharded or not), and tokenizer.json/tokenizer_config.json with a chat
    template, which then renders every episode's turns. None: the tiny built-in Qwen3-style
    model with random init and the built-in word tokenizer."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Fields of the built-in model config to change (hidden_size, num_hidden_layers, ...)."""
    seed: int = 0
    """Seed of the random init when no path is given."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the checkpoint's chat template (e.g. `{ enable_thinking = false }`
    for Qwen3)."""
    max_seq_len: int = Field(default=256, ge=8)
    """Context length of an episode (prompt, replies and observations, in tokens): an episode
    ends before a turn that could pass it, and samplers size their KV cache to it."""

    @field_validator("overrides")
    @classmethod
    def _known_fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        """Each override names a field of the built-in config and has its type; sizes are ≥ 1."""
        from actors.models import default_model_config

        base = default_model_config()
        for key, value in v.items():
            if key not in base:
                raise ValueError(f"{key}: not a field of the built-in model config (known: {', '.join(sorted(base))})")
            want = type(base[key])
            if want is float and type(value) is int:
                value = float(value)
            if type(value) is not want:
                raise ValueError(f"{key}: expected {want.__name__}, got {value!r}")
            if want is int and key != "vocab_size" and value < 1:
                raise ValueError(f"{key}: must be ≥ 1, got {value}")
            if want is float and not value > 0:  # also refuses NaN
                raise ValueError(f"{key}: must be > 0, got {value}")
        return v


class TaskSection(_Section):
    name: str = "guess_number"
    """A registered task: `guess_number`, `arithmetic`, `sum_mod`, `reverse`, `sort`, or one a user registered; for a
    library `kind`, the library's own name (a reasoning-gym dataset, a verifiers environment
    id or `module:function`, an OpenEnv client class `module:Class`)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Task parameters (for guess_number: n, max_turns; for a library kind: its generator's,
    `load_environment`'s or the OpenEnv adapter's, see docs/harnesses.md)."""
    env_actors: int = Field(default=1, ge=1)
    """Environment actor processes; each runs many episodes concurrently."""
    episode_timeout_s: float = Field(default=60.0, gt=0)
    """An episode that takes longer ends as a failed trajectory."""
    max_new_tokens: int = Field(default=1, ge=1)
    """Tokens the policy may generate per turn."""
    max_failed_in_a_row: int | None = Field(default=None, ge=1)
    """Stop the run when this many episodes in a row failed (a crashing, hanging or
    reward-less environment or harness), naming the last error; None: 4 x
    `[rollout] group_size` plus the rollouts the pools can run at once (a sampler killed
    mid-run fails all it serves). An environment that fails only sometimes still trains:
    any episode that succeeds resets the count."""
    modules: list[str] = Field(default_factory=list)
    """Modules that register tasks (`@register_task`): dotted names (`my_pkg.tasks`) or `.py`
    paths (`path/to/tasks.py`), imported in every environment process before its first
    episode, and checked before any actor starts."""
    dataset: str | None = None
    """A local `.jsonl`/`.json`/`.parquet` file: one task instance per row, merged over
    `params` (rows shuffled per epoch with the run's seed)."""
    eval_dataset: str | None = None
    """Held-out rows for `[eval]` (never trained on); None: fresh seeds of the task."""
    kind: Literal["env", "harness", "reasoning_gym", "verifiers", "openenv"] = "env"
    """`env`: episodes of the registered environment `name`. `harness`: every episode runs an
    agent harness against an OpenAI-compatible gateway session (actors.gateway); give
    `command` or `entrypoint`; `episode_timeout_s` bounds the harness; dataset rows become
    the harness's tasks. Environment libraries (actors.env.libs; each an optional extra):
    `reasoning_gym` (`name` a dataset, `params` its generator's config, rewarded by its
    scorer), `verifiers` (`name` an installed environment id or `module:function`, `params`
    its `load_environment` args, rewarded by its rubric, played via a gateway session),
    `openenv` (`name` the environment's client class `module:Class`, `params.base_url` its
    server)."""
    command: str | None = None
    """Harness: a command run once per episode (`python my_agent.py {task}`, `{task}` = the
    task's params as JSON), with OPENAI_BASE_URL and OPENAI_API_KEY set for its session."""
    entrypoint: str | None = None
    """Harness: `module:function` or `path/file.py:function`, an async function given the
    session's base URL and the task's params, run in the environment actor."""
    grader: str | None = None
    """Harness: `module:function` given (transcript, params) returning the reward (else the
    harness reports it: a `{"reward": x}` stdout line, POST /reward, or the return value)."""

    @model_validator(mode="after")
    def _harness_fields(self) -> TaskSection:
        given = [f for f in ("command", "entrypoint", "grader") if getattr(self, f) is not None]
        if self.kind == "harness" and (self.command is None) == (self.entrypoint is None):
            raise ValueError("kind = 'harness' needs exactly one of command or entrypoint")
        if self.kind != "harness" and given:
            raise ValueError(f"{', '.join(given)} only apply to kind = 'harness'")
        if self.kind == "verifiers" and (self.dataset or self.eval_dataset):
            raise ValueError("kind = 'verifiers' plays the environment's own dataset; remove dataset / eval_dataset")
        if self.kind not in ("env", "harness") and "name" not in self.model_fields_set:
            raise ValueError(f"kind = {self.kind!r} needs name (the library's dataset, environment id or client class)")
        return self

    @property
    def task_name(self) -> str:
        """The name episodes carry (`TaskSpec.task`): `name`, or `"<kind>:<name>"` for a
        library kind (`actors.env.libs` resolves it)."""
        return self.name if self.kind in ("env", "harness") else f"{self.kind}:{self.name}"


class RolloutSection(_Section):
    prompts_per_step: int = Field(default=16, ge=1)
    """Prompts (GRPO groups) in one training batch."""
    group_size: int = Field(default=8, ge=2)
    """Rollouts per prompt; advantages are centred within the group."""
    max_buffered_groups: int = Field(default=32, ge=1)
    """Completed or in-flight groups the producer may hold beyond the next batch; bounds memory
    and, with the pools' staleness budgets, how far sampling runs ahead of training."""
    filter_zero_variance: bool = False
    """Drop a group whose rewards are all equal once it completes (every GRPO advantage is 0:
    no signal) and sample a new one in its place, so each batch holds P groups with signal
    (DAPO's dynamic sampling). Dropped groups are counted (`zero_variance_groups` in
    metrics.jsonl); their tokens are sampled but not trained."""
    hold_trajectories: bool = True
    """Environment actors keep each finished trajectory's tensors and the controller handles
    only its metadata (`TrajectoryRef`: reward, versions, lengths, pool); the trainer fetches
    a batch's tensors from the environment actors directly. False: every trajectory travels
    through the controller's process (environment → controller → trainer)."""
    max_zero_variance_drops: int | None = Field(default=None, ge=0)
    """At most this many groups are dropped between two batches; past it zero-variance groups
    are trained as they are (`zero_variance_kept`), so a task every reply solves, or every
    reply fails, cannot stall the run. None: 4 x `prompts_per_step`."""

    @property
    def zero_variance_drop_bound(self) -> int:
        """`max_zero_variance_drops`, or its default 4 x `prompts_per_step`."""
        if self.max_zero_variance_drops is not None:
            return self.max_zero_variance_drops
        return 4 * self.prompts_per_step


class PlacementSection(_Section):
    threads_per_actor: int = Field(default=1, ge=1)
    """Compute threads of each actor process (OMP/MKL/torch); on a small machine, processes
    fighting over cores cost more than they gain."""
    trainer_cpus: list[int] | None = None
    """CPU cores the trainer process is pinned to (None: no pinning)."""
    sampler_cpus: list[int] | None = None
    """CPU cores the sampler and environment processes are pinned to (None: no pinning).
    With trainer_cpus, this emulates separate devices on one machine."""


class CheckpointSection(_Section):
    every_steps: int | None = Field(default=50, ge=1)
    """Checkpoint every this many steps (None: only by time, at the end and on Ctrl-C). A
    dead trainer is restored from the last checkpoint, so this bounds the steps it repeats."""
    every_s: float | None = Field(default=None, gt=0)
    """Checkpoint when this many seconds passed since the last one (None: only by steps)."""
    max_restarts: int = Field(default=3, ge=0)
    """Times a dead trainer is restored from a checkpoint before the run gives up."""


class FaultsSection(_Section):
    """How the controller tells a frozen or unreachable actor from a busy one, and what it
    does then (orchestrator.controller._liveness); and when it hedges a straggling rollout
    (orchestrator.controller._hedge)."""

    ping_every_s: float = Field(default=1.0, gt=0)
    """Seconds between liveness pings of each sampler and environment actor (a cheap call
    every actor answers from its message loop); an actor that answered an episode or a
    weight update since its last ping is not pinged."""
    unresponsive_after_s: float = Field(default=3.0, gt=0)
    """An actor that has answered nothing for this long is unresponsive: the console names it
    once, its rollouts and weight pushes are abandoned and retried elsewhere, it gets no new
    work, and its statistics wait until it answers again (it rejoins then)."""
    give_up_after_s: float = Field(default=300.0, gt=0)
    """An actor unresponsive for this long is given up: its process is stopped (SIGKILL if it
    ignores SIGTERM) and a fresh one started."""
    host_give_up_after_s: float = Field(default=600.0, gt=0)
    """A sampler on a `flotilla host` that has answered nothing for this long (its host
    unreachable, or gone and every respawn failing) is given up for good, with one line:
    no more respawns and no work for it; the run goes on with the other samplers and pools.
    Shorter outages end when it answers again (it catches up on the weights and rejoins)."""
    restart_timeout_s: float = Field(default=600.0, gt=0)
    """A respawned sampler or environment actor not constructed within this many seconds
    (its model load included) is stopped and counts as a failed respawn (retried with
    back-off)."""
    respawn_backoff_max_s: float = Field(default=10.0, gt=0)
    """Longest wait between two respawn attempts of an actor whose respawn keeps failing
    (an unreachable host): the waits double from 0.5 s up to this."""
    stall_warn_s: float | None = Field(default=120.0, gt=0)
    """When no rollout has finished and no step was trained for this many seconds, one line
    says what the run waits on (rollouts queued and in flight, the trainer, each pool's usable
    samplers and weights, the environment actors); once per stall. None: never."""
    hedge_after_p90: float | None = Field(default=1.5, ge=1.0)
    """A rollout the next batch waits for that has run this many times its pool's p90 rollout
    duration (the recent finished ones) is started again on another sampler, not on its host;
    the first of the two to finish is kept, the other cancelled and discarded. None: never."""
    hedge_min_s: float = Field(default=0.25, gt=0)
    """No rollout is hedged before it has run this many seconds, however short its pool's
    rollouts are."""

    @model_validator(mode="after")
    def _ordered(self) -> FaultsSection:
        if self.host_give_up_after_s <= self.unresponsive_after_s:
            raise ValueError(
                f"host_give_up_after_s ({self.host_give_up_after_s:g}) must be longer than "
                f"unresponsive_after_s ({self.unresponsive_after_s:g})"
            )
        if self.give_up_after_s <= self.unresponsive_after_s:
            raise ValueError(
                f"give_up_after_s ({self.give_up_after_s:g}) must be longer than "
                f"unresponsive_after_s ({self.unresponsive_after_s:g})"
            )
        return self


class SftSection(_Section):
    """`flotilla sft CONFIG`: supervised fine-tuning before RL (a warm start), with the run's
    model, chat format and trainer; its checkpoint's `model/` is a `[model] path` for a run."""

    data: str | None = None
    """A JSONL file, one record a line: `{"messages": [{"role", "content"}, ...]}` or
    `{"prompt": "...", "completion": "..."}`. The loss is on assistant turns only. Required
    by `flotilla sft`."""
    epochs: int = Field(default=1, ge=1)
    """Passes over the data (each in a fresh order from the run's seed)."""
    steps: int | None = Field(default=None, ge=1)
    """Optimizer steps to take instead of `epochs` (the data is cycled as needed)."""
    lr: float | None = Field(default=None, gt=0.0)
    """Learning rate of the SFT steps (constant); None: `[trainer] lr`."""
    batch_size: int = Field(default=32, ge=1)
    """Sequences per optimizer step; the loss is the token mean over the batch."""
    name: str | None = None
    """Output folder under `run_root`; None: `<name>-sft`. The checkpoint lands in
    `<run_root>/<this>/checkpoint/` (its `model/` is what `[model] path` takes)."""

    @field_validator("name")
    @classmethod
    def _plain(cls, v: str | None) -> str | None:
        if v is not None and (not v or v in (".", "..") or any(c in v for c in "/\\\0") or v.startswith("-")):
            raise ValueError(f"sft name {v!r} must be one plain folder name (no '/', '\\', '..', leading '-' or NUL)")
        return v
