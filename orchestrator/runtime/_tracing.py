"""Tracing helpers: ``span``, ``traced``, ``configure_tracing`` and W3C trace context on the wire.

OpenTelemetry is imported lazily: a process that does not trace (no
``configure_tracing``) never imports it, its spans are one shared no-op (unless the
program installed an OpenTelemetry SDK provider of its own: then they go there), and
the per-call cost of propagation is one ``sys.modules`` lookup.
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
import contextvars
import functools
import inspect
import os
import random
import re
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

__all__ = [
    "adopt_remote_parent",
    "configure_from_env",
    "configure_tracing",
    "current_traceparent",
    "span",
    "traced",
]

F = TypeVar("F", bound=Callable[..., Any])
_exporter: Any = None
_policy: Any = None


_cached_tracer: Any = None


def _tracer() -> Any:
    global _cached_tracer
    if _cached_tracer is None:
        from opentelemetry import trace

        _cached_tracer = trace.get_tracer("flotilla")
    return _cached_tracer


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """Open a span (child of the current one, which may live in the calling process).

    Exceptions propagate unchanged and are recorded on the span. Outside the sample (see
    ``_traceio``), the SDK is spared: a span that is neither an ``always`` nor a ``tail``
    kind is not made (the trace's no-op span stands in; the current trace, and what calls
    propagate, stay the parent's); a ``tail`` kind keeps its attributes in a light
    stand-in (``_Unsampled``), which is turned into a real span only if it ends failed.
    Those two paths are what almost every span of a run takes at the default rate, so
    they touch neither the SDK nor OpenTelemetry's context (see ``_Outside``).
    """
    policy = _policy
    if policy is None:  # this process does not trace: nothing is made, unless another
        # part of the program installed an OpenTelemetry SDK provider of its own
        trace = sys.modules.get("opentelemetry.trace")
        if trace is None or type(trace.get_tracer_provider()) is trace.ProxyTracerProvider:
            return _OFF
        return _tracer().start_as_current_span(name, attributes=attributes or None)
    out = _outside.get()
    if out is not None:  # the current trace is outside the sample
        if name in policy.always:  # kept whatever the sample; its children follow it
            return _Kept(
                _tracer().start_as_current_span(name, context=out.otel_context(), attributes=attributes or None)
            )
        if name in policy.tail:
            return _UnsampledScope(name, attributes, out.trace_id, parent=out)
        return out
    if name not in policy.always:
        trace = sys.modules["opentelemetry.trace"]  # imported by configure_tracing
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid and not ctx.trace_flags.sampled:  # set by OpenTelemetry's API directly
            if name in policy.tail:
                return _UnsampledScope(name, attributes, ctx.trace_id, parent=None)
            return _Outside(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-00")
        if not ctx.is_valid and name in policy.tail:
            trace_id = _random.getrandbits(128) or 1
            if not policy.root_sampled(trace_id):
                return _UnsampledScope(name, attributes, trace_id, parent=None, root=True)
            if _ids is not None:  # in the sample: the SDK's root takes this trace id
                _ids.next_trace_id = trace_id
    return _tracer().start_as_current_span(name, attributes=attributes or None)


class _NoopSpan:
    """The span API, recording nothing; as a context manager it gives itself."""

    __slots__ = ()

    def get_span_context(self) -> Any:
        from opentelemetry.trace import INVALID_SPAN_CONTEXT

        return INVALID_SPAN_CONTEXT

    def is_recording(self) -> bool:
        return False

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        pass

    def set_status(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_exception(self, *args: Any, **kwargs: Any) -> None:
        pass

    def add_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_OFF = _NoopSpan()  # every span of a process that does not trace


class _Outside(_NoopSpan):
    """A trace outside the sample, as its spans see it: the no-op span each of its
    children gives, and the traceparent each call under it carries.

    It is current in ``_outside`` (a context variable, set by an unsampled ``tail`` span
    and by a remote parent whose flags say unsampled), not in OpenTelemetry's context,
    which such a trace leaves as it was: creating and attaching OpenTelemetry's contexts
    was most of what a rollout outside the sample cost. So spans opened with
    OpenTelemetry's API directly (not through ``span``) under such a trace start traces of
    their own. Its ``SpanContext`` is built only if something asks for it (a kept kind or
    a failed ``tail`` span opened under it)."""

    __slots__ = ("_context", "traceparent")

    def __init__(self, traceparent: str) -> None:
        self.traceparent = traceparent
        self._context: Any = None

    @property
    def trace_id(self) -> int:
        return int(self.traceparent[3:35], 16)

    def get_span_context(self) -> Any:
        if self._context is None:
            from opentelemetry import trace

            span_id = int(self.traceparent[36:52], 16)
            self._context = trace.SpanContext(self.trace_id, span_id, False, trace.TraceFlags(0))
        return self._context

    def otel_context(self) -> Any:
        """OpenTelemetry's context with this trace's span as the parent (for the SDK)."""
        trace = sys.modules["opentelemetry.trace"]
        return trace.set_span_in_context(trace.NonRecordingSpan(self.get_span_context()))


_outside: contextvars.ContextVar[_Outside | None] = contextvars.ContextVar("flotilla_outside_sample", default=None)


class _Kept:
    """A kept kind's SDK span under a trace outside the sample: its children follow it."""

    __slots__ = ("_cm", "_token")

    def __init__(self, cm: Any) -> None:
        self._cm = cm

    def __enter__(self) -> Any:
        self._token = _outside.set(None)
        return self._cm.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self._cm.__exit__(*exc)
        finally:
            _outside.reset(self._token)


_random = random.Random()
_ids: Any = None  # the provider's id generator (`configure_tracing`)


def _id_generator() -> Any:
    """The SDK's random ids, except that the next root may be given its trace id (a tail
    kind's root whose sampling `span` decided before asking the SDK)."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class _Ids(RandomIdGenerator):
        next_trace_id = 0

        def generate_trace_id(self) -> int:
            given, self.next_trace_id = self.next_trace_id, 0
            return given or super().generate_trace_id()

    return _Ids()


class _Unsampled(_NoopSpan):
    """A ``tail`` span outside the sample: the attributes it is given, and when it began.
    While it is open its trace (``_Outside``, a span id of its own) is current, so its
    children and remote calls stay unsampled."""

    __slots__ = ("_trace", "attributes", "name", "start_ns")

    def __init__(self, name: str, attributes: dict[str, Any], trace: _Outside) -> None:
        self.name, self.attributes, self._trace = name, dict(attributes), trace
        self.start_ns = time.time_ns()

    def get_span_context(self) -> Any:
        return self._trace.get_span_context()

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self.attributes.update(attributes)


class _UnsampledScope:
    """Runs a block under an `_Unsampled` stand-in; if the block raised or set ``failed``
    true, writes it as the SDK span it stood for (its own start time and attributes, under
    the parent it had, and a root under the trace id its children were given; the sampler
    records a failed ``tail`` kind outside the sample, and the processor writes it).
    ``parent``: the trace outside the sample it opened under, if any; None: a root, or
    under OpenTelemetry's current span."""

    __slots__ = ("_parent", "_root", "_token", "stand_in")

    def __init__(
        self, name: str, attributes: dict[str, Any], trace_id: int, *, parent: _Outside | None, root: bool = False
    ) -> None:
        self._parent, self._root = parent, root
        trace = _Outside(f"00-{trace_id:032x}-{_random.getrandbits(64) or 1:016x}-00")
        self.stand_in = _Unsampled(name, attributes, trace)

    def __enter__(self) -> _Unsampled:
        self._token = _outside.set(self.stand_in._trace)
        return self.stand_in

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        _outside.reset(self._token)
        s = self.stand_in
        if error is None and s.attributes.get("failed") is not True:
            return
        trace = sys.modules["opentelemetry.trace"]
        if self._root and _ids is not None:
            _ids.next_trace_id = s._trace.trace_id
        parent = self._parent.otel_context() if self._parent is not None else None
        real = _tracer().start_span(s.name, context=parent, attributes=s.attributes or None, start_time=s.start_ns)
        if error is not None:
            real.record_exception(error)
            real.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        real.end()


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
    out = _outside.get()
    if out is not None:
        return out.traceparent
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


_OUTSIDE_TP = re.compile("00-[0-9a-f]{32}-[0-9a-f]{16}-00")  # as this module writes it


def adopt_remote_parent(traceparent: Any) -> None:
    """Make the caller's span (a request header's W3C traceparent) the current parent for
    the rest of the current context; no-op without one, or for one that is not a
    traceparent. For a context the call owns (a copy made for it, see ``Server._step``):
    nothing restores it, so the endpoint runs without a wrapper around it (a frame each
    time its coroutine resumes)."""
    if type(traceparent) is not str:
        return
    if _OUTSIDE_TP.fullmatch(traceparent):  # outside the sample: nothing parsed until asked
        _outside.set(_Outside(traceparent))
        return
    parts = traceparent.split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return
    if not flags & 1:
        _outside.set(_Outside(f"00-{trace_id:032x}-{span_id:016x}-00"))
        return
    from opentelemetry import context, trace

    parent = trace.NonRecordingSpan(trace.SpanContext(trace_id, span_id, True, trace.TraceFlags(flags)))
    context.attach(trace.set_span_in_context(parent))
    _outside.set(None)


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
    global _exporter, _policy, _cached_tracer, _ids
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
    _ids = _id_generator()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}), sampler=make_sampler(_policy), id_generator=_ids
        )
        trace.set_tracer_provider(provider)
    else:  # installed by someone else: its spans follow our rules from now on
        provider.sampler = make_sampler(_policy)
        provider.id_generator = _ids
        # The SDK caches a tracer per scope with the sampler and ids it was made with.
        for tracer in getattr(provider, "_tracers", {}).values():
            tracer.sampler, tracer.id_generator = provider.sampler, _ids
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
