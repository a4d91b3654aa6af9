"""Environment faults in a real EnvActor process: stuck threads, a blocked event loop,
checks before any actor starts."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import trio

from actors.env import EnvActor, EnvConfig, Environment, StepOutcome, TaskCheckError, check_task, make_task_specs
from actors.env._interface import task_factory
from actors.env._threads import EnvCallTimeout, EnvThreads
from actors.env._watchdog import LoopWatchdog
from actors.types import SamplingParams, TaskSpec
from orchestrator.runtime import open_mesh
from tests.unit.actors.env_actors import ScriptedSampler

HELPERS = "tests.unit.actors.env_actors"
ENV = {"OMP_NUM_THREADS": "1"}
SAMPLING = SamplingParams(temperature=1.0, top_k=64, top_p=0.97, max_new_tokens=1)


@pytest.mark.slow
async def test_stuck_plain_env_uses_only_its_own_threads_and_a_blocking_async_env_is_named() -> None:
    cfg = EnvConfig(step_timeout_s=0.5, env_threads=3, loop_stall_s=0.5, task_modules=[HELPERS])
    async with (
        open_mesh(ScriptedSampler, procs=1, name="sampler", env=ENV) as sm,
        open_mesh(EnvActor, cfg, procs=1, name="env", env=ENV) as em,
    ):
        run = em[0].run_episode
        stuck = [TaskSpec(task="test_stuck_reset", prompt_id=f"s{i}", group_id="g") for i in range(12)]
        errors: list[str] = []

        async def play(spec: TaskSpec) -> None:
            t = await run.call_one(sm[0], spec, SAMPLING, 0)
            assert t.failed
            errors.append(t.error or "")

        with trio.fail_after(60):
            # 12 stuck calls in waves of 4 against 3 threads: every one fails at its timeout
            for wave in range(3):
                async with trio.open_nursery() as n:
                    for spec in stuck[4 * wave : 4 * wave + 4]:
                        n.start_soon(play, spec)
            # ...and another task still runs: its threads are its own (without a free thread
            # its calls would fail with "no free thread")
            for spec in make_task_specs("guess_number", 4, 1):
                t = await run.call_one(sm[0], spec, SAMPLING, 0)
                assert not t.failed, t.error
            st = await em[0].stats.call_one()
        assert st["stuck_calls"] == {"test_stuck_reset": 3} and st["stuck_calls_total"] == {"test_stuck_reset": 3}
        assert sum("thread is still running" in e for e in errors) == 3
        assert sum("found no free thread" in e and "all 3 threads of task 'test_stuck_reset'" in e for e in errors) == 9

        # an async env that sleeps without awaiting: the watchdog names it
        with trio.fail_after(30):
            t = await run.call_one(sm[0], TaskSpec(task="test_blocks_loop", prompt_id="b", group_id="g"), SAMPLING, 0)
            # A stall is counted when the blocking loop step ends, and that step may also have
            # sent the episode's reply and answered a stats call that was already waiting.
            st = await em[0].stats.call_one()
            while st["loop_stalls"] < 1:
                await trio.sleep(0.05)
                st = await em[0].stats.call_one()
        assert not t.failed and t.reward == 1.0
        assert st["loop_stalls"] >= 1 and st["loop_stall_longest_s"] >= 1.0
        assert "BlocksLoop.step" in st["loop_stall_last"] and "test_blocks_loop" in st["loop_stall_last"]


async def test_env_threads_count_a_stuck_call_until_its_thread_returns() -> None:
    threads = EnvThreads(per_task=1)
    release = __import__("threading").Event()
    with pytest.raises(EnvCallTimeout, match="still running"):
        await threads.run("t", release.wait, timeout=0.2, what="reset")
    assert threads.stuck() == {"t": 1}
    with pytest.raises(EnvCallTimeout, match="no free thread"):
        await threads.run("t", lambda: 1, timeout=0.2, what="step")
    assert await threads.run("other", lambda: 2, timeout=1, what="step") == 2
    release.set()
    with trio.fail_after(5):
        while threads.stuck():
            await trio.sleep(0.01)
    assert await threads.run("t", lambda: 3, timeout=1, what="step") == 3
    assert threads.stuck_total() == {"t": 1}


async def test_watchdog_reports_the_labelled_blocker_once_per_stall() -> None:
    lines: list[str] = []
    dog = LoopWatchdog(lines.append, threshold_s=0.2, poll_s=0.02)
    async with trio.open_nursery() as n:
        await n.start(dog.run)
        with dog.label("async environment Slow.step (task 'slow')"):
            time.sleep(0.6)  # blocks the loop, as a careless async env would
        await trio.sleep(0.05)
        time.sleep(0.3)  # an unlabelled stall: named by its trio task
        await trio.sleep(0.05)
        n.cancel_scope.cancel()
    assert dog.stalls == 2 and dog.longest_s >= 0.6
    assert len(lines) == 2 and "Slow.step (task 'slow')" in lines[0] and "blocked the event loop" in lines[0]
    assert "trio task" in lines[1]
    if sys.platform == "linux":  # the kernel's per-thread counters say what the thread did
        assert all("in a blocking call" in line for line in lines), lines


async def test_watchdog_tells_computing_from_a_blocking_call() -> None:
    lines: list[str] = []
    dog = LoopWatchdog(lines.append, threshold_s=0.2, poll_s=0.02)
    async with trio.open_nursery() as n:
        await n.start(dog.run)
        end = time.perf_counter() + 1.0  # well past the threshold: the watchdog's thread
        while time.perf_counter() < end:  # CPU work on the loop (needs the GIL to see it)
            pass
        await trio.sleep(0.05)
        n.cancel_scope.cancel()
    assert len(lines) == 1 and "blocked the event loop" in lines[0]
    if sys.platform == "linux":
        assert "computing" in lines[0], lines


@pytest.mark.skipif(
    sys.platform != "linux" or len(os.sched_getaffinity(0)) < 2, reason="Linux scheduler counters, two cores"
)
def test_watchdog_says_when_the_loop_waited_for_a_cpu() -> None:
    """A loop thread that is runnable but not run (a busier process holds its only core)
    is reported as starved, not as an environment that blocks."""
    core = min(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    lines: list[str] = []
    try:
        os.sched_setaffinity(hog.pid, {core})

        async def starved_loop() -> None:
            dog = LoopWatchdog(lines.append, threshold_s=0.3, poll_s=0.02)
            async with trio.open_nursery() as n:
                await n.start(dog.run)
                # this thread alone: lowest priority, on the hog's core, computing
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
                os.sched_setaffinity(0, {core})
                end = time.perf_counter() + 1.0
                while time.perf_counter() < end:
                    pass
                os.sched_setaffinity(0, os.sched_getaffinity(os.getpid()) - {core})  # runs again, elsewhere
                await trio.sleep(0.05)
                n.cancel_scope.cancel()

        thread = threading.Thread(target=trio.run, args=(starved_loop,))  # a thread of its own: its nice value stays
        thread.start()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        hog.kill()
        hog.wait()
    assert len(lines) == 1 and "waited for a CPU" in lines[0] and "may not be at fault" in lines[0], lines


async def test_plain_methods_run_in_threads_unless_the_env_says_they_never_block() -> None:
    import threading

    from actors.env._episode import EnvCalls, _call_env

    class Threaded(Environment):
        def reset(self, task: TaskSpec) -> int:
            return threading.get_ident()

    class Inline(Threaded):
        blocking = False

        def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
            time.sleep(0.4)  # a class that wrongly says it never blocks: the loop stalls
            return StepOutcome(observation="", done=True)

    lines: list[str] = []
    dog = LoopWatchdog(lines.append, threshold_s=0.2, poll_s=0.02)
    calls = EnvCalls(threads=EnvThreads(per_task=2), watchdog=dog)
    spec = TaskSpec(task="t", prompt_id="p", group_id="g")
    loop = threading.get_ident()
    async with trio.open_nursery() as n:
        await n.start(dog.run)
        threaded, inline = Threaded(), Inline()
        assert await _call_env(calls, threaded, "t", threaded.reset, spec, timeout=5, what="reset") != loop
        assert await _call_env(calls, inline, "t", inline.reset, spec, timeout=5, what="reset", blocking=False) == loop
        await _call_env(calls, inline, "t", inline.step, "", [], timeout=0.1, what="step", blocking=False)
        await trio.sleep(0.05)
        n.cancel_scope.cancel()
    # on the loop the timeout cannot fire (the call returned), and the watchdog names the call
    assert len(lines) == 1 and "plain environment Inline.step (task 't')" in lines[0]
    assert Environment.blocking and not any(
        task_factory(t).blocking for t in ("guess_number", "arithmetic", "sum_mod", "reverse", "sort")
    )


def test_check_task_names_the_problem_before_any_actor_starts() -> None:
    check_task("guess_number", {"n": 7, "max_turns": 3})
    with pytest.raises(TaskCheckError, match=r"^task.name: unknown task 'nope' \(registered: .*guess_number"):
        check_task("nope")
    with pytest.raises(TaskCheckError, match=r"^task.params: task 'guess_number' rejected .*n=1 must be in"):
        check_task("guess_number", {"n": 1})
    with pytest.raises(TaskCheckError, match=r"^task.params: task 'guess_number' does not take .*colour"):
        check_task("guess_number", {"colour": "red"})
    with pytest.raises(TaskCheckError, match=r"^task.modules: cannot import 'no_such_module_x'"):
        check_task("guess_number", {}, ["no_such_module_x"])
    check_task("test_validated", {"level": 2}, [HELPERS])  # validate_params, never constructed
    with pytest.raises(TaskCheckError, match="level must be in 1..3"):
        check_task("test_validated", {"level": 9}, [HELPERS])


def test_check_task_loads_a_task_module_given_as_a_file(tmp_path) -> None:
    path = tmp_path / "my_games.py"
    path.write_text(
        "from actors.env import GuessNumber, register_task\n"
        "@register_task('file_task_game')\n"
        "class FileGame(GuessNumber):\n"
        "    pass\n"
    )
    check_task("file_task_game", {"n": 7}, [str(path)])
    with pytest.raises(TaskCheckError, match=r"^task.modules: cannot import .*nowhere.py.*FileNotFoundError"):
        check_task("file_task_game", {}, [str(tmp_path / "nowhere.py")])
