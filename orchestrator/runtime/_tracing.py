"""Tracing helpers: ``span``, ``traced``, ``configure_tracing`` and W3C trace context on the wire.

OpenTelemetry is imported lazily: a process that never opens a span never
imports it, and the per-call cost of propagation is one ``sys.modules`` lookup.
``configure_tracing`` installs an SDK tracer provider with a JSONL exporter
(one JSON object per finished span, appended with ``O_APPEND`` so many
processes can share one file) and, when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set
and the OTLP exporter is installed, an OTLP exporter too. It sets
``FLOTILLA_TRACE_FILE`` so actor processes spawned afterwards trace into the
same file.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

__all__ = ["configure_tracing", "current_traceparent", "remote_parent", "span", "traced"]

F = TypeVar("F", bound=Callable[..., Any])
_NULL = contextlib.nullcontext()
_exporter: Any = None


def _tracer() -> Any:
    from opentelemetry import trace

    return trace.get_tracer("flotilla")


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[Any]:
    """Open a span (child of the current one, which may live in the calling process).

    Exceptions propagate unchanged and are recorded on the span.
    """
    with _tracer().start_as_current_span(name, attributes=attributes or None) as s:
        yield s


@overload
def traced(fn: F) -> F: ...
@overload
def traced(*, name: str | None = None) -> Callable[[F], F]: ...
def traced(fn: Any = None, *, name: str | None = None) -> Any:
    """Decorator: run the function (sync or async) inside ``span(name or qualname)``."""

    def wrap(f: F) -> F:
        label = name or f.__qualname__
        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with span(label):
                    return await f(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with span(label):
                return f(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return wrap(fn) if fn is not None else wrap


def current_traceparent() -> str | None:
    """The W3C traceparent of the current span, or None (free when no span was ever opened)."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def remote_parent(traceparent: Any) -> contextlib.AbstractContextManager[Any]:
    """Make the caller's span (from a request header) the current parent; no-op without one."""
    if type(traceparent) is not str:
        return _NULL
    parts = traceparent.split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return _NULL
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return _NULL
    return _attached(trace_id, span_id, flags)


@contextlib.contextmanager
def _attached(trace_id: int, span_id: int, flags: int) -> Iterator[None]:
    from opentelemetry import context, trace

    sc = trace.SpanContext(trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(flags))
    token = context.attach(trace.set_span_in_context(trace.NonRecordingSpan(sc)))
    try:
        yield
    finally:
        context.detach(token)


class _JsonlExporter:
    """Appends one JSON line per span; one ``write`` per line keeps lines whole across processes."""

    def __init__(self, path: str, service: str) -> None:
        self.path = path
        self.service = service
        self._fd: int | None = None

    def retarget(self, path: str, service: str) -> None:
        if path != self.path and self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.path, self.service = path, service

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        for s in spans:
            ctx, parent = s.context, s.parent
            line = json.dumps(
                {
                    "name": s.name,
                    "trace_id": f"{ctx.trace_id:032x}",
                    "span_id": f"{ctx.span_id:016x}",
                    "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
                    "start_ns": s.start_time,
                    "end_ns": s.end_time,
                    "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in (s.attributes or {}).items()},
                    "service": self.service,
                    "pid": os.getpid(),
                },
                default=str,
            )
            os.write(self._fd, (line + "\n").encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def configure_tracing(path: str | os.PathLike[str], service_name: str) -> None:
    """Record spans of this process (and of actor processes spawned later) to ``path`` as JSONL.

    Calling it again re-targets the file and service name (the OpenTelemetry
    provider itself can be installed only once per process).
    """
    global _exporter
    path = os.fspath(path)
    os.environ["FLOTILLA_TRACE_FILE"] = path
    os.environ["FLOTILLA_SERVICE_NAME"] = service_name
    if _exporter is not None:
        _exporter.retarget(path, service_name)
        return
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter

    exporter_cls = type("JsonlSpanExporter", (_JsonlExporter, SpanExporter), {})
    _exporter = exporter_cls(path, service_name)
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(_exporter))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
        except ImportError:
            return
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
