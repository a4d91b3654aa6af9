"""``EnvActor``: plays episodes against a sampler it calls directly.

The controller hands the actor a sampler handle (one actor, or a mesh to let the
runtime choose the least-loaded sampler per turn), a task and sampling params; the
actor builds the prompt, alternates generate calls and environment steps, and
returns the trajectory (with `hold`, keeps it and returns its `TrajectoryRef`: the trainer
fetches it, `actors.held`). Many episodes run concurrently on one actor (one trio
task per call); environments are fresh instances per episode.
"""

from __future__ import annotations

import random
import sys
import uuid
from typing import Any

import trio
from pydantic import BaseModel, ConfigDict, Field

from actors.chat import load_chat_format
from actors.env._episode import EnvCalls, EpisodeLimits, play_episode
from actors.env._interface import registered_tasks
from actors.env._modules import import_task_modules
from actors.env._threads import EnvThreads
from actors.env._watchdog import LoopWatchdog
from actors.held import HeldBatch, TrajectoryStore
from actors.sampler import GenerateRequest, GenerateResult
from actors.types import SamplingParams, TaskSpec, Trajectory, TrajectoryRef
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
    harness: Any = None
    """``actors.gateway.HarnessConfig``: every episode runs this harness against the actor's
    OpenAI-compatible gateway instead of a registered environment (None: no gateway); the
    gateway renders with ``model_path``'s chat template."""
    gateway: bool = False
    """Serve the gateway without a harness: ``verifiers:<env>`` tasks (``actors.env.libs``)
    run their environment's own rollout against a session of it."""
    max_held: int = Field(65_536, ge=1)
    """Finished trajectories the actor holds for the trainer (``run_episode(hold=True)``)
    at most; past it the oldest is evicted (counted in ``stats``; its fetch finds it
    missing and the controller replays the rollout)."""


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
        self.limits = EpisodeLimits(self.config.step_timeout_s, self.config.generate_timeout_s, self.config.max_seq_len)
        self.threads = EnvThreads(self.config.env_threads)
        self.watchdog = LoopWatchdog(
            lambda line: print(line, file=sys.stderr, flush=True), threshold_s=self.config.loop_stall_s
        )
        self.calls = EnvCalls(self.threads, self.watchdog)
        self.episodes = 0
        self.failed = 0
        self.running = 0
        self.held = TrajectoryStore(self.config.max_held)
        self.gateway: Any = None
        self.asyncio_loop: Any = None
        if self.config.harness is not None:
            from actors.gateway import HarnessConfig

            self.config.harness = HarnessConfig.model_validate(self.config.harness)

    async def on_start(self, nursery: trio.Nursery) -> None:
        """Start the event-loop watchdog; with a harness or ``gateway`` the gateway, and with
        ``gateway`` the asyncio loop verifiers rollouts run on (all stop with the actor)."""
        await nursery.start(self.watchdog.run)
        if self.config.harness is not None or self.config.gateway:
            from actors.gateway import Gateway

            self.gateway = Gateway(self.chat)
            await nursery.start(self.gateway.serve)
        if self.config.gateway:  # verifiers rollouts run on asyncio
            from actors.env.libs._verifiers import AsyncioLoop

            self.asyncio_loop = AsyncioLoop()
            await nursery.start(self.asyncio_loop.serve)

    @endpoint
    async def run_episode(
        self,
        sampler: ActorRef | Mesh,
        task: TaskSpec,
        sampling: SamplingParams,
        min_version: int = 0,
        hold: bool = False,
    ) -> Trajectory | TrajectoryRef:
        """Play ``task`` with ``sampler`` (one actor: ``call_one``; a mesh: ``choose``).

        Every generate request carries ``min_version``, so a sampler whose weights
        lag does not start it until it has caught up. ``hold``: keep the trajectory here
        and answer its ``TrajectoryRef`` (the trainer fetches it with ``fetch_held``).
        """
        if isinstance(sampler, Mesh):

            async def generate(req: GenerateRequest) -> GenerateResult:
                return await sampler.generate.choose(req)
        else:

            async def generate(req: GenerateRequest) -> GenerateResult:
                return await sampler.generate.call_one(req)

        self.running += 1
        try:
            if self.config.harness is not None:
                traj = await self._harness_episode(sampler, generate, task, sampling, min_version)
            elif task.task.startswith("verifiers:"):
                traj = await self._verifiers_episode(sampler, task, sampling, min_version)
            else:
                traj = await play_episode(
                    generate,
                    GenerateRequest,
                    task,
                    sampling,
                    min_version,
                    chat=self.chat,
                    limits=self.limits,
                    request_prefix=f"{task.prompt_id}/{uuid.uuid4().hex[:12]}",
                    span=span,
                    calls=self.calls,
                )
        finally:
            self.running -= 1
        self.episodes += 1
        self.failed += traj.failed
        return self.held.put(traj) if hold else traj

    @endpoint
    def fetch_held(self, keys: list[str]) -> HeldBatch:
        """The held trajectories of ``keys``, packed (``HeldBatch``: ``found`` is False for a
        key not held); they stay held."""
        return HeldBatch.pack(self.held.get(keys))

    @endpoint
    def release_held(self, keys: list[str]) -> int:
        """Forget the held trajectories of ``keys`` (trained or dropped); how many were held."""
        return self.held.release(keys)

    async def _harness_episode(
        self, sampler: ActorRef | Mesh, generate: Any, task: TaskSpec, sampling: SamplingParams, min_version: int
    ) -> Trajectory:
        """One episode of the configured harness against a new gateway session.  A mesh
        handle is pinned to one rank for the whole episode (its prefix cache lives there)."""
        from actors.gateway import SessionLimits, play_harness_episode

        ref = sampler[random.randrange(len(sampler))] if isinstance(sampler, Mesh) else sampler

        async def gen(req: GenerateRequest) -> GenerateResult:
            return await ref.generate.call_one(req)

        async def end(session_id: str) -> Any:
            return await ref.end_session.call_one(session_id)

        cfg = self.config.harness
        limits = SessionLimits(sampling, self.config.max_seq_len, cfg.max_new_tokens, cfg.honor_sampling)
        with span("rollout", task=task.task, prompt_id=task.prompt_id, group_id=task.group_id, kind="harness") as sp:
            traj, stats = await play_harness_episode(self.gateway, cfg, task, gen, limits, min_version, end)
            for k, v in {
                "pool": traj.pool,
                "turn": traj.turns,
                "reward": traj.reward,
                "failed": traj.failed,
                "tokens": int(traj.tokens.numel()),
                "generated": traj.num_generated,
                **stats,
            }.items():
                sp.set_attribute(k, v)
        return traj

    async def _verifiers_episode(
        self, sampler: ActorRef | Mesh, task: TaskSpec, sampling: SamplingParams, min_version: int
    ) -> Trajectory:
        """One rollout of a verifiers environment against a new gateway session, on one
        sampler rank (as a harness episode)."""
        from actors.env.libs._verifiers import play_verifiers_episode
        from actors.gateway import SessionLimits

        if self.gateway is None:
            raise RuntimeError("verifiers tasks need EnvConfig(gateway=True)")
        ref = sampler[random.randrange(len(sampler))] if isinstance(sampler, Mesh) else sampler

        async def gen(req: GenerateRequest) -> GenerateResult:
            return await ref.generate.call_one(req)

        async def end(session_id: str) -> Any:
            return await ref.end_session.call_one(session_id)

        limits = SessionLimits(sampling, self.config.max_seq_len, sampling.max_new_tokens, False)
        with span("rollout", task=task.task, prompt_id=task.prompt_id, group_id=task.group_id, kind="verifiers") as sp:
            traj, stats = await play_verifiers_episode(
                self.gateway,
                self.asyncio_loop,
                task.task.partition(":")[2],
                task,
                gen,
                limits,
                min_version,
                end,
                timeout_s=self.config.step_timeout_s,
                max_new_tokens=sampling.max_new_tokens,
            )
            for k, v in {
                "pool": traj.pool,
                "turn": traj.turns,
                "reward": traj.reward,
                "failed": traj.failed,
                "tokens": int(traj.tokens.numel()),
                "generated": traj.num_generated,
                **stats,
            }.items():
                sp.set_attribute(k, v)
        return traj

    @endpoint
    def gateway_address(self) -> str | None:
        """``http://host:port`` of the actor's gateway (None without a harness)."""
        return self.gateway.address if self.gateway is not None else None

    @endpoint
    def tasks(self) -> list[str]:
        """Names of the tasks this actor can play."""
        return registered_tasks()

    @endpoint
    def stats(self) -> dict[str, Any]:
        """Episodes finished, failed and running now; environment calls stuck in their
        threads now (per task) and ever; event-loop stalls (count, longest, last culprit);
        with a gateway also its sessions, segments and the generated tokens of earlier
        segments (not trained on)."""
        out = {
            "episodes": self.episodes,
            "failed": self.failed,
            "running": self.running,
            "stuck_calls": self.threads.stuck(),
            "stuck_calls_total": self.threads.stuck_total(),
            "env_threads": self.threads.per_task,
            "loop_stalls": self.watchdog.stalls,
            "loop_stall_longest_s": round(self.watchdog.longest_s, 3),
            "loop_stall_last": self.watchdog.last_blocker,
            **self.held.stats(),
        }
        if self.gateway is not None:
            out.update(
                sessions=self.gateway.opened,
                segments=self.gateway.segments,
                dropped_generated=self.gateway.dropped_generated,
            )
        return out
