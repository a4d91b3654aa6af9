"""Liveness: which sampler and environment actors answer, and what the run does when one does not.

A dead process is the runtime's to report (`ActorDied`, within seconds); a frozen one
(SIGSTOP, a wedged driver, a host that stopped answering) never answers and never dies.
So every sampler rank and environment rank has a `Health` record and a watcher task that
pings it every `[faults] ping_every_s` (`runtime_stats`, answered from the actor's
message loop), unless it answered one of the run's own calls since its last ping (an
episode's end, a weight update: `Health.heard`), which counts as the ping's answer. A
rank that has answered nothing for `unresponsive_after_s` is *unresponsive*: the console
names it once, with the time of its last answer; the calls bound to it are abandoned
(cancelled: the remote side is told), so its rollouts are re-queued and go to ranks that
answer, its weight push starts over later with a keyframe, and it gets no new work. Its
statistics wait (`refresh_stats` never waits for a call that already missed a step's
deadline). When it answers again it rejoins: its sync worker
brings it to the newest weights, and rollouts it produced before the freeze are judged by
the staleness budgets as always. Unresponsive for `give_up_after_s`, it is given up: its
process is stopped and a fresh one started.

Outages: a rank is *lost* from the moment it stops answering (unresponsive, or dead) until
it answers again (rejoined, or respawned and constructed); each outage counts in
`Health.outages` and `outage_s` (the per-pool `up`, `outages` and `outage_s` of
`metrics.jsonl`) and ends with a `sampler.outage` span (pool, rank, host, seconds,
outcome). The console says once that it is lost and once that it is back. A rank on a
`flotilla host` lost for `[faults] host_give_up_after_s` is given up for good (one line):
no more respawns, no work, and the run goes on with the other ranks and pools.

Respawns back off per rank (0.5 s doubling up to `respawn_backoff_max_s`), so a rank whose
respawn keeps failing (its host is unreachable) is retried calmly; the console says once
that it died, then only how many attempts failed, at doubling counts, and when it is back.
A respawn that does not finish within `restart_timeout_s` is stopped by the runtime and
counts as a failed attempt.

Cancellation: the watchers live in the controller's nursery and end with it. A call bound
with `bind` is cancelled by its scope; the caller learns it from `scope.cancelled_caught`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from orchestrator.runtime import ActorDied, span

if TYPE_CHECKING:
    from orchestrator.controller._context import RunContext
    from orchestrator.controller._pools import PoolView

__all__ = ["STATS_WAIT_S", "Health", "bind", "refresh_stats", "watch"]

STATS_WAIT_S = 0.2
"""How long a step's accounting waits for a rank's counters; a rank that misses it is
accounted at a later step, from its cumulative counters (nothing is lost, only deferred)."""

RESPAWN_FIRST_S = 0.5
"""First wait between two respawn attempts of one rank; it doubles on each failure."""


@dataclass(eq=False)
class Health:
    """What the controller knows of one actor rank's liveness (one trio thread: no locks)."""

    label: str  # "sampler h100-fp8/0", "environment actor 0"
    last_answer: float = 0.0  # trio time of its last answer (or of its last (re)start)
    since: float | None = None  # unresponsive since (its last answer); None: responsive
    scopes: set[trio.CancelScope] = field(default_factory=set)  # calls bound to it
    back: trio.Event = field(default_factory=trio.Event)  # set while responsive
    respawns: int = 0  # respawn attempts since it was last up for a while
    next_respawn: float = 0.0  # no respawn attempt before this trio time
    up_since: float | None = None  # first answer since its last (re)start
    host: str | None = None  # the `flotilla host` it runs on (remote pools), else None
    lost_at: float | None = None  # trio time it stopped answering; None while it answers
    outages: int = 0  # times it was lost
    outage_s: float = 0.0  # seconds of its finished outages
    avoid_until: float = 0.0  # trio time before which it gets no new rollout (its link failed one): `avoid`
    retired: bool = False  # given up (its host never came back), or a vacant elastic rank
    present: trio.Event = field(default_factory=trio.Event)  # set while not retired
    on_flip: Callable[[], None] | None = None  # called when it turns (un)responsive, retires, joins or is avoided
    heard: float = -math.inf  # trio time of its latest answer to one of the run's own calls (`watch`)

    def __post_init__(self) -> None:
        self.back.set()
        self.present.set()

    def _flip(self) -> None:
        if self.on_flip is not None:
            self.on_flip()

    def retire(self) -> None:
        self.retired = True
        self.present = trio.Event()
        self._flip()

    def avoid(self, until: float) -> None:
        """No new rollout before trio time `until` (its link failed one)."""
        self.avoid_until = until
        self._flip()

    def join(self, host: str, now: float) -> None:
        """A host takes this (retired) rank: a fresh start there."""
        self.host, self.retired = host, False
        self.since, self.lost_at, self.up_since = None, None, None
        self.respawns, self.next_respawn, self.last_answer = 0, 0.0, now
        self.back.set()
        self.present.set()
        self._flip()

    async def wait_present(self) -> None:
        while self.retired:
            await self.present.wait()

    @property
    def where(self) -> str:
        """What the console adds to a line about this rank: its host, if remote."""
        return f" (host {self.host})" if self.host else ""

    def lost(self, since: float) -> None:
        """It stopped answering at trio time `since` (an outage starts, unless one runs)."""
        if self.lost_at is None:
            self.lost_at = since
            self.outages += 1

    def outage_total(self, now: float) -> float:
        """Seconds lost so far, the outage in progress included."""
        return self.outage_s + (now - self.lost_at if self.lost_at is not None else 0.0)

    def end_outage(self, now: float, pool: str, rank: int, outcome: str) -> float:
        """Close the outage in progress (a `sampler.outage` span); its seconds."""
        if self.lost_at is None:
            return 0.0
        seconds = now - self.lost_at
        self.outage_s += seconds
        self.lost_at = None
        attrs = {"pool": pool, "rank": rank, "host": self.host or "", "seconds": round(seconds, 3)}
        with span("sampler.outage", **attrs, outcome=outcome):
            pass
        return seconds

    @property
    def responsive(self) -> bool:
        return self.since is None

    async def wait_responsive(self) -> None:
        while not self.responsive:
            await self.back.wait()

    def mark_unresponsive(self) -> None:
        self.since = self.last_answer
        self.back = trio.Event()
        if self.on_flip is not None:
            self.on_flip()
        for scope in list(self.scopes):
            scope.cancel()

    def mark_responsive(self) -> None:
        self.since = None
        self.back.set()
        if self.on_flip is not None:
            self.on_flip()


@contextmanager
def bind(scope: trio.CancelScope, *healths: Health) -> Iterator[trio.CancelScope]:
    """Tie `scope` (entered by the caller, around the calls) to the liveness of `healths`:
    cancelled when any of them turns unresponsive, at once if one already is."""
    for h in healths:
        if not h.responsive:
            scope.cancel()
        h.scopes.add(scope)
    try:
        yield scope
    finally:
        for h in healths:
            h.scopes.discard(scope)


def _clock(trio_t: float) -> str:
    """The wall-clock time (HH:MM:SS) of a trio time in the past."""
    return time.strftime("%H:%M:%S", time.localtime(time.time() - (trio.current_time() - trio_t)))


async def watch(
    ctx: RunContext,
    health: Health,
    ping: Callable[[], Awaitable[None]],
    live: Callable[[], bool],
    give_up: Callable[[], None] | None,
    effect: str,
    outage: tuple[str, int] | None = None,
    retire: Callable[[], bool] | None = None,
) -> None:
    """Ping one rank, forever; idle while it is retired (see the module docstring). `live`: the rank is
    neither dead nor (re)starting (the death path and the start own those states);
    `give_up`: stop its process and start a fresh one (None: never; it is waited for);
    `effect`: what the unresponsive line says happens; `outage`: (pool, rank) of a sampler,
    whose outages are traced; `retire`: called while it is lost, True once it is given up
    (the watcher then waits until a host takes the rank: `Health.join`)."""
    f = ctx.cfg.faults
    health.last_answer = ctx.now()
    while True:
        if health.retired or (retire is not None and health.lost_at is not None and retire()):
            await health.wait_present()  # an elastic pool may place a new host on it
            health.last_answer = ctx.now()
            continue
        if not live():
            health.last_answer, health.up_since = ctx.now(), None
            if not health.responsive:  # respawned (given up, or died meanwhile): a new process
                health.mark_responsive()
            await trio.sleep(f.ping_every_s)
            continue
        if health.responsive and health.up_since is not None and health.heard > health.last_answer:
            # It answered one of the run's own calls (an episode, a weight update) since the
            # last evidence: as good as a ping, and a busy fleet's ranks need none.
            _answered(ctx, health, health.heard, outage)
            await trio.sleep_until(health.heard + f.ping_every_s)
            continue
        if health.responsive:
            deadline = health.last_answer + f.unresponsive_after_s
        elif give_up is not None:
            assert health.since is not None
            deadline = health.since + f.give_up_after_s
        else:
            deadline = math.inf
        answered = False
        with trio.move_on_at(deadline):
            try:
                await ping()
                answered = True
            except ActorDied:
                pass  # gone: the supervisor respawns it; `live` tells once it is marked
        now = ctx.now()
        if answered:
            _answered(ctx, health, now, outage)
            await trio.sleep(f.ping_every_s)
        elif now < deadline:
            await trio.sleep(f.ping_every_s)  # ActorDied: never spin on a dead connection
        elif health.responsive:
            health.mark_unresponsive()
            health.lost(health.last_answer)
            ctx.progress.message(
                f"{health.label} is unresponsive: no answer since {_clock(health.last_answer)} "
                f"({now - health.last_answer:.1f} s){health.where}; {effect}"
            )
            ctx.notify()
        else:
            ctx.progress.message(
                f"{health.label}: unresponsive for {now - (health.since or now):.0f} s, giving up "
                f"on it; stopping its process and starting a fresh one"
            )
            give_up()
            # A fresh process: judged from now (while it starts, `live` is false).
            health.mark_responsive()
            health.last_answer, health.up_since = now, None
            ctx.notify()


def _answered(ctx: RunContext, health: Health, now: float, outage: tuple[str, int] | None) -> None:
    if not health.responsive:
        assert health.since is not None
        ctx.progress.message(
            f"{health.label} answers again after {now - health.since:.1f} s unresponsive{health.where}; "
            "it rejoins the run"
        )
        health.mark_responsive()
        if outage is not None:
            health.end_outage(now, *outage, outcome="rejoined")
        health.lost_at = None
        ctx.notify()
        ctx.bump_versions()
    health.last_answer = now
    if health.up_since is None:  # first answer of a (re)started process
        health.up_since = now
        if health.lost_at is not None:  # it had died: back as a fresh process
            down = now - health.lost_at
            n = health.respawns
            ctx.progress.message(
                f"{health.label} is back after {down:.1f} s down "
                f"({n} respawn attempt{'s' if n != 1 else ''}){health.where}"
            )
            if outage is not None:
                health.end_outage(now, *outage, outcome="respawned")
            health.lost_at = None
        ctx.notify()
    elif health.respawns and now - health.up_since >= ctx.cfg.faults.respawn_backoff_max_s:
        health.respawns = 0  # up for a while: a later death starts the back-off afresh


def respawn_due(ctx: RunContext, health: Health) -> bool:
    """Whether a respawn attempt of this dead rank may run now; if so, counts it, schedules
    the next one no sooner than the back-off allows and says so on the console (once, then
    at doubling attempt counts)."""
    now = ctx.now()
    if now < health.next_respawn:
        return False
    health.respawns += 1
    health.lost(now)
    n = health.respawns
    wait = min(ctx.cfg.faults.respawn_backoff_max_s, RESPAWN_FIRST_S * 2 ** (n - 1))
    health.next_respawn = now + wait
    if n == 1:
        ctx.progress.message(f"{health.label} died{health.where}; respawning it")
    elif n & (n - 1) == 0:  # 2, 4, 8, ...
        ctx.progress.message(f"{health.label} still down: {n} respawn attempts so far; next in {wait:g} s")
    return True


async def refresh_stats(ctx: RunContext, pool: PoolView, wait_s: float = STATS_WAIT_S) -> None:
    """Ask every responsive rank of `pool` without a call outstanding for its counters
    (into `pool.stats`), and wait up to `wait_s` for those answers; a call that takes longer
    keeps running beside the run and lands in `pool.stats` when it answers."""
    started: list[trio.Event] = []
    for rank in range(pool.link.size):
        if pool.stats_call[rank] is None and pool.health[rank].responsive:
            done = pool.stats_call[rank] = trio.Event()
            ctx.nursery.start_soon(_fetch_stats, pool, rank, done)
            started.append(done)
    with trio.move_on_after(wait_s):
        for done in started:
            await done.wait()


async def _fetch_stats(pool: PoolView, rank: int, done: trio.Event) -> None:
    epoch = pool.epochs[rank]
    try:
        st: Any = await pool.link.rank_stats(rank)
        if pool.epochs[rank] == epoch:  # not a process replaced meanwhile
            pool.stats[rank] = st
    finally:
        pool.stats_call[rank] = None
        done.set()
