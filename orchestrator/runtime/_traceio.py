"""Which spans are written, and where: the sampler, the span processor and the capped JSONL file.

Sampling is decided once per trace, at its root, and travels with the trace context
(the W3C ``traceparent`` flags ride in every request header), so a sampled rollout keeps
every span it opens in every process, and an unsampled one costs each process only
non-recording spans. The policy (``SamplingPolicy``):

- a root span is sampled when its trace id falls under ``ratio`` (the same test as
  OpenTelemetry's ``TraceIdRatioBased``, so every process agrees on a trace id);
- a child follows its parent, local or remote;
- spans named in ``always`` are sampled whatever the ratio or the parent;
- spans named in ``tail`` that are not sampled are still recorded in their own process
  and written when they end failed (an exception, or attribute ``failed`` true); their
  children are not recorded. A process cannot know at a child's end that the trace will
  fail, and buffering every unsampled span to find out would cost what sampling saves.

The file is shared by every process of a run (``O_APPEND``, one ``write`` per line). With
``max_bytes`` set, a span whose line would take the file past it is not written and is
counted instead; each process keeps its count in ``<file>.not_written/<service>.<pid>``
(rewritten at most once a second and at shutdown), and ``spans_not_written`` sums them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["JsonlExporter", "SamplingPolicy", "make_processor", "make_sampler", "spans_not_written"]

_MASK = 0xFFFFFFFFFFFFFFFF
_COUNT_EVERY_S = 1.0


class SamplingPolicy:
    """The ratio and span names of one process's sampling; mutable so a re-configure applies."""

    def __init__(self, ratio: float = 1.0, always: frozenset[str] = frozenset(), tail: frozenset[str] = frozenset()):
        self.set(ratio, always, tail)

    def set(self, ratio: float, always: frozenset[str], tail: frozenset[str]) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"trace sample ratio must be within [0, 1], got {ratio}")
        self.ratio = ratio
        self.bound = round(ratio * (_MASK + 1))
        self.always = frozenset(always)
        self.tail = frozenset(tail)

    def root_sampled(self, trace_id: int) -> bool:
        return (trace_id & _MASK) < self.bound


def make_sampler(policy: SamplingPolicy) -> Any:
    """An OpenTelemetry ``Sampler`` applying ``policy`` (see the module docstring)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

    drop = SamplingResult(Decision.DROP)

    class _Sampler(Sampler):
        def should_sample(
            self,
            parent_context: Any,
            trace_id: int,
            name: str,
            kind: Any = None,
            attributes: Any = None,
            links: Any = None,
            trace_state: Any = None,
        ) -> Any:
            # A kept span's attributes are the ones its result carries.
            if name in policy.always:
                return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
            parent = trace.get_current_span(parent_context).get_span_context()
            if parent.is_valid:
                sampled = parent.trace_flags.sampled
            else:
                sampled = policy.root_sampled(trace_id)
            if sampled:
                return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
            return SamplingResult(Decision.RECORD_ONLY, attributes) if name in policy.tail else drop

        def get_description(self) -> str:
            return f"FlotillaSampler{{ratio={policy.ratio}}}"

    return _Sampler()


def make_processor(exporter: JsonlExporter) -> Any:
    """A span processor that hands sampled spans, and failed ``tail`` spans, to ``exporter``."""
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.trace import StatusCode

    class _Processor(SpanProcessor):
        def on_end(self, span: Any) -> None:
            if span.context.trace_flags.sampled:
                exporter.export((span,))
            elif span.status.status_code is StatusCode.ERROR or (span.attributes or {}).get("failed") is True:
                exporter.export((span,), sampled=False)

        def shutdown(self) -> None:
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    return _Processor()


class JsonlExporter:
    """Appends one JSON line per span to a file shared across processes, up to ``max_bytes``."""

    def __init__(self, path: str, service: str, max_bytes: int | None = None) -> None:
        self.path, self.service, self.max_bytes = path, service, max_bytes
        self.not_written = 0
        self._warned = False
        self._fd: int | None = None
        self._counted_at = 0.0
        self._counted = 0

    def retarget(self, path: str, service: str, max_bytes: int | None) -> None:
        self._write_count()
        if path != self.path and self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.path, self.service, self.max_bytes = path, service, max_bytes
        self.not_written = self._counted = 0

    def export(self, spans: Sequence[Any], sampled: bool = True) -> None:
        """Append `spans`; a file that cannot be opened or written (its directory gone, the
        disk full) loses them, counted, with one line on stderr: tracing never fails the
        work it traces."""
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as e:
                self._lost(len(spans), e)
                return
        for s in spans:
            ctx, parent = s.context, s.parent
            record = {
                "name": s.name,
                "trace_id": f"{ctx.trace_id:032x}",
                "span_id": f"{ctx.span_id:016x}",
                "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
                "start_ns": s.start_time,
                "end_ns": s.end_time,
                "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in (s.attributes or {}).items()},
                "service": self.service,
                "pid": os.getpid(),
            }
            status = getattr(s, "status", None)
            if status is not None and status.description:  # what an exception ended it with
                record["error"] = status.description
            if not sampled:  # kept for failing, outside the sample: its children are not in the file
                record["sampled"] = False
            data = (json.dumps(record, default=str) + "\n").encode()
            # Every process appends to the same file: its size on disk is the shared bound.
            if self.max_bytes is not None and os.fstat(self._fd).st_size + len(data) > self.max_bytes:
                self.not_written += 1
                if time.monotonic() - self._counted_at >= _COUNT_EVERY_S:
                    self._write_count()
                continue
            try:
                os.write(self._fd, data)
            except OSError as e:
                self._lost(1, e)

    def _lost(self, n: int, error: OSError) -> None:
        self.not_written += n
        if not self._warned:
            self._warned = True
            print(
                f"flotilla: traces: cannot write {self.path} ({error}); spans are counted, not written", file=sys.stderr
            )

    def _write_count(self) -> None:
        if self.not_written == self._counted:
            return
        folder = Path(self.path + ".not_written")
        name = f"{self.service}.{os.getpid()}".replace(os.sep, "_")
        tmp = folder / f".{name}.tmp"
        try:
            folder.mkdir(exist_ok=True)
            tmp.write_text(str(self.not_written))
            tmp.replace(folder / name)
        except OSError:
            return  # the trace file's directory is gone: there is nowhere to count
        self._counted, self._counted_at = self.not_written, time.monotonic()

    def shutdown(self) -> None:
        self._write_count()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def spans_not_written(path: str | os.PathLike[str]) -> int:
    """Spans every process of a run left out of ``path`` for its size cap (as last counted)."""
    folder = Path(os.fspath(path) + ".not_written")
    if not folder.is_dir():
        return 0
    total = 0
    for f in folder.iterdir():
        if f.name.startswith("."):
            continue
        try:
            total += int(f.read_text().strip() or 0)
        except (OSError, ValueError):
            continue  # a count being replaced right now; the next read has it
    return total
