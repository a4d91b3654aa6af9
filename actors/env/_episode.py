"""Playing one episode against a sampler: the token bookkeeping and the turn loop.

The running sequence is only ever appended to. Sampler-generated ids go in with
loss mask True together with their support rows and policy versions; everything
else (prompt, what closes a reply, observations) goes in with loss mask False.
Turns are rendered by the run's ``ChatFormat`` (``actors.chat``): the chat template
rendered with and without each new turn, so earlier ids are never re-tokenised.
The trajectory's ids are exactly what the sampler was conditioned on, and the
support record has one row per True in the mask. A template that rewrites earlier
turns starts a new segment (see ``play_episode``): the trajectory never holds a
context the sampler did not see.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import trio

from actors.chat import ChatFormat, ChatTemplateError, Conversation, Message
from actors.env._interface import Environment, StepOutcome, make_env, task_factory
from actors.env._threads import EnvThreads
from actors.env._watchdog import LoopWatchdog
from actors.types import SamplingParams, TaskSpec, Trajectory
from orchestrator.runtime import ActorDied

__all__ = ["EnvCalls", "EpisodeBuilder", "EpisodeLimits", "play_episode"]

log = logging.getLogger(__name__)


class EpisodeTimeout(Exception):
    """An environment call or a generate call ran past its limit."""


class EpisodeBuilder:
    """Accumulates one trajectory's tokens, loss mask, support rows and versions."""

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.ids: list[int] = [int(i) for i in prompt_ids]
        self.mask: list[bool] = [False] * len(self.ids)
        self._sup_ids: list[torch.Tensor] = []
        self._counts: list[int] = []
        self._logq: list[torch.Tensor] = []
        self._versions: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    def add_context(self, ids: Sequence[int]) -> None:
        """Append ids the model reads but did not generate (loss mask False)."""
        self.ids += [int(i) for i in ids]
        self.mask += [False] * len(ids)

    def add_generated(
        self,
        token_ids: Sequence[int],
        support_ids: torch.Tensor,
        support_offsets: torch.Tensor,
        support_logq: torch.Tensor,
        versions: Sequence[int],
    ) -> None:
        """Append sampler output (loss mask True) with its CSR support rows and versions.

        Raises ValueError naming the field when the sampler's record does not have
        one row and one version per generated token.
        """
        # Few torch calls: the gateway runs this once per turn with cold caches, where each
        # dispatcher call costs microseconds; the offsets are checked as Python ints.
        n = len(token_ids)
        off = support_offsets.tolist()
        if len(off) != n + 1 or len(versions) != n:
            raise ValueError(
                f"sampler result: {n} tokens but support_offsets has {len(off)} "
                f"entries (want {n + 1}) and versions {len(versions)} (want {n})"
            )
        nnz = support_ids.numel()
        if off[0] != 0 or off[-1] != nnz or support_logq.numel() != nnz:
            raise ValueError(
                f"sampler result: support_offsets [{off[0]}..{off[-1]}] do "
                f"not span support_ids ({nnz}) / support_logq ({support_logq.numel()})"
            )
        self.ids += [int(i) for i in token_ids]
        self.mask += [True] * n
        self._sup_ids.append(support_ids if support_ids.dtype == torch.int32 else support_ids.to(torch.int32))
        self._counts += [b - a for a, b in itertools.pairwise(off)]
        self._logq.append(support_logq if support_logq.dtype == torch.float32 else support_logq.float())
        self._versions += [int(v) for v in versions]

    def build(
        self,
        *,
        task: TaskSpec,
        pool: str,
        reward: float,
        turns: int,
        seconds: float,
        failed: bool = False,
        error: str | None = None,
        error_traceback: str | None = None,
    ) -> Trajectory:
        # One torch call per field (each costs microseconds on tensors this small).
        return Trajectory(
            task=task.task,
            prompt_id=task.prompt_id,
            group_id=task.group_id,
            pool=pool,
            tokens=torch.tensor(self.ids, dtype=torch.int64),
            loss_mask=torch.tensor(self.mask, dtype=torch.bool),
            support_ids=_joined(self._sup_ids, torch.int32),
            support_offsets=torch.tensor([0, *itertools.accumulate(self._counts)], dtype=torch.int32),
            support_logq=_joined(self._logq, torch.float32),
            versions=torch.tensor(self._versions, dtype=torch.int32),
            reward=0.0 if failed else reward,
            failed=failed,
            error=error,
            error_traceback=error_traceback,
            turns=turns,
            seconds=seconds,
        )


def _joined(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The turns' rows end to end (a one-turn episode's own tensor, not a copy)."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


@dataclass(frozen=True)
class EpisodeLimits:
    """Timeouts and length cap of an episode (from the EnvActor's config)."""

    step_timeout_s: float
    generate_timeout_s: float
    max_seq_len: int


TRACEBACK_TAIL = 2000
"""Characters of a failed episode's traceback kept on its trajectory (the end: the
frames nearest the error, usually the environment's own)."""


@dataclass(frozen=True)
class EnvCalls:
    """How an episode calls its environment: the actor's bounded threads for plain
    methods and its loop watchdog (None: unwatched) for async ones."""

    threads: EnvThreads
    watchdog: LoopWatchdog | None = None


async def _call_env(
    calls: EnvCalls,
    env: Environment | None,
    task: str,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float,
    what: str,
    blocking: bool = True,
) -> Any:
    """Run an environment method (plain or async) under ``timeout`` seconds.

    Plain methods run in one of the task's worker threads (EnvThreads: abandoned on
    timeout, counted as stuck while they still run), or with ``blocking=False``
    (``Environment.blocking``) on the loop; async ones on the loop. On the loop they are
    labelled for the watchdog. Raises EnvCallTimeout / EpisodeTimeout past the limit (a
    plain method on the loop cannot be timed out).
    """
    if not inspect.iscoroutinefunction(fn):
        if blocking:
            out = await calls.threads.run(task, fn, *args, timeout=timeout, what=what)
        else:
            with _label(calls, env, task, fn, what, "plain"):
                out = fn(*args)
        if not inspect.isawaitable(out):
            return out
        fn, args = (lambda: out), ()  # a plain method that returned an awaitable: await it on the loop
    label = _label(calls, env, task, fn, what, "async")
    with trio.move_on_after(timeout) as cs, label:
        return await fn(*args)
    assert cs.cancelled_caught
    raise EpisodeTimeout(f"environment {what} timed out after {timeout:g} s")


def _label(calls: EnvCalls, env: Environment | None, task: str, fn: Any, what: str, kind: str) -> Any:
    """The watchdog's name for an environment call running on the loop."""
    if calls.watchdog is None:
        return nullcontext()
    if env is None:
        return calls.watchdog.label(f"{kind} environment {what} (task {task!r})")
    return calls.watchdog.label(
        f"{kind} environment {type(env).__name__}.{getattr(fn, '__name__', what)} (task {task!r})"
    )


def _as_outcome(out: Any) -> StepOutcome:
    if isinstance(out, StepOutcome):
        return out
    if isinstance(out, tuple) and len(out) == 3:
        return StepOutcome(observation=out[0], reward=out[1], done=out[2])
    if isinstance(out, dict):
        return StepOutcome.model_validate(out)
    raise TypeError(f"step() must return StepOutcome (or (observation, reward, done)), got {type(out).__name__}")


async def play_episode(
    generate: Callable[[Any], Awaitable[Any]],
    make_request: Callable[..., Any],
    task: TaskSpec,
    sampling: SamplingParams,
    min_version: int,
    *,
    chat: ChatFormat,
    limits: EpisodeLimits,
    request_prefix: str,
    span: Callable[..., Any],
    calls: EnvCalls,
) -> Trajectory:
    """Play ``task`` to the end against ``generate`` and return its trajectory.

    ``generate(request)`` is the sampler call, ``make_request(**fields)`` builds its
    request. Each assistant turn: one generate call (limited to the environment's
    ``max_new_tokens`` or else ``sampling.max_new_tokens``), then one ``env.step``.
    The episode ends when the environment says done, after ``env.max_turns`` turns,
    or when the next turn would not fit in ``limits.max_seq_len`` tokens (a prompt
    that leaves no room for one turn is a failure).

    A chat template that cannot extend the conversation append-only (``ChatTemplateError``:
    e.g. Qwen3's drops earlier turns' reasoning once a new user turn comes) starts a new
    *segment*: the next turn is prompted with the template's rendering of the whole
    history, and the trajectory is the last segment (``Trajectory.segments`` counts them;
    the rollout span also carries the generated tokens of earlier segments, not trained
    on, as ``dropped_generated``).

    The environment's ``close()`` runs once the episode has ended, however it ended (but
    not when the caller cancels it); its failure is logged, the trajectory stands.

    Errors: an exception from the environment or the sampler, or a timeout, ends
    the episode as ``failed=True`` with the error text, the tail of its traceback
    and reward 0 (the tokens so far are kept for inspection). Cancellation of the
    caller propagates.
    """
    t0 = time.perf_counter()
    builder = EpisodeBuilder([])
    reward, turns, pool = 0.0, 0, ""
    segments, dropped = 1, 0  # segments played; generated tokens of the earlier ones
    env: Any = None
    blocking = True  # the environment's own say (Environment.blocking), once it is built
    with span("rollout", task=task.task, prompt_id=task.prompt_id, group_id=task.group_id) as sp:
        try:
            env = await _call_env(
                calls,
                None,
                task.task,
                make_env,
                task,
                timeout=limits.step_timeout_s,
                what="construction",
                blocking=getattr(task_factory(task.task), "blocking", True) is not False,
            )
            blocking = getattr(env, "blocking", True) is not False
            with span("env.step", task=task.task, turn=0, kind="reset"):
                obs = await _call_env(
                    calls,
                    env,
                    task.task,
                    env.reset,
                    task,
                    timeout=limits.step_timeout_s,
                    what="reset",
                    blocking=blocking,
                )
            convo = Conversation(chat, tools=env.tools)
            builder.add_context(convo.add(_messages(obs)))
            max_new = env.max_new_tokens or sampling.max_new_tokens
            if len(builder) + max_new > limits.max_seq_len:
                raise ValueError(
                    f"prompt of {len(builder)} tokens + max_new_tokens={max_new} "
                    f"exceeds max_seq_len={limits.max_seq_len}"
                )
            pending: list[int] = []  # the next turn's context, appended only if it is played
            restart = False  # pending is a new segment's whole context
            with_message = _takes_message(env)
            while turns < env.max_turns:
                if (0 if restart else len(builder)) + len(pending) + max_new > limits.max_seq_len:
                    break  # out of context: the episode ends unfinished (not a failure)
                if restart:
                    dropped += sum(builder.mask)
                    builder, restart, segments = EpisodeBuilder([]), False, segments + 1
                builder.add_context(pending)
                request = make_request(
                    request_id=f"{request_prefix}/{turns}",
                    prompt_ids=list(builder.ids),
                    max_new_tokens=max_new,
                    stop_token_ids=chat.stop_ids,
                    temperature=sampling.temperature,
                    top_k=sampling.top_k,
                    top_p=sampling.top_p,
                    min_keep=sampling.min_keep,
                    seed=None,
                    min_version=min_version,
                )
                with span("generate", task=task.task, pool=pool, turn=turns) as gsp:
                    with trio.move_on_after(limits.generate_timeout_s) as cs:
                        result = await generate(request)
                    if cs.cancelled_caught:
                        raise EpisodeTimeout(
                            f"generate timed out after {limits.generate_timeout_s:g} s at turn {turns}"
                        )
                    pool = result.pool
                    _set(gsp, pool=pool, tokens=len(result.token_ids))
                if result.finish_reason == "abort":
                    raise RuntimeError(f"sampler aborted generation at turn {turns}")
                builder.add_generated(
                    result.token_ids, result.support_ids, result.support_offsets, result.support_logq, result.versions
                )
                message = convo.add_reply(result.token_ids)
                turn, turns = turns, turns + 1
                args: tuple[Any, ...] = (chat.decode(result.token_ids), list(result.token_ids))
                if with_message:
                    args += (message,)
                with span("env.step", task=task.task, pool=pool, turn=turn, kind="step"):
                    outcome = _as_outcome(
                        await _call_env(
                            calls,
                            env,
                            task.task,
                            env.step,
                            *args,
                            timeout=limits.step_timeout_s,
                            what=f"step (turn {turn})",
                            blocking=blocking,
                        )
                    )
                reward += float(outcome.reward)
                if outcome.done:
                    break
                new = _messages(outcome.observation)
                try:
                    pending = convo.add(new)
                except ChatTemplateError:
                    # The template rewrites the history (e.g. drops earlier reasoning): the
                    # next turn is prompted with its rendering of the whole history, as a new
                    # segment; the trajectory is the last segment (nothing trains on a context
                    # the sampler did not see).
                    convo = Conversation.from_messages(chat, [*convo.messages, *new], env.tools)
                    pending, restart = list(convo.ids), True
            traj = builder.build(task=task, pool=pool, reward=reward, turns=turns, seconds=time.perf_counter() - t0)
        except Exception as exc:  # environment/sampler errors end the episode, not the actor
            error = f"{type(exc).__name__}: {exc}"
            tail = "".join(traceback.format_exception(exc))[-TRACEBACK_TAIL:]
            lost = isinstance(exc, ActorDied)
            traj = builder.build(
                task=task,
                pool=pool,
                reward=0.0,
                turns=turns,
                seconds=time.perf_counter() - t0,
                failed=True,
                error=error,
                error_traceback=tail,
            )
            traj.sampler_lost = lost
        if isinstance(env, Environment) and type(env).close is not Environment.close:
            try:
                await _call_env(
                    calls,
                    env,
                    task.task,
                    env.close,
                    timeout=limits.step_timeout_s,
                    what="close",
                    blocking=blocking,
                )
            except Exception as exc:
                log.warning("task %r: environment close failed: %s: %s", task.task, type(exc).__name__, exc)
        traj.segments = segments
        _set(
            sp,
            pool=traj.pool,
            turn=traj.turns,
            reward=traj.reward,
            failed=traj.failed,
            tokens=int(traj.tokens.numel()),
            generated=traj.num_generated,
            segments=segments,
            dropped_generated=dropped,
        )
        return traj


def _messages(obs: Any) -> list[Message]:
    """An observation as messages: text or ids are one user turn; a message dict or a
    list of them (e.g. ``tool`` results) are used as they are."""
    if isinstance(obs, str):
        return [{"role": "user", "content": obs}]
    if isinstance(obs, dict):
        return [obs]
    if isinstance(obs, list) and obs and all(isinstance(m, dict) for m in obs):
        return list(obs)
    if isinstance(obs, list) and all(isinstance(i, int) for i in obs):
        return [{"role": "user", "content": list(obs)}]
    raise TypeError(
        f"observation must be text, token ids, a message dict or a list of messages, got {type(obs).__name__}"
    )


_STEP_TAKES_MESSAGE: dict[Any, bool] = {}  # per class's step function: its signature, read once


def _takes_message(env: Environment) -> bool:
    """True when ``env.step`` has a third parameter for the parsed assistant message.

    A method's answer is kept per function (an episode builds a fresh env each time, and
    reading a signature costs more than a one-token episode's own step)."""
    step = env.step
    fn = getattr(step, "__func__", None)
    if fn is not None and getattr(step, "__self__", None) is env:
        known = _STEP_TAKES_MESSAGE.get(fn)
        if known is None:
            known = _STEP_TAKES_MESSAGE[fn] = _signature_takes_message(step)
        return known
    return _signature_takes_message(step)


def _signature_takes_message(step: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(step).parameters
    except (TypeError, ValueError):
        return False
    return len(params) >= 3 or "message" in params


def _set(sp: Any, **attrs: Any) -> None:
    """Set span attributes when the runtime's span object supports it."""
    for k, v in attrs.items():
        sp.set_attribute(k, v)
