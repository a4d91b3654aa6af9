"""Logs that cannot flood: a per-key rate limit for lines, and a bound on their length.

A flood of identical events (a peer sending malformed frames, an environment that
fails every episode, an actor respawned again and again) must not become a flood of
lines: the first event of a key in each interval is shown, with how many were
suppressed since the last shown one. A value that comes from outside (a wire message's
fields, a harness's stderr, an error text) goes into a line through `clip`, so one
line stays one bounded line.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable

__all__ = ["CLIP_CHARS", "RateLimiter", "clip"]

CLIP_CHARS = 300
"""Characters of an outside value a log line shows (the rest is counted)."""


def clip(text: object, limit: int = CLIP_CHARS) -> str:
    """`text` (str() of it) as one line of at most `limit` characters plus a count of the
    rest: line breaks are shown as ``\\n``, and a longer text ends in ``... (N more)``."""
    s = str(text).replace("\r", "\\r").replace("\n", "\\n")
    if len(s) <= limit:
        return s
    return f"{s[:limit]}... ({len(s) - limit} more)"


class RateLimiter:
    """`allow(key)` is True at most once per `interval_s` per key; thread-safe.

    `suppressed(key)` is how many events of `key` were refused since it was last
    allowed; `log(key, message)` is the usual use: emit `message` (plus that count)
    through `emit` when allowed. Keys are kept until `max_keys` is reached, then the
    oldest are forgotten (a forgotten key is simply allowed again).
    """

    def __init__(
        self, interval_s: float = 1.0, *, max_keys: int = 4096, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.interval_s = interval_s
        self._max_keys = max_keys
        self._clock = clock
        self._last: dict[Hashable, float] = {}
        self._dropped: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def allow(self, key: Hashable) -> bool:
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._dropped[key] = self._dropped.get(key, 0) + 1
                return False
            self._last.pop(key, None)
            self._last[key] = now  # re-inserted: dict order is recency of the last allowed event
            if len(self._last) > self._max_keys:
                oldest = next(iter(self._last))
                del self._last[oldest]
                self._dropped.pop(oldest, None)
            return True

    def suppressed(self, key: Hashable) -> int:
        with self._lock:
            return self._dropped.get(key, 0)

    def log(self, key: Hashable, message: str, emit: Callable[[str], None]) -> bool:
        """Emit `message` if `key` is allowed now, noting the events suppressed since the
        last line of that key; returns whether it was emitted."""
        if not self.allow(key):
            return False
        with self._lock:
            dropped = self._dropped.pop(key, 0)
        emit(message + (f" (and {dropped} more like it since the last line)" if dropped else ""))
        return True
