"""Call kinds, concurrency, errors, typing and cancellation on real actor processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
import trio.testing

from orchestrator.runtime import ActorDied, ActorError, open_mesh
from orchestrator.runtime._conn import SPIN_S, Connection

from ._actors import Counter, Echo, Gate, Holder, Item, Relay

# Would run `touch <path>` if anything unpickled it (protocol 0, built by hand: no pickle import).
_PWN_MARK = Path("/tmp/flotilla-pwned-marker")
PICKLE_BOMB = b"cos\nsystem\n(S'touch " + str(_PWN_MARK).encode() + b"'\ntR."


async def test_call_kinds_on_two_ranks() -> None:
    with trio.fail_after(30):
        async with open_mesh(Counter, 10, procs=2, name="counter") as mesh:
            assert await mesh[0].incr.call_one(5) == 15
            assert await mesh.incr.call(1) == [16, 11]  # rank order
            assert await mesh.rank.call() == [0, 1]
            # choose: both idle, tie goes to the lowest rank
            assert await mesh.incr.choose(100) == 116
            mesh.incr.broadcast(1)
            assert sorted([v async for v in mesh.value.stream()]) == [12, 117]
            with pytest.raises(ActorError, match="stream me"):
                async for _ in mesh.fail.stream("stream me"):
                    pass
            with pytest.raises(ValueError, match="call_one on 2 actors"):
                await mesh.incr.call_one(1)
            with pytest.raises(AttributeError, match="no endpoint 'nope'"):
                mesh.nope  # noqa: B018


async def test_thousand_concurrent_calls_return_right_results() -> None:
    with trio.fail_after(60):
        async with open_mesh(Counter, 0, procs=2) as mesh:
            results: dict[int, int] = {}

            async def one(i: int) -> None:
                if i % 3 == 0:
                    results[i] = await mesh.echo.choose(i)
                else:
                    results[i] = await mesh[i % 2].echo.call_one(i)

            async with trio.open_nursery() as nursery:
                for i in range(1000):
                    nursery.start_soon(one, i)
            assert results == {i: i for i in range(1000)}


async def test_plain_calls_and_keyword_calls_agree() -> None:
    """A call of plain positional values takes the actor's short path, the same call by
    keyword the general one: both give the same values, errors and refusals."""
    with trio.fail_after(30):
        async with open_mesh(Counter, 0) as mesh:
            c = mesh[0]
            assert [await c.incr.call_one(5), await c.incr.call_one(by=5)] == [5, 10]
            assert [await c.echo.call_one(3), await c.echo.call_one(x=3)] == [3, 3]  # suspends first
            assert await c.value.call_one() == 10  # a plain function
            assert await c.pid.call_one() != os.getpid()
            for call in (c.fail.call_one("boom"), c.fail.call_one(message="boom")):
                with pytest.raises(ActorError, match="boom"):
                    await call
            for call in (c.incr.call_one("five"), c.incr.call_one(by="five")):
                with pytest.raises(TypeError, match="incr: invalid arguments"):
                    await call
            assert await c.value.call_one() == 10
        async with open_mesh(Echo) as mesh:
            assert await mesh[0].echo.call_one(2.5) == 2.5
            assert await mesh[0].scale.call_one([1.0], 2.0) == [2.0]  # a list: not plain
            with pytest.raises(TypeError, match="does not match its annotation"):
                await mesh[0].liar.call_one()


async def test_choose_prefers_least_loaded_rank() -> None:
    with trio.fail_after(30):
        async with open_mesh(Gate, procs=2) as mesh, trio.open_nursery() as nursery:
            nursery.start_soon(mesh[0].wait.call_one)
            await mesh[0].wait_parked.call_one(1)
            # rank 0 has one call in flight from here, rank 1 none
            assert await mesh.pid.choose() == await mesh[1].pid.call_one()
            await mesh[0].open.call_one()


async def test_endpoint_error_reaches_caller_and_actor_keeps_serving() -> None:
    with trio.fail_after(30):
        async with open_mesh(Counter, 0) as mesh:
            with pytest.raises(ActorError) as info:
                await mesh[0].fail.call_one("boom 42")
            err = info.value
            assert err.remote_type == "ValueError"
            assert err.message == "boom 42"
            assert "raise ValueError(message)" in err.traceback_text
            assert "_actors.py" in err.traceback_text
            assert await mesh[0].incr.call_one(2) == 2


async def test_bad_arguments_raise_type_error_at_caller() -> None:
    with trio.fail_after(30):
        async with open_mesh(Echo) as mesh:
            with pytest.raises(TypeError, match="cannot send a value of type"):
                await mesh[0].echo.call_one(object())
            with pytest.raises(TypeError, match="cannot send"):
                await mesh[0].echo.call_one({"nested": [1, {2, 3}]})
            with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
                await mesh[0].scale.call_one([1.0], bogus=1)
            with pytest.raises(TypeError, match="missing a required argument"):
                await mesh[0].scale.call_one()
            # validated on arrival: a string is not a list of floats
            with pytest.raises(TypeError, match="invalid arguments"):
                await mesh[0].scale.call_one("abc")
            assert await mesh[0].scale.call_one([1.0, 2.5], factor=3) == [3.0, 7.5]
            with pytest.raises(TypeError, match="does not match its annotation"):
                await mesh[0].liar.call_one()


async def test_values_round_trip_and_nothing_is_unpickled() -> None:
    with trio.fail_after(30):
        _PWN_MARK.unlink(missing_ok=True)
        async with open_mesh(Echo) as mesh:
            value = {"a": [1, 2.5, None, True], "t": (1, "x"), 3: b"raw", "b": bytearray(b"xy"), "__t": "not a tag"}
            back = await mesh[0].echo.call_one(value)
            assert back == {"a": [1, 2.5, None, True], "t": (1, "x"), 3: b"raw", "b": b"xy", "__t": "not a tag"}
            assert await mesh[0].echo.call_one(PICKLE_BOMB) == PICKLE_BOMB
            item = Item(name="w", weights=[1, 2], tags=("a", "b"))
            assert await mesh[0].item.call_one(item) == item
            # a dict that fits the model is validated into one on arrival and on return
            assert await mesh[0].item.call_one({"name": "d", "weights": None}) == Item(name="d", weights=None)
        assert not _PWN_MARK.exists()


async def test_cancelled_caller_cancels_remote_call() -> None:
    with trio.fail_after(30):
        async with open_mesh(Gate) as mesh:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(mesh[0].wait.call_one)
                    await mesh[0].wait_parked.call_one(1)
                    scope.cancel()
            await mesh[0].wait_cancelled.call_one(1)
            assert await mesh[0].counts.call_one() == {"parked": 1, "cancelled": 1}


async def test_cancelled_while_spinning_cancels_remote_call() -> None:
    with trio.fail_after(30):
        async with open_mesh(Gate) as mesh:
            conn = mesh.connection_now(0)
            assert conn is not None
            conn.rtt_ewma = 0.0  # as after fast replies: the next wait spins first
            with trio.move_on_after(SPIN_S / 10):
                await mesh[0].wait.call_one()
            assert conn.pending == {}
            # The cancel reaches the actor before or after the call started: either it
            # never runs, or it parks and is cancelled. Nothing stays parked.
            counts = await mesh[0].counts.call_one()
            while counts["parked"] != counts["cancelled"]:
                await trio.sleep(0.01)
                counts = await mesh[0].counts.call_one()
            assert counts["parked"] <= 1


async def test_slow_endpoints_park_instead_of_spinning() -> None:
    """Waiting on slow calls parks at once (the spin is for fast ones): counted, not timed."""
    with trio.fail_after(30):
        async with open_mesh(Counter, 0) as mesh:
            for _ in range(50):
                await mesh[0].echo.call_one(1)
            conn = mesh.connection_now(0)
            assert conn is not None
            await mesh[0].nap.call_one(0.02)
            await mesh[0].nap.call_one(0.02)  # the reply-time average now says "slow"
            before = conn.spun_waits
            for _ in range(20):
                await mesh[0].nap.call_one(0.02)
            assert conn.spun_waits == before


async def test_every_spinning_wait_lets_the_other_tasks_run() -> None:
    """A fast call's wait spins, and it still lets the loop's other tasks run at every
    call: that is what lets many concurrent calls all send before any of them spins
    (counted, not timed)."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    with trio.fail_after(30):
        async with open_mesh(Counter, 0) as mesh, trio.open_nursery() as nursery:
            for _ in range(50):
                await mesh[0].value.call_one()
            conn = mesh.connection_now(0)
            assert conn is not None
            spun = conn.spun_waits
            nursery.start_soon(ticker)
            await trio.lowlevel.checkpoint()  # the ticker starts
            start = ticks
            for _ in range(100):
                await mesh[0].value.call_one()
            assert ticks - start >= 100
            assert conn.spun_waits > spun  # the calls did spin (they are fast)
            nursery.cancel_scope.cancel()


async def test_calls_from_one_caller_start_in_order() -> None:
    with trio.fail_after(30):
        async with open_mesh(Gate) as mesh:
            for i in range(200):
                mesh[0].record.broadcast(i)
            await mesh[0].record.call_one(200)
            assert await mesh[0].recorded.call_one() == list(range(201))


async def test_actor_calls_actor_through_handles() -> None:
    with trio.fail_after(30):
        async with open_mesh(Counter, 0, procs=2, name="c") as counters, open_mesh(Relay, name="relay") as relay:
            assert await relay[0].via_mesh.call_one(counters, 2) == [2, 2]
            assert await relay[0].via_actor.call_one(counters[1], 5) == 7
            assert await counters.value.call() == [2, 7]
            assert os.getpid() not in await counters.pid.call()


async def test_async_calls_keep_task_state_across_their_first_suspension() -> None:
    """A call that takes a lock, a cancel scope or a nursery before it first suspends
    releases them in the same task: concurrent calls all succeed, in turn."""
    with trio.fail_after(30):
        async with open_mesh(Holder) as mesh:
            got: list[int] = []

            async def one() -> None:
                got.append(await mesh[0].locked_incr.call_one())

            async with trio.open_nursery() as nursery:
                for _ in range(50):
                    nursery.start_soon(one)
            assert sorted(got) == list(range(1, 51))
            assert await mesh[0].scoped.call_one(0.01) is True
            assert await mesh[0].locked_incr.call_one() == 51


async def test_a_call_sees_its_own_context_only() -> None:
    """Context variables a call sets, suspended or not, are not seen by the next call."""
    with trio.fail_after(30):
        async with open_mesh(Holder) as mesh:
            for suspend in (False, True, False):
                assert await mesh[0].set_var.call_one("mine", suspend) == "mine"
                assert await mesh[0].get_var.call_one() == "unset"
            got: dict[int, str] = {}

            async def one(i: int) -> None:  # concurrent: most of these start on parked tasks
                got[i] = await mesh[0].set_var.call_one(f"v{i}", True)

            async with trio.open_nursery() as nursery:
                for i in range(40):
                    nursery.start_soon(one, i)
            assert got == {i: f"v{i}" for i in range(40)}
            assert [await mesh[0].get_var.call_one() for _ in range(5)] == ["unset"] * 5


async def test_trace_parent_reaches_the_call_and_goes_no_further(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's span is the call's parent whether the call suspends or not; a later
    call made outside any span sees none."""
    from orchestrator.runtime import configure_tracing, span
    from orchestrator.runtime._tracing import current_traceparent

    for name in ("FLOTILLA_TRACE_FILE", "FLOTILLA_SERVICE_NAME", "FLOTILLA_TRACE_SAMPLE"):
        monkeypatch.setenv(name, "")
    configure_tracing(tmp_path / "spans.jsonl", "test-caller")
    with trio.fail_after(30):
        async with open_mesh(Holder) as mesh:
            for suspend in (False, True):
                with span("caller.step"):
                    mine = current_traceparent()
                    assert mine is not None
                    assert await mesh[0].trace_seen.call_one(suspend) == mine
                assert await mesh[0].trace_seen.call_one(suspend) is None
                assert await mesh[0].trace_seen.call_one(not suspend) is None


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
async def test_zeromqs_threads_in_an_actor_run_batch_unless_turned_off() -> None:
    with trio.fail_after(30):
        async with open_mesh(Echo) as mesh, open_mesh(Echo, env={"FLOTILLA_ZMQ_BATCH": "0"}) as plain:
            batch, default = await mesh[0].thread_policies.call_one(), await plain[0].thread_policies.call_one()
    zmq_threads = [name for name in batch if name.startswith("ZMQbg/")]
    assert "ZMQbg/IO/0" in zmq_threads  # its I/O thread: woken by a send, it waits for the sender to yield
    assert all(batch[name] == os.SCHED_BATCH for name in zmq_threads)
    assert batch["main"] == os.SCHED_OTHER  # the actor's own thread keeps the default
    assert all(default[name] == os.SCHED_OTHER for name in default if name.startswith("ZMQbg/"))


@pytest.mark.parametrize("spins", [True, False], ids=["spinning", "parking"])
async def test_a_request_whose_send_fails_raises_and_leaves_no_entry(tmp_path: Path, spins: bool) -> None:
    # A spinning caller's entry is made after its send, a parking caller's before it:
    # either way a failed send raises ActorDied and leaves nothing pending.
    with trio.fail_after(30):
        conn = Connection(
            f"ipc://{tmp_path}/nobody", name="nobody", rank=0, server_key=None, identity=None, connect_timeout=None
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.run)
            await trio.testing.wait_all_tasks_blocked()
            conn.rtt_ewma = 0.0 if spins else 1.0
            conn.z.close()  # the socket is gone before the connection has noticed
            assert conn.dead is None
            with pytest.raises(ActorDied, match="send failed"):
                conn.request({"kind": "call", "endpoint": "echo", "args": [1]}, [], reply=True, waits_next=True)
            assert conn.pending == {}
            conn.scope.cancel()
