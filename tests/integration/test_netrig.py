"""The network rig itself: a host namespace is reachable over its veth link, the link's
bandwidth is shaped, a cut drops traffic until restored, byte counters see the traffic, a
`flotilla host` in the namespace answers the controller over tcp + CurveZMQ, and closing the
rig leaves no namespace or interface behind."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest
import trio

from hardware import PoolConfig
from orchestrator.entry.pool_mesh import PoolStartError, check_hosts
from tests.netrig import NetRig, netrig_unavailable

pytestmark = [pytest.mark.timeout(180)]

SINK = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(4); print("ready", flush=True)
while True:
    c, _ = s.accept(); n = 0
    while True:
        b = c.recv(1 << 16)
        if not b: break
        n += len(b)
    c.sendall(str(n).encode()); c.close()
"""


def _sink(host, port: int = 7000) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        ["ip", "netns", "exec", host.netns, sys.executable, "-c", SINK, host.ip, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _send(ip: str, nbytes: int, port: int = 7000, timeout: float = 30.0) -> tuple[int, float]:
    """Bytes the sink counted and the seconds it took to send ``nbytes`` to it."""
    t0 = time.monotonic()
    with socket.create_connection((ip, port), timeout=timeout) as s:
        chunk = b"x" * (1 << 16)
        left = nbytes
        while left > 0:
            s.sendall(chunk[: min(left, len(chunk))])
            left -= min(left, len(chunk))
        s.shutdown(socket.SHUT_WR)
        got = int(s.recv(64).decode())
    return got, time.monotonic() - t0


def test_link_shape_cut_counters_and_cleanup() -> None:
    reason = netrig_unavailable()
    if reason:
        pytest.skip(reason)
    with NetRig() as rig:
        host = rig.add_host("a", start=False)
        sink = _sink(host)
        try:
            before = host.counters()
            got, _ = _send(host.ip, 1_000_000)
            assert got == 1_000_000
            after = host.counters()
            assert after["tx_bytes"] - before["tx_bytes"] >= 1_000_000

            # 20 Mbit/s: 4 MB takes at least ~1.6 s however fast the machine is.
            host.shape(20)
            got, took = _send(host.ip, 4_000_000)
            assert got == 4_000_000
            assert 4_000_000 * 8 / took < 20e6 * 1.3, f"{4e6 * 8 / took / 1e6:.1f} Mbit/s through a 20 Mbit/s link"
            host.shape(None)

            host.cut()
            assert not host.is_up()
            with pytest.raises(OSError):
                _send(host.ip, 1000, timeout=2.0)
            host.restore()
            assert host.is_up()
            deadline = time.monotonic() + 20
            while True:  # the connected route returns with the link
                try:
                    assert _send(host.ip, 1000)[0] == 1000
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the link did not come back"
                    time.sleep(0.2)
        finally:
            sink.kill()
            sink.wait()
            sink.stdout.close()
        names = (host.netns, host.veth)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert names[0] not in netns and names[1] not in links


def test_flotilla_host_in_a_namespace_answers_and_is_cleaned_up(netrig) -> None:
    host = netrig.add_host("h")
    pool = PoolConfig(name="remote", gpu="H100-SXM", device="cpu", hosts=[host.address], keys=str(netrig.keys))
    trio.run(check_hosts, [pool])
    assert host.counters()["rx_bytes"] > 0

    host.cut()
    with pytest.raises(PoolStartError, match="cannot be used"):
        trio.run(check_hosts, [pool], 3.0)
    host.restore()
    host.kill(signal.SIGKILL)
    host.start()  # same namespace, same address
    trio.run(check_hosts, [pool])

    pid = host.proc.pid
    netrig.close()
    assert subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True).returncode != 0
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)
