"""Ctrl-C: the first finishes the step in progress, checkpoints, writes the reports and
returns normally; a second abandons the step in progress."""

from __future__ import annotations

import signal

import trio

from orchestrator.controller._context import RunContext

__all__ = ["watch_sigint"]


def request_stop(ctx: RunContext) -> None:
    if not ctx.stopping:
        ctx.progress.message("interrupt: finishing the current step, then checkpointing (Ctrl-C again to abandon it)")
        ctx.stopping = ctx.interrupted = True
        ctx.notify()


async def watch_sigint(
    ctx: RunContext, cancel_scope: trio.CancelScope, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        task_status.started()
        async for _ in signals:
            if not ctx.stopping:
                request_stop(ctx)
            else:
                ctx.abandoned = True
                cancel_scope.cancel()
