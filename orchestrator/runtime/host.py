"""Actor host: lets a controller on another machine spawn actors here (tcp + CurveZMQ).

Run on each machine that should host actors::

    python -m orchestrator.runtime.host --bind tcp://0.0.0.0:5555 --keys ~/.flotilla/keys \\
        [--advertise this-host.example.com] [--allow actors.] [--trust-own-key]

On first start ``--keys DIR`` gets a keypair (``DIR/id.key`` public,
``DIR/id.key_secret`` secret). The host prints its address and public key;
the controller passes them as ``HostSpec(address=..., public_key=...)`` in
``open_mesh(..., hosts=[...], curve=...)``. Only clients whose public keys are
in ``DIR/allowed/*.key`` may connect (copy the controller's ``id.key`` there,
and every other host's key if actors on different hosts call each other).

An authenticated controller names the actor classes the host imports and
starts, but only from modules under the ``--allow`` prefixes (default: the
project's actor packages, ``actors.``); any other class is refused before
anything is imported. The host does not accept its own key as a client unless
started with ``--trust-own-key`` (a copy of the host's secret key must not be
enough to make it run code). The key directory is 0700 and the secret 0600
(see ``_curve``). Actors started here bind ``tcp://<bind ip>:*`` with the
host's keys and stop when the host process exits; the host stops them
when the controller stops its mesh or when the host receives SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

import trio

from ._actor import Actor, endpoint
from ._curve import TRUST_SELF_ENV, Curve, KeyFileError
from ._errors import ActorDied, ActorError
from ._proc import LocalProcess, child_env, describe_exit, spawn_local

__all__ = ["DEFAULT_ALLOW", "HOST_LEFT", "HostActor", "RemoteProcess", "allowed_class", "main"]

DEFAULT_ALLOW = ("actors.",)
"""Module prefixes a host spawns actor classes from when ``--allow`` is not given."""
ALLOW_ENV = "FLOTILLA_HOST_ALLOW"
HOST_LEFT = "its host left the run (SIGTERM)"
"""In the exit description of an actor its host stopped because the host is leaving."""
LEAVE_REPORT_S = 15.0
"""Longest a leaving host serves on, after stopping its actors, until their owners learn it."""
HOST_RETRY_S = 1.0
"""Seconds between the owner's pings of a host it lost touch with (see RemoteProcess)."""


def allowed_class(cls_path: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``module:QualName`` is well formed and its module is under one of the
    prefixes (``actors.`` matches ``actors.sampler``; ``actors`` matches ``actors`` and
    ``actors.sampler``, never ``actorsx``)."""
    module, sep, qual = cls_path.partition(":")
    if not sep or not all(p.isidentifier() for p in module.split(".") + qual.split(".")):
        return False
    for prefix in prefixes:
        if prefix.endswith(".") and module.startswith(prefix):
            return True
        if not prefix.endswith(".") and (module == prefix or module.startswith(prefix + ".")):
            return True
    return False


class HostActor(Actor):
    """Spawns, watches and stops actor processes on this machine for remote owners.

    Configured by the host entry point through ``FLOTILLA_HOST_BIND_IP`` and
    ``FLOTILLA_HOST_ADVERTISE``. Cancellation: a cancelled ``spawn`` stops the
    half-started process; ``on_stop`` stops every child.
    """

    def __init__(self) -> None:
        self.bind_ip = os.environ.get("FLOTILLA_HOST_BIND_IP", "127.0.0.1")
        self.advertise = os.environ.get("FLOTILLA_HOST_ADVERTISE") or None
        self.curve = Curve.from_env()
        allow = os.environ.get(ALLOW_ENV)
        self.allow = tuple(p for p in allow.split(",") if p) if allow is not None else DEFAULT_ALLOW
        self.children: dict[int, LocalProcess] = {}
        self.leaving = False  # SIGTERM: the host is leaving (see on_signal)
        self.reported: set[int] = set()  # children whose exit an owner was told while leaving
        self.replied = trio.Event()  # set (and replaced) as each such wait_exit call returns

    @endpoint
    async def spawn(self, cls_path: str, name: str, rank: int, env: dict[str, str]) -> list[Any]:
        """Start an actor process; returns ``[address, pid]`` once it listens.

        Raises PermissionError, before importing anything, for a class outside the
        host's allowlist of module prefixes."""
        if not allowed_class(cls_path, self.allow):
            raise PermissionError(
                f"host refuses to spawn {cls_path!r}: its module is not under the "
                f"allowed prefixes {list(self.allow)} (start the host with --allow PREFIX)"
            )
        started: list[LocalProcess] = []
        # Actors the host starts accept their own (the host's) key again, so they can call
        # each other; only the host itself refuses it.
        env = {**env, TRUST_SELF_ENV: "1"}
        try:
            proc = await spawn_local(
                cls_path,
                name=name,
                rank=rank,
                bind=f"tcp://{self.bind_ip}:*",
                env=child_env(env, self.curve),
                advertise=self.advertise,
                register=started.append,
            )
        except BaseException:
            with trio.CancelScope(shield=True):
                for p in started:
                    await p.stop(1.0)
            raise
        pid = proc.process.pid
        self.children[pid] = proc
        return [proc.address, pid]

    @endpoint
    async def wait_exit(self, pid: int) -> str:
        """Return how the child ``pid`` ended, once it has; with ``HOST_LEFT`` in it when the
        host stopped it because the host is leaving (SIGTERM)."""
        proc = self._child(pid)
        how = describe_exit(await proc.process.wait())
        if not self.leaving:
            return how
        self.reported.add(pid)
        self.replied.set()
        self.replied = trio.Event()
        return f"{how}; {HOST_LEFT}"

    @endpoint
    async def stop(self, pid: int, grace: float) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; reaps the child."""
        proc = self.children.pop(pid, None)
        if proc is not None:
            with trio.CancelScope(shield=True):
                await proc.stop(grace)

    @endpoint
    def ping(self) -> str:
        """This host's name: a cheap call a controller makes before it relies on the host."""
        return socket.gethostname()

    @endpoint
    def joinable(self) -> str:
        """Why this host may not take a new place in a run now ("" when it may). A leaving
        host (SIGTERM) serves on a while to tell owners it left, and takes no new place then."""
        return "it is leaving (SIGTERM)" if self.leaving else ""

    @endpoint
    def signal(self, pid: int, signum: int) -> None:
        """Send ``signum`` to the child ``pid``; nothing for a pid this host does not run (a
        host restarted since the owner spawned it has no such child: it is gone)."""
        proc = self.children.get(pid)
        if proc is not None:
            proc.process.send_signal(signum)

    def _child(self, pid: int) -> LocalProcess:
        proc = self.children.get(pid)
        if proc is None:
            raise KeyError(f"no actor process {pid} on this host")
        return proc

    async def on_signal(self) -> None:
        """SIGTERM: leave the run. Every child is stopped (SIGTERM: its calls in flight fail,
        and their owners retry them elsewhere) while the host still serves, so each owner's
        ``wait_exit`` learns that the host left (``HOST_LEFT`` in the reply) and does not
        wait for it as for a partition."""
        self.leaving = True
        stopped = set(self.children)
        async with trio.open_nursery() as nursery:
            for proc in list(self.children.values()):
                nursery.start_soon(proc.stop, 3.0)
        # Serve on until every owner has been told (an owner whose link to this host
        # dropped a moment ago asks again within seconds), bounded by LEAVE_REPORT_S.
        with trio.move_on_after(LEAVE_REPORT_S):
            while not stopped <= self.reported:
                await self.replied.wait()

    async def on_stop(self) -> None:
        procs = list(self.children.values())
        self.children.clear()
        for p in procs:
            p.signal_stop()
        async with trio.open_nursery() as nursery:
            for p in procs:
                nursery.start_soon(p.stop, 3.0)


class RemoteProcess:
    """An actor process on a host, as the mesh owner sees it."""

    def __init__(self, host: Any, pid: int, address: str) -> None:
        self.host = host
        self.pid = pid
        self.address = address

    @classmethod
    async def spawn(
        cls, host: Any, cls_path: str, *, name: str, rank: int, env: dict[str, str], register: Callable[[Any], None]
    ) -> RemoteProcess:
        address, pid = await host.spawn.call_one(cls_path, name, rank, env)
        proc = cls(host, pid, address)
        register(proc)
        return proc

    async def wait_exit(self) -> str:
        """How the process ended, once it has. A host that stops answering (its link is
        cut, its machine unreachable) is not an exit: the process may well run on, so this
        waits for the host to answer again, then keeps waiting on the process. A host that
        answers but no longer runs it (restarted meanwhile) raises ActorError (KeyError)."""
        while True:
            try:
                return await self.host.wait_exit.call_one(self.pid)
            except ActorDied:
                await self._reachable()

    async def _reachable(self) -> None:
        """Return once the host answers a ping (tried every HOST_RETRY_S)."""
        while True:
            await trio.sleep(HOST_RETRY_S)
            with trio.move_on_after(HOST_RETRY_S * 5):
                try:
                    await self.host.ping.call_one()
                    return
                except ActorDied:
                    pass

    def signal_stop(self) -> None:
        self.host.signal.broadcast(self.pid, int(signal.SIGTERM))

    async def stop(self, grace: float) -> None:
        with trio.move_on_after(grace + 5):
            try:
                await self.host.stop.call_one(self.pid, grace)
            except (ActorDied, ActorError):
                pass  # the host is gone or already reaped the process


def main(argv: list[str] | None = None) -> int | None:
    p = argparse.ArgumentParser(
        prog="python -m orchestrator.runtime.host", description="Host Flotilla actors for remote controllers."
    )
    p.add_argument("--bind", required=True, help="tcp://IP:PORT to listen on (PORT 0: any)")
    p.add_argument("--keys", required=True, help="key directory (id.key_secret, allowed/*.key)")
    p.add_argument("--advertise", default=None, help="host name or IP that controllers use to reach this machine")
    p.add_argument(
        "--allow",
        action="append",
        metavar="PREFIX",
        help="module prefix whose actor classes controllers may spawn here (repeatable; "
        f"default: {' '.join(DEFAULT_ALLOW)})",
    )
    p.add_argument(
        "--trust-own-key",
        action="store_true",
        help="also accept clients presenting this host's own key (off: only allowed/*.key)",
    )
    args = p.parse_args(argv)
    if not args.bind.startswith("tcp://"):
        p.error("--bind must be a tcp:// address")
    allow = tuple(args.allow or DEFAULT_ALLOW)
    if any(not a.rstrip(".") or not all(x.isidentifier() for x in a.rstrip(".").split(".")) for a in allow):
        p.error(f"--allow takes dotted module prefixes such as 'actors.', got {list(allow)}")
    try:
        curve = Curve.from_dir(args.keys)
    except (KeyFileError, OSError, ValueError) as e:
        print(f"flotilla host: {e}", file=sys.stderr)
        return 2
    ip, _, port = args.bind[len("tcp://") :].rpartition(":")
    advertise = args.advertise or (ip if ip not in ("0.0.0.0", "*") else socket.getfqdn())
    os.environ.update(curve.to_env())
    os.environ["FLOTILLA_HOST_BIND_IP"] = ip
    os.environ["FLOTILLA_HOST_ADVERTISE"] = advertise
    os.environ[ALLOW_ENV] = ",".join(allow)
    os.environ[TRUST_SELF_ENV] = "1" if args.trust_own_key else "0"
    print(f"flotilla host public key: {curve.public.decode()}", flush=True)
    from ._child import main as child_main

    child_main(
        [
            "--cls",
            "orchestrator.runtime.host:HostActor",
            "--name",
            "host",
            "--bind",
            f"tcp://{ip}:{'*' if port in ('0', '*') else port}",
            "--advertise",
            advertise,
            "--autostart",
        ]
    )
    return None


if __name__ == "__main__":
    sys.exit(main())
