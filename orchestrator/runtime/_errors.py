"""Exceptions the runtime raises at callers."""

from __future__ import annotations

__all__ = ["ActorDied", "ActorError", "WireError"]


class ActorError(Exception):
    """An endpoint raised: the remote exception's type name, message and traceback text.

    The actor that raised keeps serving; only this call failed.
    """

    def __init__(self, remote_type: str, message: str, traceback_text: str) -> None:
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type
        self.message = message
        self.traceback_text = traceback_text

    def __str__(self) -> str:
        return f"{self.remote_type}: {self.message}\n--- remote traceback ---\n{self.traceback_text}"


class ActorDied(Exception):
    """The actor process is gone (crash, kill, OOM, lost connection) or refused us.

    Raised for every call pending on the actor when it dies and for every later
    call until the owner of the mesh respawns the rank.
    """

    def __init__(self, name: str, rank: int, reason: str) -> None:
        super().__init__(f"actor {name}[{rank}] died: {reason}")
        self.name = name
        self.rank = rank
        self.reason = reason


class WireError(ValueError):
    """A message that does not follow the wire format (bad header, frames or sizes)."""
