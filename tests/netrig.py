"""A multi-host network rig: ``flotilla host`` processes, each in its own network namespace.

The controller (``flotilla run``, or a test's own mesh) stays in the root namespace; each host
gets a namespace ``flt-<tag>-<name>`` joined to the root by a veth pair on its own /30 subnet
(10.64.0.0/10), so every byte between the controller and that host crosses one interface that
can be shaped, cut and counted. Every connection in Flotilla goes from the controller's side to
the host (the host and the actors it starts listen), so nothing routes between namespaces.

API (everything synchronous; call it from trio tests as is)::

    from tests.netrig import NetRig, netrig_unavailable

    with NetRig() as rig:                       # or the ``netrig`` pytest fixture
        host = rig.add_host("a", rate_mbit=100) # namespace + veth + `flotilla host`, started
        host.address                            # "tcp://10.x.y.2:5555", for a pool's `hosts`
        rig.keys                                # the controller's key dir, for a pool's `keys`
        host.shape(rate_mbit=1000)              # tbf both ways; None removes the shaping
        host.cut(); host.restore()              # `ip link set ... down` / `up` (drops, silently)
        host.counters()                         # {"tx_bytes": ..., "rx_bytes": ...} controller side
        host.kill(signal.SIGKILL); host.start() # the host process (same namespace and address)
        rig.add_host("b", start=False)          # namespace only; `host.start()` later (a join)
    # leaving the block kills every process in the namespaces and deletes them

* ``NetRig(tag=None, keys=None)``: ``tag`` (default: random) makes every name unique, so runs
  in parallel do not collide; ``keys`` is the controller's key directory (default: a
  temporary one, created). Each host has its own key pair; the controller's public key is in
  the host's ``allowed/`` and the host's in ``keys/hosts/IP_PORT.key``, as a pool expects.
* ``add_host(name, *, rate_mbit=None, start=True, port=5555)``: ``name`` is at most 4
  characters (interface names are short).
* ``Host``: ``address``, ``ip``, ``netns``, ``veth`` (the root-side interface), ``log`` (the
  host's stdout+stderr), ``proc`` (its ``Popen``, or None), ``start()``, ``kill(sig)``,
  ``terminate()``, ``shape``, ``cut``, ``restore``, ``counters``, ``exec(*cmd)`` (a command in
  the namespace, ``subprocess.run``).
* ``netrig_unavailable()``: None when the rig can run here, else the reason (not root, no
  ``ip``/``tc``, namespaces not permitted); the ``netrig`` fixture skips with it.
* ``sweep_stale()``: deletes namespaces left by rigs whose process died (``flt-<pid>-...``).

Shaping is a token-bucket filter (``tc qdisc ... tbf``) on each end's egress; this kernel has
no ``netem``, so the rig adds no latency. A cut sets the host's end of the link down: packets
to and from the host are dropped silently (no error reaches the sender), established TCP
connections survive it and resume after ``restore()`` unless their peer gave up meanwhile.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

import pytest

__all__ = ["Host", "NetRig", "netrig", "netrig_unavailable", "sweep_stale"]

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "flt-"
START_TIMEOUT_S = 60.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netrig_unavailable() -> str | None:
    """Why the rig cannot run on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "the network rig needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the network rig needs the `{tool}` command (iproute2)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def sweep_stale() -> list[str]:
    """Delete ``flt-<pid>-*`` namespaces whose creating process is gone; returns their names."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if not name.startswith(PREFIX) or len(parts) < 3 or not parts[1].isdigit():
            continue
        if not Path(f"/proc/{parts[1]}").exists():
            _kill_netns_pids(name)
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


def _kill_netns_pids(netns: str) -> None:
    for pid in _ip("netns", "pids", netns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _used_subnets() -> set[tuple[int, int]]:
    used = set()
    for line in _ip("-o", "-4", "addr", "show", check=False).stdout.splitlines():
        for word in line.split():
            if word.startswith("10.") and "/" in word:
                _, b, c, _ = word.split("/")[0].split(".")
                used.add((int(b), int(c)))
    return used


class Host:
    """One ``flotilla host`` in its own namespace, behind one veth pair (see the module doc)."""

    def __init__(self, rig: NetRig, name: str, index: int, subnet: tuple[int, int, int], port: int) -> None:
        b, c, d = subnet
        self.rig = rig
        self.name = name
        self.netns = f"{PREFIX}{os.getpid()}-{rig.tag}-{name}"
        self.veth = f"flt{rig.tag}{index}c"
        self.peer = f"flt{rig.tag}{index}h"
        self.controller_ip = f"10.{b}.{c}.{d + 1}"
        self.ip = f"10.{b}.{c}.{d + 2}"
        self.port = port
        self.address = f"tcp://{self.ip}:{port}"
        self.keys = rig.dir / f"host-{name}"
        self.log = rig.dir / f"host-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def _create(self) -> None:
        _ip("netns", "add", self.netns)
        _ip("link", "add", self.veth, "type", "veth", "peer", "name", self.peer)
        _ip("link", "set", self.peer, "netns", self.netns)
        _ip("addr", "add", f"{self.controller_ip}/30", "dev", self.veth)
        _ip("link", "set", self.veth, "up")
        _ip("-n", self.netns, "addr", "add", f"{self.ip}/30", "dev", self.peer)
        _ip("-n", self.netns, "link", "set", self.peer, "up")
        _ip("-n", self.netns, "link", "set", "lo", "up")

    def exec(self, *cmd: str, **kw: Any) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run`` of ``cmd`` inside this host's namespace."""
        return subprocess.run(["ip", "netns", "exec", self.netns, *cmd], **kw)

    def start(self) -> None:
        """Start ``flotilla host`` in the namespace on ``address``; returns once it listens.

        Raises RuntimeError (with the end of its log) when it exits or does not listen within
        a minute."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"host {self.name} is already running")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        with self.log.open("ab") as log:
            offset = log.tell()
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, sys.executable, "-m", "orchestrator.entry.cli", "host"]
                + ["--bind", self.address, "--keys", str(self.keys)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            text = self.log.read_bytes()[offset:].decode(errors="replace")
            if f"listening on {self.address}" in text:
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        tail = self.log.read_bytes()[offset:].decode(errors="replace")[-2000:]
        self.kill(signal.SIGKILL)
        raise RuntimeError(f"host {self.name} did not start listening on {self.address}: {tail}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the host's process group and, for SIGKILL, reap it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGKILL:
            self.proc.wait()

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to the host (it stops its actors), wait up to ``timeout``; its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            return self.proc.returncode

    def shape(self, rate_mbit: float | None) -> None:
        """Limit both directions to ``rate_mbit`` (tbf on each end's egress); None: unlimited."""
        for ns, dev in ((None, self.veth), (self.netns, self.peer)):
            pre = ["-n", ns] if ns else []
            if rate_mbit is None:
                subprocess.run(["tc", *pre, "qdisc", "del", "dev", dev, "root"], capture_output=True, check=False)
                continue
            rate = int(rate_mbit * 1e6)
            burst = max(rate // 8 // 250, 16 * 1024)  # at least one timer tick's worth of bytes
            subprocess.run(
                ["tc", *pre, "qdisc", "replace", "dev", dev, "root", "tbf"]
                + ["rate", f"{rate}bit", "burst", str(burst), "latency", "200ms"],
                capture_output=True,
                text=True,
                check=True,
            )

    def cut(self) -> None:
        """Take the link down (the host's end): nothing passes between the controller and this
        host. The controller's end keeps its address and route but has no carrier, so what it
        sends to the host is dropped silently, as on a partitioned WAN link (with that end
        down too, the kernel would route the host's address elsewhere)."""
        _ip("-n", self.netns, "link", "set", self.peer, "down")

    def restore(self) -> None:
        """Bring the link back up (addresses and shaping are kept)."""
        _ip("-n", self.netns, "link", "set", self.peer, "up")

    def is_up(self) -> bool:
        """Whether the link carries traffic (the controller's end has a carrier)."""
        return "NO-CARRIER" not in _ip("-o", "link", "show", self.veth).stdout.split(">")[0]

    def counters(self) -> dict[str, int]:
        """Bytes and packets through the root-side interface: ``tx`` is controller -> host."""
        base = Path("/sys/class/net") / self.veth / "statistics"
        return {k: int((base / k).read_text()) for k in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")}

    def _destroy(self) -> None:
        self.kill(signal.SIGKILL)
        _kill_netns_pids(self.netns)
        _ip("netns", "del", self.netns, check=False)
        _ip("link", "del", self.veth, check=False)


class NetRig:
    """Namespaces, links and hosts for one test; a context manager that removes all of them."""

    def __init__(self, tag: str | None = None, keys: Path | None = None) -> None:
        self.tag = tag or "".join(random.choices("0123456789abcdef", k=4))
        if len(self.tag) > 6 or not self.tag.isalnum():
            raise ValueError(f"rig tag must be 1-6 letters or digits, got {self.tag!r}")
        self.dir = Path(mkdtemp(prefix=f"netrig-{self.tag}-"))
        self.keys = keys or self.dir / "controller-keys"
        self.hosts: dict[str, Host] = {}

    def __enter__(self) -> NetRig:
        from orchestrator.runtime import Curve

        self._curve = Curve.from_dir(self.keys)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every host, delete every namespace and link this rig made (idempotent)."""
        for host in self.hosts.values():
            host._destroy()

    def _subnet(self) -> tuple[int, int, int]:
        used = _used_subnets()
        for _ in range(1000):
            b, c, d = random.randrange(64, 128), random.randrange(256), random.randrange(0, 256, 4)
            if (b, c) not in used:
                return b, c, d
        raise RuntimeError("no free 10.64.0.0/10 subnet for the rig")

    def add_host(self, name: str, *, rate_mbit: float | None = None, start: bool = True, port: int = 5555) -> Host:
        """A namespace, a veth link and a key pair for host ``name``; its process if ``start``."""
        from orchestrator.runtime import Curve

        if not (0 < len(name) <= 4 and name.isalnum()) or name in self.hosts:
            raise ValueError(f"host name must be 1-4 letters or digits and new in this rig, got {name!r}")
        if len(self.hosts) >= 10:
            raise ValueError("a rig has at most 10 hosts")
        host = Host(self, name, len(self.hosts), self._subnet(), port)
        self.hosts[name] = host
        host._create()
        Curve.from_dir(host.keys)
        (host.keys / "allowed").mkdir(exist_ok=True)
        shutil.copy(self.keys / "id.key", host.keys / "allowed" / "controller.key")
        (self.keys / "hosts").mkdir(exist_ok=True)
        shutil.copy(host.keys / "id.key", self.keys / "hosts" / f"{host.ip}_{port}.key")
        if rate_mbit is not None:
            host.shape(rate_mbit)
        if start:
            host.start()
        return host


@pytest.fixture
def netrig() -> Iterator[NetRig]:
    """A ``NetRig`` removed after the test, pass or fail; skips where the rig cannot run."""
    reason = netrig_unavailable()
    if reason:
        pytest.skip(reason)
    sweep_stale()
    with NetRig() as rig:
        yield rig
