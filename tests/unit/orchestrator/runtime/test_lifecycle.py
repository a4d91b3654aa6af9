"""Process lifetimes: death detection, respawn, cleanup on every exit path, idle CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from orchestrator.runtime import ActorDied, ActorError, Curve, open_mesh

from ._actors import BadInit, Collector, Counter, Gate, HangsOnRestart, Leaver, Lifecycle, QuickLeaver


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


def _children() -> list[psutil.Process]:
    return [
        c for c in psutil.Process().children(recursive=True) if "orchestrator.runtime._child" in " ".join(c.cmdline())
    ]


async def test_sigkill_fails_pending_and_later_calls_until_respawn() -> None:
    deaths: list[ActorDied] = []
    died = trio.Event()

    def on_death(exc: ActorDied) -> None:
        deaths.append(exc)
        died.set()

    with trio.fail_after(40):
        async with open_mesh(Gate, procs=2, on_death=on_death) as mesh:
            pid = await mesh[0].pid.call_one()
            errors: list[BaseException] = []

            async def pending() -> None:
                try:
                    await mesh[0].wait.call_one()
                except ActorDied as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(pending)
                await mesh[0].wait_parked.call_one(5)
                os.kill(pid, signal.SIGKILL)
                deadline = trio.current_time() + 5
            assert trio.current_time() < deadline  # every pending call failed within 5 s
            assert len(errors) == 5
            assert all(e.rank == 0 and ("SIGKILL" in e.reason or "lost" in e.reason) for e in errors)
            with trio.fail_after(5):
                await died.wait()  # the owner learns of the death (supervision hook)
            assert [(d.rank, d.reason) for d in deaths] == [(0, "killed by SIGKILL")]
            assert mesh.dead_ranks == [0]
            changes = mesh.state_changes  # moves with every change of what these lists say
            with trio.fail_after(1):
                with pytest.raises(ActorDied, match=r"gate\[0\] died"):
                    await mesh[0].pid.call_one()
                with pytest.raises(ActorDied):
                    await mesh.pid.call()
            assert await mesh.pid.choose() == await mesh[1].pid.call_one()  # skips the dead
            assert mesh.starting_ranks == []
            mesh.dead_ranks.append(1)  # each read is a fresh list: the mesh's own view is untouched
            assert mesh.dead_ranks == [0]
            assert mesh.state_changes == changes  # calls and reads change nothing
            mesh.respawn(0)
            assert (mesh.dead_ranks, mesh.starting_ranks) == ([], [0])
            assert mesh.state_changes != changes
            changes = mesh.state_changes
            new_pid = await mesh[0].pid.call_one()
            assert new_pid != pid
            assert await mesh[0].counts.call_one() == {"parked": 0, "cancelled": 0}
            assert (mesh.dead_ranks, mesh.starting_ranks) == ([], [])
            assert mesh.state_changes != changes


async def test_pending_calls_fail_within_five_seconds_of_kill() -> None:
    with trio.fail_after(30):
        async with open_mesh(Gate) as mesh:
            pid = await mesh[0].pid.call_one()
            async with trio.open_nursery() as nursery:

                async def killer() -> None:
                    await mesh[0].wait_parked.call_one(1)
                    os.kill(pid, signal.SIGKILL)

                nursery.start_soon(killer)
                with trio.fail_after(5), pytest.raises(ActorDied):
                    await mesh[0].wait.call_one()


async def test_leaving_normally_stops_every_child() -> None:
    with trio.fail_after(30):
        async with open_mesh(Counter, 0, procs=3) as mesh:
            pids = await mesh.pid.call()
            assert len(set(pids)) == 3
        assert _gone(pids)
        assert _children() == []


async def test_leaving_by_exception_stops_every_child() -> None:
    pids: list[int] = []
    with trio.fail_after(30):
        with pytest.raises(RuntimeError, match="body failed"):
            async with open_mesh(Counter, 0, procs=2) as mesh:
                pids = await mesh.pid.call()
                raise RuntimeError("body failed")
        assert pids and _gone(pids)
        assert _children() == []


async def test_leaving_by_cancellation_stops_every_child() -> None:
    pids: list[int] = []
    with trio.fail_after(30):
        with trio.CancelScope() as scope:
            async with open_mesh(Counter, 0, procs=2) as mesh:
                pids = await mesh.pid.call()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(mesh[0].block.call_one)  # a call in flight
                    scope.cancel()
        assert scope.cancelled_caught
        assert pids and _gone(pids)
        assert _children() == []


async def test_child_ignoring_sigterm_is_killed_after_grace() -> None:
    with trio.fail_after(30):
        async with open_mesh(Counter, 0, grace=0.5) as mesh:
            pid = await mesh[0].pid.call_one()
            # a process stuck in blocking code cannot run its SIGTERM handler
            psutil.Process(pid).suspend()
        assert _gone([pid])


async def test_constructor_error_raises_actor_error_and_cleans_up() -> None:
    with trio.fail_after(30):
        with pytest.raises(ActorError, match="constructor failed"):
            async with open_mesh(BadInit, procs=2):
                pytest.fail("body must not run")
        assert _children() == []


async def test_bad_actor_class_and_arguments_fail_at_the_caller() -> None:
    class Local(Counter):
        pass

    with trio.fail_after(5):
        with pytest.raises(TypeError, match="top level"):
            async with open_mesh(Local, 0):
                pass
        with pytest.raises(TypeError, match="missing a required argument"):
            async with open_mesh(Counter):
                pass
        with pytest.raises(TypeError, match="cannot send"):
            async with open_mesh(Counter, object()):
                pass


async def test_idle_mesh_burns_no_cpu() -> None:
    with trio.fail_after(30):
        async with open_mesh(Counter, 0, procs=2) as mesh:
            procs = [psutil.Process(pid) for pid in await mesh.pid.call()]
            before = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
            await trio.sleep(5)  # the measurement window itself, not a synchronisation
            after = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
            assert after - before < 0.1
            assert await mesh.value.call() == [0, 0]


_CONTROLLER = """
import sys, trio
from orchestrator.runtime import open_mesh
from tests.unit.orchestrator.runtime._actors import Counter

async def main():
    async with open_mesh(Counter, 0, procs=2) as mesh:
        print(*(await mesh.pid.call()), flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


async def test_actors_exit_when_their_controller_is_killed() -> None:
    with trio.fail_after(60):
        controller = await trio.lowlevel.open_process(
            [sys.executable, "-c", _CONTROLLER],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)},
        )
        assert controller.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            chunk = await controller.stdout.receive_some()
            assert chunk, "controller exited early"
            line += chunk
        children = [psutil.Process(int(pid)) for pid in line.split()]
        controller.kill()  # SIGKILL: no cleanup code runs in the controller
        await controller.wait()
        _, alive = await trio.to_thread.run_sync(psutil.wait_procs, children, 20)
        assert not alive


async def test_choose_skips_a_live_rank_whose_connection_is_dead() -> None:
    # As the owner leaves a rank whose process ended while its last replies come in
    # (Connection.settle): still live, but its calls fail at once and choose goes elsewhere.
    with trio.fail_after(30):
        async with open_mesh(Gate, procs=2) as mesh:
            other = await mesh[1].pid.call_one()
            assert mesh._owner is not None
            conn = mesh._owner.slots[0].conn
            assert conn is not None
            conn.dead = ActorDied("gate", 0, "its process ended")
            assert mesh.dead_ranks == []
            assert [await mesh.pid.choose() for _ in range(3)] == [other] * 3
            with pytest.raises(ActorDied, match="its process ended"):
                await mesh[0].pid.call_one()
            conn.dead = None


async def test_on_start_tasks_run_and_on_stop_runs_at_exit(tmp_path: Path) -> None:
    marker = tmp_path / "stopped"
    with trio.fail_after(30):
        async with open_mesh(Lifecycle, str(marker)) as mesh:
            assert await mesh[0].background_ran.call_one()
            assert not marker.exists()
    assert marker.read_text() == "stopped"


async def test_a_respawn_that_hangs_is_stopped_and_the_rank_marked_dead(tmp_path: Path) -> None:
    hang = tmp_path / "hang"
    deaths: list[ActorDied] = []
    with trio.fail_after(60):
        async with open_mesh(HangsOnRestart, str(hang), restart_timeout=3.0, on_death=deaths.append) as mesh:
            first = await mesh[0].pid.call_one()
            hang.write_text("")
            mesh.respawn(0)
            while mesh.dead_ranks != [0]:
                await trio.sleep(0.05)
            assert "respawn did not finish within 3 s" in deaths[-1].reason
            hung = [p.pid for p in psutil.Process().children() if p.pid != first]
            assert not [
                p
                for p in hung
                if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                and "HangsOnRestart" in " ".join(psutil.Process(p).cmdline())
            ]
            hang.unlink()
            mesh.respawn(0)  # and a later respawn works
            assert await mesh[0].pid.call_one() not in (first, None)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
@pytest.mark.parametrize("size", [10, 64 << 20])
@pytest.mark.parametrize("leaver", [Leaver, QuickLeaver])
async def test_the_replies_an_actor_drains_with_reach_their_caller(
    leaver: type[Leaver], size: int, transport: str
) -> None:
    # A draining actor's last replies are queued as its process stops: they must leave
    # before the socket closes (a leaving host's "I left" reply was once dropped so),
    # and the owner must take them in even when it sees the exit first (QuickLeaver: a
    # CURVE reply is read and decrypted whole, ~0.2 s for 64 MiB, after the process ended).
    with trio.fail_after(60):
        curve = Curve.generate() if transport == "tcp" else None
        async with open_mesh(leaver, transport=transport, curve=curve) as mesh:
            pid = await mesh[0].pid.call_one()
            word: list[bytes] = []
            async with trio.open_nursery() as nursery:

                async def last_word() -> None:
                    word.append(await mesh[0].last_word.call_one(size))

                nursery.start_soon(last_word)
                await mesh[0].wait_waiting.call_one()
                os.kill(pid, signal.SIGTERM)
            assert len(word[0]) == size


async def test_an_actor_process_collects_young_objects_rarely_and_freezes_what_start_up_made() -> None:
    from orchestrator.runtime._child import GC_GEN0

    async with open_mesh(Collector, procs=1) as mesh:
        with trio.fail_after(10):
            while True:
                gen0, frozen = await mesh[0].gc_state.call_one()
                if frozen:
                    break
                await trio.sleep(0.05)
    assert gen0 == GC_GEN0
    assert frozen > 1000  # modules, the actor and what its constructor made


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_drained_actor_counts_a_busy_or_waiting_thread_as_still_sending() -> None:
    # replies_sent closes a drained actor's socket only once ZeroMQ's I/O thread is idle:
    # its CPU time must show a thread that runs, and its state one that waits for a core.
    import threading

    from orchestrator.runtime._child import other_threads_state

    def seen(ok: Any) -> tuple[int, bool]:
        for _ in range(200):
            state = other_threads_state()
            assert state is not None
            if ok(state):
                return state
            trio.run(trio.sleep, 0.005)
        raise AssertionError(f"not seen: last {state}")

    idle = seen(lambda s: not s[1])
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        seen(lambda s: s[1] and s[0] - idle[0] > 5e6)  # running (or queued) and using CPU
    finally:
        stop.set()
        worker.join()
    seen(lambda s: not s[1])
