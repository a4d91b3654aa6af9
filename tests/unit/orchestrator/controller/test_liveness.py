"""Frozen and unreachable actors over in-memory links: a frozen sampler is named once and
avoided while the other pool trains, and rejoins when it thaws; one frozen past the limit is
replaced; a rank whose respawn keeps failing is retried with back-off and one line. Time is
trio's MockClock: the waits cost nothing."""

from __future__ import annotations

import io

import trio

from orchestrator.state.progress import Progress

from .fakes import FakeEnvs, Harness, run_config


class TimedEnvs(FakeEnvs):
    """FakeEnvs that note when each episode started, and whether its sampler was frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.starts: list[tuple[float, str, bool]] = []

    async def run_episode(self, pool, rank, task, sampling, min_version, env_rank, hold=False):
        self.starts.append((trio.current_time(), pool.config.name, rank in pool.frozen))
        return await super().run_episode(pool, rank, task, sampling, min_version, env_rank, hold)


def _console(h: Harness) -> io.StringIO:
    out = io.StringIO()
    h.controller.ctx.progress = Progress(h.cfg.steps, stream=out)
    return out


async def _until(h: Harness, step: int) -> None:
    while h.state.step < step:
        await trio.sleep(0.05)


async def test_a_frozen_sampler_is_named_once_avoided_and_rejoins(autojump_clock):
    h = Harness(run_config(steps=30, faults={"unresponsive_after_s": 3.0}), envs=TimedEnvs())
    out = _console(h)
    cheap = h.pools["cheap"]
    with trio.fail_after(3600):
        async with trio.open_nursery() as n:
            n.start_soon(h.controller.run)
            await _until(h, 4)
            cheap.freeze(0)
            frozen_at, step_at_freeze = trio.current_time(), h.state.step
            await _until(h, step_at_freeze + 10)  # trains on the other pool meanwhile
            # Hedged rollouts keep the steps going faster than the watcher names it.
            await trio.sleep_until(frozen_at + h.cfg.faults.unresponsive_after_s + 2 * h.cfg.faults.ping_every_s)
            thawed_at = trio.current_time()
            cheap.thaw(0)
    lines = out.getvalue().splitlines()
    named = [ln for ln in lines if "sampler cheap/0 is unresponsive" in ln]
    assert len(named) == 1, lines
    assert any("sampler cheap/0 answers again" in ln for ln in lines), lines
    assert not any("giving up" in ln for ln in lines)
    assert h.state.step == 30
    detected = frozen_at + 3.0 + h.cfg.faults.ping_every_s + 0.1
    assert not [s for s in h.envs.starts if detected < s[0] < thawed_at and s[1] == "cheap"]
    assert any(s[1] == "cheap" and s[0] > thawed_at for s in h.envs.starts), "it never rejoined"
    assert cheap.respawns == 0
    c = h.controller.counts()
    assert c["groups_in"] == c["groups_trained"] + c["groups_buffered"] + c["groups_skipped"]


class CountedPings(FakeEnvs):
    """FakeEnvs that count the controller's pings."""

    def __init__(self) -> None:
        super().__init__(episode_s=0.2)
        self.pings = 0

    async def ping(self, rank: int) -> None:
        self.pings += 1
        await super().ping(rank)


async def test_ranks_that_answer_the_runs_own_calls_are_not_pinged_and_a_frozen_one_still_is(autojump_clock):
    # Episodes end every 0.2 s and weights land every step: answers enough that a watcher
    # pings only when a rank fell silent. A frozen sampler is still named within its limit.
    h = Harness(run_config(steps=150, faults={"ping_every_s": 0.5, "unresponsive_after_s": 3.0}), envs=CountedPings())
    out = _console(h)
    cheap = h.pools["cheap"]
    pings = {name: 0 for name in h.pools}
    for name, pool in h.pools.items():
        ping = pool.ping

        async def counted(rank: int, name: str = name, ping=ping) -> None:
            pings[name] += 1
            await ping(rank)

        pool.ping = counted  # type: ignore[method-assign]
    with trio.fail_after(3600):
        async with trio.open_nursery() as n:
            n.start_soon(h.controller.run)
            await _until(h, 120)
            quiet = trio.current_time()
            env_pings, sampler_pings = h.envs.pings, dict(pings)
            cheap.freeze(0)
            frozen_at = trio.current_time()
            while "sampler cheap/0 is unresponsive" not in out.getvalue():
                await trio.sleep(0.1)
            named_at = trio.current_time()
            cheap.thaw(0)
    # Pinging every ping_every_s would be a ping per rank per 0.5 s.
    intervals = quiet / h.cfg.faults.ping_every_s
    assert env_pings <= 0.1 * intervals, (env_pings, intervals)
    assert all(p <= 0.5 * intervals for p in sampler_pings.values()), (sampler_pings, intervals)
    assert named_at - frozen_at <= 3.0 + 2 * h.cfg.faults.ping_every_s + 0.5, named_at - frozen_at
    assert h.state.step == 150


async def test_a_sampler_frozen_past_the_limit_is_replaced(autojump_clock):
    h = Harness(run_config(steps=200, faults={"unresponsive_after_s": 2.0, "give_up_after_s": 10.0}))
    out = _console(h)
    cheap = h.pools["cheap"]
    with trio.fail_after(3600):
        async with trio.open_nursery() as n:
            n.start_soon(h.controller.run)
            await _until(h, 3)
            cheap.freeze(0)  # never thawed: only a fresh process answers
            while cheap.respawns == 0 and h.state.step < 200:
                await trio.sleep(0.5)
            replaced_at = h.state.step
    text = out.getvalue()
    assert text.count("sampler cheap/0 is unresponsive") == 1, text
    assert text.count("sampler cheap/0: unresponsive for") == 1, text
    assert cheap.respawns == 1 and not cheap.frozen and replaced_at < 200
    assert h.state.step == 200


async def test_a_respawn_that_keeps_failing_backs_off_and_is_said_once(autojump_clock):
    h = Harness(run_config(steps=300, faults={"respawn_backoff_max_s": 8.0}), envs=FakeEnvs(episode_s=0.5))
    out = _console(h)
    cheap = h.pools["cheap"]
    with trio.fail_after(3600):
        async with trio.open_nursery() as n:
            n.start_soon(h.controller.run)
            await _until(h, 3)
            cheap.down_until = trio.current_time() + 60.0
            cheap.kill(0)
            step_at_loss = h.state.step
            while trio.current_time() < cheap.down_until:
                await trio.sleep(0.5)
            assert h.state.step > step_at_loss + 5, "the other pool did not keep training"
    text = out.getvalue()
    assert text.count("sampler cheap/0 died; respawning it") == 1, text
    # 0.5, 1, 2, 4, then every 8 s: about a dozen attempts in a minute, not one per tick.
    assert cheap.respawn_calls <= 14, cheap.respawn_calls
    assert text.count("still down") <= 4, text
    assert "sampler cheap/0 is back after" in text, text
    assert h.state.step == 300


async def test_a_run_that_makes_no_progress_says_once_what_it_waits_on(autojump_clock):
    faults = {"stall_warn_s": 20.0, "give_up_after_s": 100.0}
    h = Harness(run_config(steps=12, faults=faults), envs=FakeEnvs(episode_s=0.5))
    out = _console(h)
    with trio.fail_after(3600):
        async with trio.open_nursery() as n:
            n.start_soon(h.controller.run)
            await _until(h, 4)
            assert "no rollout finished" not in out.getvalue()  # steps every second or so: no stall
            for pool in h.pools.values():
                pool.freeze(0)  # every sampler: nothing can finish until they are replaced
    lines = [ln for ln in out.getvalue().splitlines() if "no rollout finished" in ln]
    assert len(lines) == 1, out.getvalue()  # once per stall, though it lasted ~100 s
    (line,) = lines
    assert "pool cheap: 0 of 1 sampler(s) usable" in line and "pool dear: 0 of 1 sampler(s) usable" in line, line
    assert "1 of 1 environment actor(s) answering" in line and "trainer up at v" in line, line
    assert h.state.step == 12  # the replaced samplers trained the rest
