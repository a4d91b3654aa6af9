"""Actor processes: spawning, watching and stopping them (locally or through a host).

A child is ``python -m orchestrator.runtime._child``: it binds its ROUTER
socket, writes the bound address to an inherited pipe and waits for the
``init`` message carrying the constructor arguments (wire-encoded, never
pickled). The class path travels on the command line, chosen by the trusted
spawner. Children watch their spawner's pid and stop when it exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any, Protocol

import trio

from ._curve import Curve
from ._errors import ActorDied

__all__ = ["ActorProcess", "LocalProcess", "describe_exit", "spawn_local", "stop_all"]


def describe_exit(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with code {rc}"


class ActorProcess(Protocol):
    """What the mesh owner needs from a running actor process, local or remote."""

    address: str
    pid: int  # on its own host

    async def wait_exit(self) -> str:
        """Return (a description of how) the process ended; ActorDied if it cannot be watched."""
        ...

    def signal_stop(self) -> None: ...

    async def stop(self, grace: float) -> None:
        """Terminate (SIGTERM, then SIGKILL after ``grace`` s) and reap. Call shielded."""
        ...


class LocalProcess:
    def __init__(self, process: trio.Process, address: str = "") -> None:
        self.process = process
        self.address = address
        self.pid = process.pid
        self._signalled = False

    async def wait_exit(self) -> str:
        return describe_exit(await self.process.wait())

    def signal_stop(self) -> None:
        if self.process.returncode is None and not self._signalled:
            self._signalled = True
            try:
                self.process.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    async def stop(self, grace: float) -> None:
        self.signal_stop()
        with trio.move_on_after(grace):
            await self.process.wait()
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


def child_env(extra: dict[str, str] | None, curve: Curve | None) -> dict[str, str]:
    env = dict(os.environ)
    # Children import the actor class by name: give them the parent's import path.
    path = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    if curve is not None:
        env.update(curve.to_env())
    if extra:
        env.update(extra)
    return env


async def spawn_local(
    cls_path: str,
    *,
    name: str,
    rank: int,
    bind: str,
    env: dict[str, str],
    advertise: str | None = None,
    register: Any = None,
) -> LocalProcess:
    """Start a child serving ``cls_path`` on ``bind``; returns once it is listening.

    ``register(process)`` is called as soon as the OS process exists, so a
    cancelled start-up still leaves the caller able to stop it. Raises
    ActorDied if the child exits before listening.
    """
    read_fd, write_fd = os.pipe()
    cmd = [
        sys.executable,
        "-m",
        "orchestrator.runtime._child",
        "--cls",
        cls_path,
        "--bind",
        bind,
        "--name",
        name,
        "--rank",
        str(rank),
        "--ready-fd",
        str(write_fd),
        "--parent-pid",
        str(os.getpid()),
    ]
    if advertise:
        cmd += ["--advertise", advertise]
    try:
        process = await trio.lowlevel.open_process(cmd, env=env, pass_fds=(write_fd,), stdin=subprocess.DEVNULL)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    proc = LocalProcess(process)
    if register is not None:
        register(proc)
    data = b""
    async with trio.lowlevel.FdStream(read_fd) as stream:
        while not data.endswith(b"\n"):
            chunk = await stream.receive_some(4096)
            if not chunk:
                break
            data += chunk
    if not data.endswith(b"\n"):
        rc = await process.wait()
        raise ActorDied(name, rank, f"{describe_exit(rc)} during start-up")
    proc.address = data.decode().strip()
    return proc


async def stop_all(procs: list[Any], grace: float) -> None:
    """Stop every process concurrently: SIGTERM all, then SIGKILL what outlives ``grace``."""
    for p in procs:
        p.signal_stop()
    async with trio.open_nursery() as nursery:
        for p in procs:
            nursery.start_soon(p.stop, grace)
