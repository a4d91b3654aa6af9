"""``Gateway``: the HTTP server of one environment actor and its open sessions."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

import trio

from actors.chat import ChatFormat
from actors.gateway._app import build_app, serve_gateway
from actors.gateway._session import Session, SessionLimits
from actors.sampler import GenerateRequest, GenerateResult
from actors.types import TaskSpec

__all__ = ["Gateway"]


class Gateway:
    """Sessions keyed by id, served over HTTP by ``serve`` (see ``actors.gateway._app``).

    Args:
        fmt: the model's chat format (renders requests into ids, parses replies).
        model_name: the name ``GET /v1/models`` lists.
        host / port: where to listen (port 0: any free port).
    """

    def __init__(
        self, fmt: ChatFormat, *, model_name: str = "flotilla", host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.fmt = fmt
        self.model_name = model_name
        self.host, self.port = host, port
        self.sessions: dict[str, Session] = {}
        self.address: str | None = None
        """``http://host:port`` once serving."""
        self.app = build_app(self.sessions.get, model_name)
        self.opened = 0
        self.segments = 0
        self.dropped_generated = 0

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; reports the address once listening."""
        async with trio.open_nursery() as nursery:
            self.address = await nursery.start(serve_gateway, self.app, self.host, self.port)
            task_status.started(self.address)

    def open_session(
        self,
        task: TaskSpec,
        generate: Callable[[GenerateRequest], Awaitable[GenerateResult]],
        limits: SessionLimits,
        min_version: int,
    ) -> Session:
        """A new session for one episode; its key is also its URL segment."""
        if self.address is None:
            raise RuntimeError("the gateway is not serving yet")
        sid = f"fl-{uuid.uuid4().hex}"
        session = Session(sid, task, self.fmt, generate, limits, min_version, model=self.model_name)
        self.sessions[sid] = session
        self.opened += 1
        return session

    def close_session(self, session: Session) -> None:
        """End a session: later requests to it get 404/401; its segments are counted."""
        session.closed = True
        self.sessions.pop(session.id, None)
        stats = session.segment_stats()
        self.segments += stats["segments"]
        self.dropped_generated += stats["dropped_generated"]
