"""Key files, host trust, the host's class allowlist and rejected-message accounting,
against real `flotilla host` processes and real sockets."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import zmq

from orchestrator.runtime import ActorDied, ActorError, Curve, open_mesh
from orchestrator.runtime._conn import Connection
from orchestrator.runtime._curve import KeyFileError
from orchestrator.runtime.host import allowed_class

from ._actors import Counter
from .test_tcp import _start_host


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


async def _refused(cm, kind: type[BaseException], text: str) -> None:
    """Entering the mesh `cm` fails with `kind` (alone or in a group) whose message has `text`."""
    try:
        async with cm:
            pass
    except BaseException as exc:
        assert any(isinstance(e, kind) and text in str(e) for e in _leaves(exc)), exc
    else:
        raise AssertionError(f"expected {kind.__name__}: {text}")


async def _own_key_refused(address: str, server_key: str, own: Curve) -> None:
    """A connection of its own (the loop's shared one to this address already has an
    identity) presenting the host's own key: the handshake is refused, spawn never runs."""
    conn = Connection(
        address, name="own-key", rank=0, server_key=server_key.encode(), identity=own, connect_timeout=None
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run)
        p = conn.request(
            {"kind": "call", "endpoint": "spawn", "args": ["actors.env:EnvActor", "x", 0, {}]}, [], reply=True
        )
        assert p is not None
        with trio.fail_after(10):
            await p.wait()
        assert isinstance(p.error, ActorDied) and "CurveZMQ authentication failed" in p.error.reason, p.header
        conn.scope.cancel()


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_new_keys_are_private_and_exposed_ones_are_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    (keys / "allowed").mkdir(parents=True)  # as docs/remote-hosts.md has users do first: mode 0755
    curve = Curve.from_dir(keys)
    assert _mode(keys) == 0o700 and _mode(keys / "id.key_secret") == 0o600
    assert Curve.from_dir(keys).secret == curve.secret  # loads again unchanged
    os.chmod(keys / "id.key_secret", 0o644)
    with pytest.raises(KeyFileError, match=r"id.key_secret is accessible to other users \(mode 0644\); run: chmod 600"):
        Curve.from_dir(keys)
    os.chmod(keys / "id.key_secret", 0o600)
    os.chmod(keys, 0o755)
    with pytest.raises(KeyFileError, match="run: chmod 700"):
        Curve.from_dir(keys)
    # `flotilla host` says so in one line and exits 2, before listening
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.entry.cli", "host", "--bind", "tcp://127.0.0.1:0", "--keys", str(keys)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        proc.returncode == 2 and proc.stderr.startswith("flotilla host: key directory") and proc.stderr.count("\n") == 1
    ), proc.stderr


def test_allowlist_matches_module_prefixes_only() -> None:
    allow = ("actors.", "tests.unit")
    assert allowed_class("actors.sampler:SamplerActor", allow)
    assert allowed_class("tests.unit.orchestrator.runtime._actors:Counter", allow)
    assert allowed_class("tests.unit:X", allow)
    for bad in (
        "actorsx.evil:X",
        "actors:X",
        "os:system",
        "tests.unitx:X",
        "actors.sampler",
        "actors.sampler:Sampler Actor",
        "actors..x:Y",
        "subprocess:Popen",
    ):
        assert not allowed_class(bad, allow), bad


async def test_host_refuses_its_own_key_and_classes_outside_its_allowlist(tmp_path: Path) -> None:
    controller = Curve.generate()
    keys = tmp_path / "host-keys"
    (keys / "allowed").mkdir(parents=True)
    (keys / "allowed" / "controller.key").write_text(
        f'metadata\ncurve\n    public-key = "{controller.public.decode()}"\n'
    )
    own = None
    for extra in ((), ("--trust-own-key", "--allow", "tests.unit.orchestrator.runtime.")):
        with trio.fail_after(60):
            host, spec = await _start_host(keys, *extra) if extra else await _start_host(keys, "--allow", "actors.")
            try:
                own = Curve.from_dir(keys)  # a copy of the host's own keypair
                if not extra:
                    # the default host: a class outside actors.* is refused, and so is its own key
                    await _refused(
                        open_mesh(Counter, 0, hosts=[spec], curve=controller),
                        ActorError,
                        "refuses to spawn 'tests.unit.orchestrator.runtime._actors:Counter'",
                    )
                    await _own_key_refused(spec.address, spec.public_key, own)
                else:
                    # configured to trust its own key and allow the test actors: both work
                    async with open_mesh(Counter, 1, hosts=[spec], curve=own) as mesh:
                        assert await mesh.incr.call(1) == [2]
            finally:
                host.send_signal(signal.SIGTERM)
                with trio.move_on_after(10):
                    await host.wait()
                if host.returncode is None:
                    host.kill()
                    await host.wait()
    shutil.rmtree(keys)


async def test_malformed_frames_are_counted_and_logged_once_per_second_per_peer(capfd) -> None:
    ctx = zmq.Context.instance()
    async with open_mesh(Counter, 0, procs=1, name="victim") as mesh:
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.IDENTITY, b"rogue-1")
        rogue.connect(mesh.addresses[0])
        try:
            bad = [
                [b"{not json"],
                [b'{"id": 1, "kind": "call", "endpoint": "no_such", "args": []}'],
                [b'{"id": "x", "kind": "call"}'],
                [b'{"id": 2, "kind": "call", "endpoint": "incr", "args": ["NaN?"]}'],
            ]
            for i in range(400):
                rogue.send_multipart(bad[i % len(bad)])
            with trio.fail_after(20):
                while (st := await mesh[0].runtime_stats.call_one())["rejected_messages"] < 400:
                    await trio.sleep(0.05)
            assert st["rejected_messages"] == 400 and st["rejected_by_peer"] == {b"rogue-1".hex(): 400}
            assert await mesh[0].incr.call_one(5) == 5  # the actor kept serving
        finally:
            rogue.close(linger=0)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "rejected a request from peer" in ln]
    assert 1 <= len(lines) <= 3, lines  # 400 rejections in well under 3 s
    assert b"rogue-1".hex() in lines[0]
