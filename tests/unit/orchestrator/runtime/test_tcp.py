"""tcp + CurveZMQ: allowed clients work, others are refused; actor hosts spawn remotely."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import trio
import trio.testing
import zmq

from orchestrator.runtime import ActorDied, Curve, HostSpec, open_mesh
from orchestrator.runtime._conn import Connection
from orchestrator.runtime._wire import dumps, loads
from orchestrator.runtime._zsock import context

from ._actors import Counter, Echo, Relay


async def test_curve_mesh_serves_allowed_and_refuses_unknown_keys() -> None:
    curve = Curve.generate()
    with trio.fail_after(30):
        async with open_mesh(Counter, 0, procs=2, transport="tcp", curve=curve) as mesh:
            assert all(a.startswith("tcp://127.0.0.1:") for a in mesh.addresses)
            assert await mesh.incr.call(2) == [2, 2]
            # actors of the mesh call each other with the mesh's own key
            async with open_mesh(Relay, transport="tcp", curve=curve) as relay:
                assert await relay[0].via_mesh.call_one(mesh, 1) == [3, 3]
            rogue = Connection(
                mesh.addresses[0],
                name="rogue",
                rank=0,
                server_key=curve.public,
                identity=Curve.generate(),
                connect_timeout=None,
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(rogue.run)
                p = rogue.request({"kind": "call", "endpoint": "incr", "args": [100]}, [], reply=True)
                assert p is not None
                with trio.fail_after(5):
                    await p.wait()
                assert isinstance(p.error, ActorDied), p.header
                assert "CurveZMQ authentication failed" in p.error.reason
                with pytest.raises(ActorDied, match="refused"):
                    rogue.request({"kind": "call", "endpoint": "incr", "args": [100]}, [], reply=True)
                rogue.scope.cancel()
            assert await mesh.value.call() == [3, 3]  # the rogue call never ran


async def test_lent_memory_answered_over_tcp_travels_as_a_plain_frame_and_goes_back_to_its_pool() -> None:
    from orchestrator.runtime._shm import ENABLED, SHM_MIN_BYTES

    if not ENABLED:
        pytest.skip("no /dev/shm here: nothing is lent")
    with trio.fail_after(60):
        async with open_mesh(Echo, transport="tcp", curve=Curve.generate()) as mesh:
            for value in range(1, 5):  # not shared memory over tcp: ZeroMQ sends the lent bytes
                t = await mesh[0].lent.call_one(2 * SHM_MIN_BYTES, value)
                assert t.numel() == 2 * SHM_MIN_BYTES and bool((t == value).all())
            # once ZeroMQ has sent it, the actor's lent segment is free and lent again (a
            # second one if a call came before ZeroMQ let go of the last; never one a call)
            assert await mesh[0].shm_segments_created.call_one() <= 2


async def test_tcp_needs_curve() -> None:
    with trio.fail_after(5), pytest.raises(ValueError, match="curve"):
        async with open_mesh(Counter, 0, transport="tcp"):
            pass


async def _start_host(keys: Path, *extra: str) -> tuple[trio.Process, HostSpec]:
    """A real `flotilla host` process; by default it may spawn this package's test actors."""
    proc = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "orchestrator.entry.cli",
            "host",
            "--bind",
            "tcp://127.0.0.1:0",
            "--keys",
            str(keys),
            *(extra or ("--allow", "tests.unit.orchestrator.runtime.")),
        ],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)},
    )
    assert proc.stdout is not None
    out = b""
    while out.count(b"\n") < 2:
        chunk = await proc.stdout.receive_some()
        assert chunk, f"host exited early: {out!r}"
        out += chunk
    key_line, addr_line = out.decode().splitlines()[:2]
    public = key_line.rsplit(" ", 1)[1]
    address = addr_line.rsplit(" ", 1)[1]
    return proc, HostSpec(address=address, public_key=public)


async def test_actor_host_spawns_watches_and_stops_actors(tmp_path: Path) -> None:
    controller = Curve.generate()
    keys = tmp_path / "host-keys"
    (keys / "allowed").mkdir(parents=True)
    (keys / "allowed" / "controller.key").write_text(
        f'metadata\ncurve\n    public-key = "{controller.public.decode()}"\n'
    )
    with trio.fail_after(60):
        host, spec = await _start_host(keys)
        try:
            assert spec.public_key == Curve.from_dir(keys).public.decode()
            died = trio.Event()
            reasons: list[str] = []

            def on_death(exc: ActorDied) -> None:
                reasons.append(exc.reason)
                died.set()

            async with open_mesh(Counter, 5, procs=2, hosts=[spec], curve=controller, on_death=on_death) as mesh:
                assert await mesh.incr.call(1) == [6, 6]
                pids = await mesh.pid.call()
                assert all(psutil.Process(p).ppid() == host.pid for p in pids)
                pending_errors: list[BaseException] = []

                async def pending() -> None:
                    try:
                        await mesh[1].block.call_one()
                    except ActorDied as exc:
                        pending_errors.append(exc)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pending)
                    await trio.testing.wait_all_tasks_blocked()
                    os.kill(pids[1], signal.SIGKILL)
                    with trio.fail_after(5):
                        await died.wait()
                assert len(pending_errors) == 1
                assert reasons == ["killed by SIGKILL"]
                with pytest.raises(ActorDied, match="SIGKILL"):
                    await mesh[1].incr.call_one(1)
                mesh.respawn(1)
                assert await mesh[1].incr.call_one(2) == 7
                pids = await mesh.pid.call()
            for pid in pids:
                with pytest.raises(psutil.NoSuchProcess):
                    psutil.Process(pid).status()
            # a controller whose key the host does not know is refused
            with pytest.raises(ActorDied, match="refused"):
                async with open_mesh(Counter, 0, hosts=[spec], curve=Curve.generate()):
                    pass
        finally:
            host.send_signal(signal.SIGTERM)
            with trio.move_on_after(10):
                await host.wait()
            if host.returncode is None:
                host.kill()
                await host.wait()
    assert host.returncode == 0
    shutil.rmtree(keys)


async def test_a_reply_that_arrived_before_the_link_closed_is_delivered_not_failed() -> None:
    # The monitor's "disconnected" and the data socket's last reply become readable
    # together; which reader trio wakes first is not fixed. The reply must win either way
    # (a leaving host's last reply, "I left", was lost so). Here the monitor's goes first.
    server = context().socket(zmq.ROUTER)
    server.bind("tcp://127.0.0.1:*")
    address = server.getsockopt_string(zmq.LAST_ENDPOINT)
    conn = Connection(address, name="leaver", rank=0, server_key=None, identity=None, connect_timeout=None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run)
        p = conn.request({"kind": "call", "endpoint": "last_word", "args": []}, [], reply=True)
        assert p is not None
        ident, header = await trio.to_thread.run_sync(server.recv_multipart)
        await trio.sleep(0.1)  # a long call: the connection's readers park meanwhile
        server.send_multipart([ident, dumps({"id": loads(header)["id"], "kind": "ok"})])
        server.close(linger=2000)
        time.sleep(0.3)  # blocking: the reply and the disconnect are both pending now
        conn._mon.poll()  # the monitor's reader runs first
        with trio.fail_after(10):
            await p.wait()
        assert p.error is None, p.error
        conn.scope.cancel()


def test_a_leaving_host_refuses_a_new_place() -> None:
    # Between SIGTERM and its exit a host serves on to tell owners it left; an elastic
    # pool's probe then must not place a sampler on it again.
    from orchestrator.runtime.host import HostActor

    host = HostActor()
    assert host.joinable() == ""
    host.leaving = True
    assert "leaving" in host.joinable()
