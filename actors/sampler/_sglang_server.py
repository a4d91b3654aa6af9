"""Launching one SGLang server for one sampler rank, and waiting for it to be healthy.

``serve_sglang`` is a trio task for the sampler backend's nursery: it starts
``python -m sglang.launch_server --model-path ... --host 127.0.0.1 --port P`` with
``CUDA_VISIBLE_DEVICES`` set to the rank's GPU, in its own process group, polls
``GET /health`` until the server answers 200, reports ``task_status.started()``, and
then watches it.

Lifetime (no orphans): the server lives exactly as long as the task. Cancellation (the
sampler stopping, the run ending) sends SIGTERM to the server's whole process group
(SGLang starts scheduler and detokenizer children), waits ``grace`` seconds, then
SIGKILLs the group and reaps the server. The sampler process itself stops when the
controller does (the runtime's parent watch), so a killed controller takes its servers
down too.

Errors: a server that exits before it is healthy, or is not healthy within
``health_timeout_s``, raises ``RuntimeError`` with its exit status and the last lines of
its output; a server that exits later raises the same, which fails the sampler (the
controller sees ``ActorDied`` for that rank).

Never run here: this machine has no GPU and no sglang. The tests launch a protocol stub
through the same code (``module`` pointing at it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import deque
from typing import Any

import httpx
import trio

from orchestrator.runtime import clip

__all__ = ["serve_sglang", "server_command", "wait_healthy"]


def server_command(launch: dict[str, Any], port: int) -> list[str]:
    """The command line of one server (launch: ``hardware.SGLangLaunch`` as a dict)."""
    python = launch.get("python") or sys.executable
    return [
        python,
        "-m",
        launch.get("module", "sglang.launch_server"),
        "--model-path",
        launch["model_path"],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *launch.get("args", []),
    ]


async def wait_healthy(client: httpx.AsyncClient, url: str, timeout_s: float, alive: Any = None) -> None:
    """Poll ``GET {url}/health`` until it answers 200.

    ``alive()`` (optional) returns False once the server process has exited, which ends the
    wait early. Raises RuntimeError naming the URL and the last error.
    """
    last = "no answer yet"
    with trio.move_on_after(timeout_s):
        while alive is None or alive():
            try:
                r = await client.get(f"{url}/health", timeout=5.0)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            await trio.sleep(0.25)
        raise RuntimeError(f"SGLang server {url} exited before it was healthy ({last})")
    raise RuntimeError(f"SGLang server {url} not healthy within {timeout_s:g} s ({last})")


async def _tail(stream: Any, lines: deque[str]) -> None:
    buf = b""
    async for chunk in stream:
        buf += chunk
        *done, buf = buf.split(b"\n")
        for line in done:
            lines.append(line.decode(errors="replace"))
            print(f"[sglang] {clip(lines[-1], 1000)}", file=sys.stderr, flush=True)


async def serve_sglang(
    launch: dict[str, Any],
    port: int,
    gpu: int | None,
    client: httpx.AsyncClient,
    *,
    grace: float = 10.0,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one server until cancelled; ``started(url)`` once it answers /health."""
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    url = f"http://127.0.0.1:{port}"
    lines: deque[str] = deque(maxlen=20)
    proc = await trio.lowlevel.open_process(
        server_command(launch, port),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    error: RuntimeError | None = None
    try:
        async with trio.open_nursery() as nursery:
            assert proc.stdout is not None
            nursery.start_soon(_tail, proc.stdout, lines)
            try:
                await wait_healthy(
                    client, url, float(launch.get("health_timeout_s", 900.0)), alive=lambda: proc.poll() is None
                )
            except RuntimeError as exc:
                error = RuntimeError(
                    f"{exc}; command {' '.join(server_command(launch, port))}; "
                    f"last output: {' | '.join(lines) or '(none)'}"
                )
            else:
                task_status.started(url)
                rc = await proc.wait()
                error = RuntimeError(
                    f"SGLang server {url} exited with code {rc}; last output: {' | '.join(lines) or '(none)'}"
                )
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await _stop_group(proc, grace)
    raise error  # raised outside the nursery: callers see the RuntimeError itself


async def _stop_group(proc: trio.Process, grace: float) -> None:
    """SIGTERM the server's process group, SIGKILL it after ``grace`` s, reap the server."""

    def kill(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    kill(signal.SIGTERM)
    with trio.move_on_after(grace):
        await proc.wait()
    kill(signal.SIGKILL)  # also the group's children, should the leader have gone first
    await proc.wait()
