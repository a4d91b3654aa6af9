"""Weight sync: one worker per sampler keeps it at the trainer's newest version.

Deltas when the sampler holds a version the publisher knows, a keyframe when it holds
nothing trustworthy (start, respawn, a refused update); a keyframe travels in parts
(`_stream`), so neither the controller nor the sampler holds two copies of it. After the trainer went back to
a checkpoint (version -2 here), the sampler first forgets its version, so that the
older keyframe is accepted. The sampler keeps generating while it applies (in-flight
updates).

A sampler cut off mid-update (its link lost, or it stopped answering) holds what it held,
or the update it was sent if that landed: the controller does not know which (`UNKNOWN`).
When it answers again the worker asks it (`have_version`) and sends the cheaper of the
delta chain from there and the newest keyframe (the publisher's choice); an update that
landed meanwhile makes that chain refused, and a keyframe follows.

Ranks that hold the same version ask the trainer once for their path (`_stream.SharedPaths`),
and their acknowledgements travel in batches (`ack_worker`).

Failure: a dead sampler is respawned and gets a keyframe; a dead trainer is reported to
the trainer loop, which restores it, and waited for; every retry backs off, so no worker
spins on a dead actor. A sampler that stops answering (`_liveness`) has its update
abandoned and gets none until it answers again, then a reset and a keyframe.
"""

from __future__ import annotations

import trio

from orchestrator.controller._context import Backoff, RunContext
from orchestrator.controller._liveness import bind
from orchestrator.controller._pools import PoolView
from orchestrator.controller._stream import KeyframeGone, send_path
from orchestrator.runtime import ActorDied, ActorError, span

__all__ = ["UNKNOWN", "ack_worker", "sync_worker"]

UNKNOWN = -3
"""`PoolView.versions` of a rank whose held version the controller must ask it for."""


async def sync_worker(ctx: RunContext, pool: PoolView, rank: int) -> None:
    receiver = pool.receiver(rank)
    precision = pool.link.config.precision
    health = pool.health[rank]
    backoff = Backoff()
    while True:
        await health.wait_present()  # a vacant elastic rank gets weights once a host joins
        while pool.versions[rank] >= ctx.version:
            await ctx.wait_bump()
        await ctx.trainer_alive.wait()
        await health.wait_responsive()
        have = pool.versions[rank]
        scope = trio.CancelScope()
        try:
            # Abandoned when the sampler stops answering: it gets a keyframe once it does.
            with (
                bind(scope, health),
                scope,
                span(
                    "weights.apply",
                    pool=pool.name,
                    rank=rank,
                    precision=precision,
                    from_version=have,
                    to_version=ctx.version,
                ) as s,
            ):
                if have == -2:
                    await pool.link.reset_weights(rank)
                    have = pool.versions[rank] = -1
                elif have == UNKNOWN:
                    held = await pool.link.have_version(rank)
                    have = pool.versions[rank] = -1 if held is None or held > ctx.version else held
                    s.set_attribute("from_version", have)
                path = await ctx.paths.get(receiver, have, precision, ctx.version)
                now, wire = await send_path(ctx.links.trainer, pool.link, rank, precision, path)
                s.set_attribute("messages", len(path["deltas"]) + (path["keyframe"] is not None))
                s.set_attribute("keyframe", path["keyframe"] is not None)
                s.set_attribute("wire_bytes", wire)
                ctx.acks.add(precision, receiver, now)
        except KeyframeGone as e:
            # The trainer published a newer keyframe mid-stream; the sampler's unfinished
            # stream is void (its engine keeps the weights it had): start over.
            ctx.progress.message(f"{e}; streaming the newer keyframe to {receiver}")
            if pool.versions[rank] != -2:  # a pending reset (trainer went back) comes first
                pool.versions[rank] = -1
            await backoff.wait()
            continue
        except ActorDied as e:
            if rank in pool.link.dead_ranks():
                ctx.respawn_dead()
            else:
                if ctx.links.trainer.is_dead():  # the trainer loop restores it
                    ctx.report_trainer_death(e)
                elif pool.versions[rank] >= 0:  # the sampler's link went down mid-update
                    pool.versions[rank] = UNKNOWN
            await backoff.wait()
            continue
        except ActorError as e:
            # The sampler refused the update (hash mismatch, gap): it keeps its last good
            # weights; ask for a keyframe next.
            ctx.progress.repeated(
                ("weights refused", receiver),
                f"sampler {receiver} refused weights; sending a keyframe ({e.remote_type}: {e.message})",
            )
            pool.versions[rank] = -1
            await backoff.wait()
            continue
        if scope.cancelled_caught:
            # Unresponsive mid-update: what it holds once it answers is unknown (the
            # abandoned update may still land); it is asked then.
            if pool.versions[rank] != -2:
                pool.versions[rank] = UNKNOWN
            continue
        backoff.reset()
        health.heard = ctx.now()  # it answered (`_liveness.watch`)
        if pool.versions[rank] != -2:  # unless the trainer went back meanwhile
            pool.versions[rank] = now
        ctx.notify()  # the producer tells the scheduler before its next placement


async def ack_worker(ctx: RunContext) -> None:
    """Tells the trainer which versions the samplers applied, so that its publisher can let
    go of deltas no sampler needs: one call per precision for every acknowledgement that
    arrived while the last call was in flight (a fleet's ranks finish an update within
    moments of each other). An acknowledgement lost with a dead trainer costs nothing: the
    restored trainer starts every sampler over from a keyframe."""
    while True:
        for precision, held in (await ctx.acks.take()).items():
            await ctx.trainer_alive.wait()
            try:
                await ctx.links.trainer.acks(precision, held)
            except ActorDied as e:
                if ctx.links.trainer.is_dead():
                    ctx.report_trainer_death(e)
            except ActorError as e:
                ctx.progress.repeated(
                    ("acks refused",), f"the trainer refused weight acknowledgements ({e.remote_type}: {e.message})"
                )
