"""``[task] kind = "verifiers"``: a verifiers environment, its rollout run against the gateway.

A verifiers environment (``vf.SingleTurnEnv``, ``vf.MultiTurnEnv``, ``vf.ToolEnv``, ...)
owns its rollout loop: it formats the dataset row into messages, calls the model through an
OpenAI-compatible client, adds its own environment turns, and its rubric scores the result.
Flotilla does not re-implement that loop: each episode opens a gateway session
(``actors.gateway``) and runs the environment's own ``rollout`` with an
``AsyncOpenAI`` client pointed at the session's base URL, exactly as a harness episode
does. The gateway records every token the sampler saw and generated (turns seen before are
never re-tokenised; a rewritten history starts a segment), so the trajectory is exact
whatever the environment does with its messages; the reward is the rubric's
(``rubric.score_rollout``).

``name`` is an installed environment id (``vf.load_environment(name, **params)`` imports
the module ``name`` with ``-`` as ``_``, as verifiers does) or ``"module:function"`` /
``"path/to/env.py:function"`` returning the environment. Prompt ``i`` plays row
``task.seed % len(dataset)`` of the environment's dataset (``get_dataset()``; its
eval dataset when it has no training one).

verifiers runs on asyncio and Flotilla's actors on trio: the rollouts of one actor run as
tasks of one asyncio loop in a thread of its own (``AsyncioLoop``, started and stopped with
the actor), talking to the gateway over HTTP like any client. Cancelling an episode (or its
timeout) cancels its asyncio task; closing the session fails any request still on its way.

A verifiers ``Environment`` installs SIGINT/SIGTERM handlers when it is built, which would
take the actor's own: environments are built in the actor's main thread, once per
(name, params) and process, with the previous handlers put back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import signal
import threading
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from actors.sampler import GenerateRequest, GenerateResult
from actors.types import TaskSpec, Trajectory

__all__ = ["AsyncioLoop", "check_environment", "load_environment", "play_verifiers_episode"]

log = logging.getLogger(__name__)

_TAIL = 2000
_LOADED: dict[str, Any] = {}
"""Environments built in this process, by (name, params): building one is expensive and
registers process-wide hooks, so each is built once."""


def load_environment(name: str, params: dict[str, Any]) -> Any:
    """The verifiers environment ``name`` (an id or ``module:function``) with ``params``,
    built once per process (call from the main thread: see the module docstring)."""
    import verifiers as vf

    key = json.dumps([name, params], sort_keys=True, default=str)
    if key in _LOADED:
        return _LOADED[key]
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if ":" in name:
            from actors.env._modules import resolve_callable

            env = resolve_callable(name)(**params)
        else:
            env = vf.load_environment(name, **params)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if not isinstance(env, vf.Environment):
        raise TypeError(f"verifiers environment {name!r}: got {type(env).__name__}, not a verifiers Environment")
    _LOADED[key] = env
    return env


class AsyncioLoop:
    """An asyncio event loop in its own thread, for the lifetime of ``serve`` (a trio task).

    ``run(coro_fn)`` runs ``coro_fn()`` on it and waits from trio; cancelling the waiter
    cancels the asyncio task. Leaving ``serve`` (cancellation) stops the loop and joins its
    thread, cancelling what still runs there.
    """

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="flotilla-asyncio", daemon=True)
        thread.start()
        self.loop = loop
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            self.loop = None

            async def drain() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            with trio.CancelScope(shield=True):
                try:
                    await trio.to_thread.run_sync(lambda: asyncio.run_coroutine_threadsafe(drain(), loop).result(10))
                except Exception:
                    log.debug("verifiers: cancelling the asyncio loop's tasks failed", exc_info=True)
                loop.call_soon_threadsafe(loop.stop)
                await trio.to_thread.run_sync(thread.join)
                loop.close()

    async def run(self, coro_fn: Callable[[], Awaitable[Any]]) -> Any:
        if self.loop is None:
            raise RuntimeError("the asyncio loop is not running")
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        fut: concurrent.futures.Future = asyncio.run_coroutine_threadsafe(coro_fn(), self.loop)
        fut.add_done_callback(lambda _: token.run_sync_soon(done.set))
        try:
            await done.wait()
        except BaseException:
            fut.cancel()
            raise
        return fut.result()


def _dataset(env: Any) -> Any:
    env.build_dataset()
    ds = env.dataset if env.dataset is not None else env.get_eval_dataset()
    if ds is None or len(ds) == 0:
        raise ValueError("the environment has no dataset rows to play")
    return ds


def check_environment(name: str, params: dict[str, Any]) -> None:
    """Raise LibraryMissing without verifiers, else whatever loading ``name`` raises; the
    environment must have dataset rows."""
    from actors.env.libs import require

    require("verifiers")
    _dataset(load_environment(name, params))


async def _rollout(env: Any, seed: int, base_url: str, key: str, max_tokens: int) -> float:
    import verifiers as vf
    from openai import AsyncOpenAI

    ds = _dataset(env)
    row = ds[seed % len(ds)]
    client = vf.OpenAIChatCompletionsClient(AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0))
    try:
        sampling = {k: v for k, v in (env.sampling_args or {}).items() if k not in ("n", "extra_body")}
        sampling.setdefault("max_tokens", max_tokens)
        state = await env.rollout(row, client, "flotilla", sampling)
        if state.get("error") is not None:
            raise RuntimeError(f"the verifiers rollout ended with an error: {state['error']!r}")
        await env.rubric.score_rollout(state)
    finally:
        await client.close()
    reward = state.get("reward")
    if reward is None:
        raise RuntimeError("the environment's rubric gave no reward")
    return float(reward)


class _Failed(Exception):
    pass


async def play_verifiers_episode(
    gateway: Any,
    loop: AsyncioLoop,
    name: str,
    task: TaskSpec,
    generate: Callable[[GenerateRequest], Awaitable[GenerateResult]],
    limits: Any,
    min_version: int,
    end_session: Callable[[str], Awaitable[Any]],
    *,
    timeout_s: float,
    max_new_tokens: int,
) -> tuple[Trajectory, dict[str, int]]:
    """One episode of verifiers environment ``name`` on a new gateway session; (trajectory,
    segment stats). A rollout error, a rubric failure, a timeout or a rollout that never
    called the model ends the episode as failed (reward 0, the error and traceback tail).
    The session is closed and the sampler's cached prefix freed however it ends."""
    session = gateway.open_session(task, generate, limits, min_version)
    base_url = f"{gateway.address}/s/{session.id}/v1"
    try:
        try:
            with trio.move_on_after(timeout_s) as cs:
                try:
                    env = load_environment(name, dict(task.params))
                    reward = await loop.run(lambda: _rollout(env, task.seed, base_url, session.id, max_new_tokens))
                except Exception as e:
                    tail = "".join(traceback.format_exception(e))[-_TAIL:]
                    raise _Failed(f"{type(e).__name__}: {e}; traceback tail: {tail}") from None
            if cs.cancelled_caught:
                raise _Failed(f"verifiers rollout timed out after {timeout_s:g} s")
            if not session.generated_tokens:
                raise _Failed("the verifiers rollout never called the model")
            traj = session.trajectory(reward)
        except _Failed as e:
            traj = session.trajectory(0.0, failed=True, error=str(e))
        return traj, session.segment_stats()
    finally:
        gateway.close_session(session)
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            try:
                await end_session(session.id)
            except Exception:
                log.debug("verifiers: freeing session %s's sampler cache failed", session.id, exc_info=True)
