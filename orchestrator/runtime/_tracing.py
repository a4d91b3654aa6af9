"""Tracing helpers: ``span``, ``traced``, ``configure_tracing`` and W3C trace context on the wire.

OpenTelemetry is imported lazily: a process that never opens a span never
imports it, and the per-call cost of propagation is one ``sys.modules`` lookup.
``configure_tracing`` installs an SDK tracer provider with a parent-based ratio
sampler and a JSONL exporter (one JSON object per written span, appended with
``O_APPEND`` so many processes can share one file, up to an optional size cap;
``_traceio`` holds the rules) and, when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set and
the OTLP exporter is installed, an OTLP exporter of the sampled spans too. It
exports its settings in the environment (``FLOTILLA_TRACE_*``), so actor
processes spawned afterwards trace into the same file by the same rules.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar, overload

__all__ = [
    "configure_from_env",
    "configure_tracing",
    "current_traceparent",
    "remote_parent",
    "span",
    "traced",
]

F = TypeVar("F", bound=Callable[..., Any])
_NULL = contextlib.nullcontext()
_exporter: Any = None
_policy: Any = None


_cached_tracer: Any = None


def _tracer() -> Any:
    global _cached_tracer
    if _cached_tracer is None:
        from opentelemetry import trace

        _cached_tracer = trace.get_tracer("flotilla")
    return _cached_tracer


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[Any]:
    """Open a span (child of the current one, which may live in the calling process).

    Exceptions propagate unchanged and are recorded on the span. Under a trace outside the
    sample, a span that is neither an ``always`` nor a ``tail`` name would be dropped by the
    sampler: it is not created at all (a no-op span stands in; the current span, and what
    calls propagate, stay the parent's), which spares the SDK's work on most spans.
    """
    policy = _policy
    if policy is not None and name not in policy.always and name not in policy.tail:
        trace = sys.modules["opentelemetry.trace"]  # imported by configure_tracing
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid and not ctx.trace_flags.sampled:
            yield trace.NonRecordingSpan(ctx)
            return
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


ENV_FILE = "FLOTILLA_TRACE_FILE"
ENV_SERVICE = "FLOTILLA_SERVICE_NAME"
ENV_SAMPLE = "FLOTILLA_TRACE_SAMPLE"
ENV_ALWAYS = "FLOTILLA_TRACE_ALWAYS"
ENV_TAIL = "FLOTILLA_TRACE_TAIL"
ENV_MAX_BYTES = "FLOTILLA_TRACE_MAX_BYTES"


def configure_tracing(
    path: str | os.PathLike[str],
    service_name: str,
    *,
    sample: float = 1.0,
    always: Iterable[str] = (),
    tail: Iterable[str] = (),
    max_bytes: int | None = None,
) -> None:
    """Record spans of this process (and of actor processes spawned later) to ``path`` as JSONL.

    ``sample`` is the fraction of root traces kept; ``always`` names spans kept whatever
    the fraction; ``tail`` names spans kept outside the sample when they end failed;
    ``max_bytes`` caps the file (spans past it are counted, not written). The rules are
    ``orchestrator.runtime._traceio``'s. All of it is exported in the environment, so an
    actor process started afterwards applies the same rules (``configure_from_env``).

    Calling it again re-targets the file, service name and rules (the OpenTelemetry
    provider itself can be installed only once per process). Raises ValueError for a
    ``sample`` outside [0, 1] or a ``max_bytes`` below 1.
    """
    global _exporter, _policy, _cached_tracer
    from ._traceio import JsonlExporter, SamplingPolicy, make_processor, make_sampler

    path = os.fspath(path)
    always, tail = frozenset(always), frozenset(tail)
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"trace file cap must be at least 1 byte, got {max_bytes}")
    if _policy is None:
        _policy = SamplingPolicy(sample, always, tail)
    else:
        _policy.set(sample, always, tail)
    os.environ[ENV_FILE] = path
    os.environ[ENV_SERVICE] = service_name
    os.environ[ENV_SAMPLE] = repr(float(sample))
    os.environ[ENV_ALWAYS] = ",".join(sorted(always))
    os.environ[ENV_TAIL] = ",".join(sorted(tail))
    os.environ[ENV_MAX_BYTES] = "" if max_bytes is None else str(max_bytes)
    if _exporter is not None:
        _exporter.retarget(path, service_name, max_bytes)
        return
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    _exporter = JsonlExporter(path, service_name, max_bytes)
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}), sampler=make_sampler(_policy)
        )
        trace.set_tracer_provider(provider)
    else:  # installed by someone else: its spans follow our rules from now on
        provider.sampler = make_sampler(_policy)
        # The SDK caches a tracer per scope with the sampler it was made with.
        for tracer in getattr(provider, "_tracers", {}).values():
            tracer.sampler = provider.sampler
    _cached_tracer = None  # a tracer carries the sampler it was made with
    provider.add_span_processor(make_processor(_exporter))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
        except ImportError:
            return
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))


def configure_from_env(service_name: str) -> bool:
    """Apply the tracing set up by the process that spawned this one (``configure_tracing``'s
    environment variables). Returns False, configuring nothing, when it traced nothing.

    Raises ValueError naming the variable when one holds a value that is not a number.
    """
    path = os.environ.get(ENV_FILE)
    if not path:
        return False
    try:
        sample = float(os.environ.get(ENV_SAMPLE) or 1.0)
    except ValueError:
        raise ValueError(f"{ENV_SAMPLE}={os.environ[ENV_SAMPLE]!r} is not a number") from None
    raw_cap = os.environ.get(ENV_MAX_BYTES) or ""
    try:
        max_bytes = int(raw_cap) if raw_cap else None
    except ValueError:
        raise ValueError(f"{ENV_MAX_BYTES}={raw_cap!r} is not a whole number") from None
    configure_tracing(
        path,
        service_name,
        sample=sample,
        always=[n for n in (os.environ.get(ENV_ALWAYS) or "").split(",") if n],
        tail=[n for n in (os.environ.get(ENV_TAIL) or "").split(",") if n],
        max_bytes=max_bytes,
    )
    return True
