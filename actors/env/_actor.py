"""``EnvActor``: plays episodes against a sampler it calls directly.

The controller hands the actor a sampler handle (one actor, or a mesh to let the
runtime choose the least-loaded sampler per turn), a task and sampling params; the
actor builds the prompt, alternates generate calls and environment steps, and
returns the trajectory. Many episodes run concurrently on one actor (one trio
task per call); environments are fresh instances per episode.
"""
from __future__ import annotations

import sys
import uuid
from typing import Any

import trio
from pydantic import BaseModel, ConfigDict, Field

from actors.env._episode import EnvCalls, EpisodeLimits, play_episode
from actors.env._interface import registered_tasks
from actors.env._modules import import_task_modules
from actors.env._threads import EnvThreads
from actors.env._watchdog import LoopWatchdog
from actors.sampler import GenerateRequest, GenerateResult
from actors.chat import load_chat_format
from actors.types import SamplingParams, TaskSpec, Trajectory
from orchestrator.runtime import Actor, ActorRef, Mesh, endpoint, span

__all__ = ["EnvActor", "EnvConfig"]


class EnvConfig(BaseModel):
    """Limits of the episodes an EnvActor plays, and which task modules it loads."""

    model_config = ConfigDict(extra="forbid")

    step_timeout_s: float = Field(30.0, gt=0.0)
    """Limit on each environment call (reset or step); past it the episode fails."""
    generate_timeout_s: float = Field(300.0, gt=0.0)
    """Limit on each generate call (includes waiting for min_version weights)."""
    max_seq_len: int = Field(256, ge=2)
    """The episode ends (not failed) before a turn that could exceed this many tokens
    (the model's context)."""
    model_path: str | None = None
    """The model's checkpoint directory: its tokenizer and chat template render the turns.
    None (or a directory without a tokenizer): the built-in word tokenizer."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template (e.g. ``{"enable_thinking": false}``)."""
    task_modules: list[str] = Field(default_factory=list)
    """Modules (dotted names or ``.py`` paths) imported at start-up so their
    ``@register_task`` environments exist in the actor's process (the built-in tasks are
    always there)."""
    env_threads: int = Field(16, ge=1)
    """Worker threads per task for plain environment methods. A call stuck past its
    timeout keeps its thread until it returns; once all are stuck, further calls of that
    task fail at their timeout (other tasks are unaffected)."""
    loop_stall_s: float = Field(1.0, gt=0.0)
    """An event-loop step longer than this is reported, naming the async environment
    call that blocked the loop."""


class EnvActor(Actor):
    """Runs episodes of registered tasks against sampler actors.

    Endpoints never raise for environment or sampler trouble: errors and timeouts
    come back as ``failed=True`` trajectories with the error text and reward 0, and
    the actor keeps serving. Cancelling a ``run_episode`` call (the caller's cancel
    scope) abandons its generate call and its environment. Plain environment methods run
    in bounded per-task threads (stuck calls are counted in ``stats``); a watchdog names
    an async environment that blocks the event loop (on stderr, rate-limited, and in
    ``stats``).
    """

    def __init__(self, config: EnvConfig | None = None) -> None:
        self.config = config if config is not None else EnvConfig()
        import_task_modules(self.config.task_modules)
        self.chat = load_chat_format(self.config.model_path, self.config.chat_template_kwargs)
        self.limits = EpisodeLimits(self.config.step_timeout_s, self.config.generate_timeout_s,
                                    self.config.max_seq_len)
        self.threads = EnvThreads(self.config.env_threads)
        self.watchdog = LoopWatchdog(lambda line: print(line, file=sys.stderr, flush=True),
                                     threshold_s=self.config.loop_stall_s)
        self.calls = EnvCalls(self.threads, self.watchdog)
        self.episodes = 0
        self.failed = 0
        self.running = 0

    async def on_start(self, nursery: trio.Nursery) -> None:
        """Start the event-loop watchdog (it stops with the actor)."""
        await nursery.start(self.watchdog.run)

    @endpoint
    async def run_episode(self, sampler: ActorRef | Mesh, task: TaskSpec,
                          sampling: SamplingParams, min_version: int = 0) -> Trajectory:
        """Play ``task`` with ``sampler`` (one actor: ``call_one``; a mesh: ``choose``).

        Every generate request carries ``min_version``, so a sampler whose weights
        lag does not start it until it has caught up.
        """
        if isinstance(sampler, Mesh):
            async def generate(req: GenerateRequest) -> GenerateResult:
                return await sampler.generate.choose(req)
        else:
            async def generate(req: GenerateRequest) -> GenerateResult:
                return await sampler.generate.call_one(req)

        self.running += 1
        try:
            traj = await play_episode(
                generate, GenerateRequest, task, sampling, min_version,
                chat=self.chat, limits=self.limits,
                request_prefix=f"{task.prompt_id}/{uuid.uuid4().hex[:12]}", span=span, calls=self.calls)
        finally:
            self.running -= 1
        self.episodes += 1
        self.failed += traj.failed
        return traj

    @endpoint
    def tasks(self) -> list[str]:
        """Names of the tasks this actor can play."""
        return registered_tasks()

    @endpoint
    def stats(self) -> dict[str, Any]:
        """Episodes finished, failed and running now; environment calls stuck in their
        threads now (per task) and ever; event-loop stalls (count, longest, last culprit)."""
        return {"episodes": self.episodes, "failed": self.failed, "running": self.running,
                "stuck_calls": self.threads.stuck(), "stuck_calls_total": self.threads.stuck_total(),
                "env_threads": self.threads.per_task, "loop_stalls": self.watchdog.stalls,
                "loop_stall_longest_s": round(self.watchdog.longest_s, 3),
                "loop_stall_last": self.watchdog.last_blocker}
