"""Harness episodes: an unmodified agent, pointed at a gateway session, is the environment.

``HarnessConfig`` says how to run the harness of one episode:

* ``command`` -- a subprocess per episode (``python my_agent.py {task}``; ``{task}``
  becomes the task as JSON, one shell word: the task's params -- a dataset row --
  plus ``seed`` and ``prompt_id`` unless the params have those keys). It gets
  ``OPENAI_BASE_URL`` (the session's base URL, ending in ``/v1``) and
  ``OPENAI_API_KEY`` (the session's key) in its environment, ``ANTHROPIC_BASE_URL``
  (the same URL without ``/v1``: Anthropic's clients append ``/v1/messages``) and
  ``ANTHROPIC_API_KEY`` (the key), plus ``FLOTILLA_TASK`` (the same JSON).
* ``entrypoint`` -- ``"module:function"`` (or ``"path/file.py:function"``), an
  ``async def f(base_url, task)`` given the same task dict, run in the environment
  actor's own trio loop (no process start-up per episode).

The reward comes from, in order: a ``grader`` (``"module:function"`` called with the
transcript -- the last request's messages plus the reply -- and the task, plain or
async), a ``POST /reward`` on the session, the last ``{"reward": x}`` JSON line on the
harness's stdout, or the entrypoint's return value (a number or ``{"reward": x}``).

Errors: a harness that times out (killed, with its process group), crashes, exits
non-zero or reports no reward ends the episode as a failed trajectory whose error
holds the reason and the tail of its stderr (or traceback); the controller retries
the prompt.  Cancellation kills the subprocess and propagates.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio
from pydantic import BaseModel, ConfigDict, Field, model_validator

from actors.gateway._gateway import Gateway
from actors.gateway._session import SessionLimits
from actors.sampler import GenerateRequest, GenerateResult
from actors.types import TaskSpec, Trajectory

__all__ = ["HarnessConfig", "play_harness_episode", "resolve"]

log = logging.getLogger(__name__)

_TAIL = 2000


class HarnessConfig(BaseModel):
    """How an environment actor runs the harness of each episode (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    command: str | None = None
    """Shell-style command run once per episode; ``{task}`` is replaced by the task's JSON."""
    entrypoint: str | None = None
    """``module:function``: ``async def f(base_url: str, task: dict)`` run in-process."""
    grader: str | None = None
    """``module:function`` given (transcript, task) returning the reward; wins over the others."""
    timeout_s: float = Field(120.0, gt=0)
    """An episode's harness running longer is killed and the episode fails."""
    max_new_tokens: int = Field(256, ge=1)
    """Cap on a turn's generation (a request's max_tokens may lower it)."""
    honor_sampling: bool = False
    """Use requests' temperature/top_p instead of the recipe's. Off for training: the
    recipe's importance ratios need the sampler's q at the trainer's temperature."""
    cwd: str | None = None
    """Working directory of the command (default: the actor's)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables of the command."""

    @model_validator(mode="after")
    def _one_kind(self) -> HarnessConfig:
        if (self.command is None) == (self.entrypoint is None):
            raise ValueError("a harness needs exactly one of command or entrypoint")
        for name in ("entrypoint", "grader"):
            v = getattr(self, name)
            if v is not None and (v.count(":") != 1 or not all(v.split(":"))):
                raise ValueError(f"{name} {v!r} must look like 'module:function'")
        if self.command is not None and not shlex.split(self.command):
            raise ValueError("command is empty")
        return self


def resolve(spec: str) -> Callable[..., Any]:
    """The function named by ``module:function`` or ``path/to/file.py:function`` (imported
    now; a file is loaded once per process under a name derived from its path).  Raises
    ValueError naming the spec when the function is not there."""
    module, _, name = spec.partition(":")
    if module.endswith(".py"):
        path = Path(module).resolve()
        key = "flotilla_harness_" + "_".join(path.with_suffix("").parts[-3:]).replace("-", "_")
        mod = sys.modules.get(key)
        if mod is None:
            loader = importlib.util.spec_from_file_location(key, path)
            if loader is None or loader.loader is None or not path.is_file():
                raise ValueError(f"{spec!r}: no Python file {path}")
            mod = importlib.util.module_from_spec(loader)
            sys.modules[key] = mod
            loader.loader.exec_module(mod)
    else:
        mod = importlib.import_module(module)
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"{spec!r}: module {module!r} has no function {name!r}")
    return fn


class HarnessFailed(Exception):
    """The harness did not produce a reward (message: why, plus its stderr tail)."""


def task_dict(task: TaskSpec) -> dict[str, Any]:
    """What a harness is given: the params, plus ``seed`` and ``prompt_id`` (params win)."""
    return {"seed": task.seed, "prompt_id": task.prompt_id, **task.params}


def _tail(data: bytes | bytearray | str, lines: int = 6) -> str:
    """The last few non-empty lines of a harness's output, as text (at most `_TAIL` characters)."""
    text = bytes(data).decode(errors="replace") if isinstance(data, (bytes, bytearray)) else data
    kept = [line.rstrip() for line in text[-16 * _TAIL :].splitlines() if line.strip()][-lines:]
    return "\n".join(kept)[-_TAIL:]


def _reward_line(stdout: str) -> float | None:
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{") and '"reward"' in line:
            try:
                return float(json.loads(line)["reward"])
            except (ValueError, KeyError, TypeError):
                continue
    return None


async def _run_command(cfg: HarnessConfig, task: TaskSpec, base_url: str, key: str) -> float | None:
    task_json = json.dumps(task_dict(task), sort_keys=True)
    argv = [a.replace("{task}", task_json) for a in shlex.split(cfg.command or "")]
    env = {
        **os.environ,
        **cfg.env,
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": key,
        "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": key,
        "FLOTILLA_TASK": task_json,
    }
    out, err = bytearray(), bytearray()
    # Its own session: a timeout kills the harness's whole process group (an agent's tools).
    proc = await trio.lowlevel.open_process(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=cfg.cwd,
        start_new_session=True,
    )

    async def pump(stream: Any, buf: bytearray) -> None:
        async for chunk in stream:
            buf += chunk
            if len(buf) > 1 << 20:  # keep the last MiB: the reward line is near the end
                del buf[: len(buf) - (1 << 20)]

    def kill() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, proc.stdout, out)
            nursery.start_soon(pump, proc.stderr, err)
            with trio.move_on_after(cfg.timeout_s) as cs:
                await proc.wait()
            if cs.cancelled_caught:
                kill()
                await proc.wait()
    finally:
        if proc.returncode is None:
            kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
    if cs.cancelled_caught:
        raise HarnessFailed(f"harness timed out after {cfg.timeout_s:g} s; stderr tail: {_tail(err)}")
    if proc.returncode != 0:
        raise HarnessFailed(f"harness exited with code {proc.returncode}; stderr tail: {_tail(err)}")
    return _reward_line(out.decode(errors="replace"))


async def _run_entrypoint(cfg: HarnessConfig, task: TaskSpec, base_url: str) -> float | None:
    fn = resolve(cfg.entrypoint or "")
    with trio.move_on_after(cfg.timeout_s) as cs:
        try:
            out = fn(base_url, task_dict(task))
            if inspect.isawaitable(out):
                out = await out
        except Exception:
            raise HarnessFailed(f"harness raised; traceback tail: {_tail(traceback.format_exc())}") from None
    if cs.cancelled_caught:
        raise HarnessFailed(f"harness timed out after {cfg.timeout_s:g} s")
    if isinstance(out, dict) and "reward" in out:
        out = out["reward"]
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        return float(out)
    return None


async def _grade(spec: str, transcript: list[dict[str, Any]], task: TaskSpec) -> float:
    out = resolve(spec)(transcript, task_dict(task))
    if inspect.isawaitable(out):
        out = await out
    return float(out)


async def play_harness_episode(
    gateway: Gateway,
    cfg: HarnessConfig,
    task: TaskSpec,
    generate: Callable[[GenerateRequest], Awaitable[GenerateResult]],
    limits: SessionLimits,
    min_version: int,
    end_session: Callable[[str], Awaitable[Any]],
) -> tuple[Trajectory, dict[str, int]]:
    """Run one harness episode against a new gateway session; (trajectory, segment stats).

    See the module docstring for rewards and failures. The session is closed and the
    sampler's cached prefix freed however the episode ends.
    """
    session = gateway.open_session(task, generate, limits, min_version)
    base_url = f"{gateway.address}/s/{session.id}/v1"
    try:
        try:
            if cfg.command is not None:
                reward = await _run_command(cfg, task, base_url, session.id)
            else:
                reward = await _run_entrypoint(cfg, task, base_url)
            if cfg.grader is not None:
                try:
                    reward = await _grade(cfg.grader, session.transcript, task)
                except Exception:
                    raise HarnessFailed(
                        f"grader {cfg.grader} raised; traceback tail: {_tail(traceback.format_exc())}"
                    ) from None
            elif session.reward is not None:
                reward = session.reward
            if reward is None:
                raise HarnessFailed(
                    "the harness reported no reward (print a {\"reward\": x} line, "
                    "POST /reward, return it, or configure a grader)"
                )
            if not session.generated_tokens:
                raise HarnessFailed("the harness never called the model")
            traj = session.trajectory(reward)
        except HarnessFailed as e:
            traj = session.trajectory(0.0, failed=True, error=str(e))
            traj.sampler_lost = session.sampler_lost
        return traj, session.segment_stats()
    finally:
        gateway.close_session(session)
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            try:
                await end_session(session.id)
            except Exception:  # freeing a cache is best effort; eviction frees it anyway
                log.debug("gateway: freeing session %s's sampler cache failed", session.id, exc_info=True)
