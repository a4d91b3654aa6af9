"""Elastic pools: hosts that join a running run, and places that hosts leave.

An elastic pool (`[[pools]] elastic = true`) has `max_hosts` sampler ranks, one per host.
Ranks without a host are *vacant* (`Health.retired`): no work, no weights, no respawns. A
worker per elastic pool reads the pool's candidates every `JOIN_POLL_S` (its `hosts` and
the lines of its `hosts_file`); a candidate not in the pool is probed (a ping over
CurveZMQ with the key the pool expects) and, when it answers and a rank is vacant, takes
that rank: its sampler starts on the host (`PoolLink.place`), gets a keyframe from its
sync worker, then work (one console line, a `sampler.join` span). A host that refuses the
controller's key, or presents another, is named once and probed again later. A rank
whose host is given up (`[faults] host_give_up_after_s`) is vacant again, so a host that
comes back later, or another, can take it.

Cancellation: the worker lives in the controller's nursery and ends with it; a probe in
progress is abandoned.
"""

from __future__ import annotations

import trio

from orchestrator.controller._context import RunContext
from orchestrator.controller._pools import PoolView
from orchestrator.runtime import span

__all__ = ["JOIN_POLL_S", "elastic_worker"]

JOIN_POLL_S = 1.0
"""Seconds between two reads of an elastic pool's candidate hosts."""


async def elastic_worker(ctx: RunContext, pool: PoolView) -> None:
    refused: set[str] = set()  # hosts whose refusal the console named (once each)
    while True:
        present = {h.host for h in pool.health if h.host is not None and not h.retired}
        for address in pool.link.candidates():
            vacant = [r for r, h in enumerate(pool.health) if h.retired]
            if not vacant:
                break
            if address in present:
                continue
            reason = await pool.link.probe(address)
            if reason is not None:
                if address not in refused:
                    refused.add(address)
                    ctx.progress.message(f"pool {pool.name}: host {address} cannot join yet: {reason}")
                continue
            refused.discard(address)
            join(ctx, pool, vacant[0], address)
            present.add(address)
        await trio.sleep(JOIN_POLL_S)


def join(ctx: RunContext, pool: PoolView, rank: int, address: str) -> None:
    """Place vacant sampler `rank` of `pool` on the (probed) host `address`."""
    pool.link.place(rank, address)
    pool.health[rank].join(address, ctx.now())
    pool.versions[rank] = -1  # a fresh process: a keyframe first
    pool.marks[rank] = (0, 0.0)
    pool.stats[rank] = None
    pool.epochs[rank] += 1
    with span("sampler.join", pool=pool.name, rank=rank, host=address):
        pass
    ctx.progress.message(
        f"pool {pool.name}: host {address} joins as sampler {pool.name}/{rank}; it gets a keyframe, then work"
    )
    ctx.bump_versions()
    ctx.notify()
