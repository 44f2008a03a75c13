"""Optional OpenTelemetry tracing of a shard: one span per tenure, and spans for the rounds that move streams.

Contract:

* **Off unless asked.**  Tracing is on only where ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set, ``OTEL_SDK_DISABLED`` is not ``true``, and the
  OpenTelemetry packages are installed (``pip install 'fleetd[otel]'``; set but not installed: one
  warning, off).  Off, :func:`from_env` returns :data:`NULL`, whose calls do nothing and allocate
  nothing, and ``opentelemetry`` is never imported.
* **The only module that knows OpenTelemetry.**  The rest of fleetd calls :class:`Tracer`,
  :class:`Tenure` and :class:`Span`; attributes are passed without their ``fleetd.`` prefix.
* **Nothing per message.**  A tenure span starts when a stream becomes held and ends when it stops
  being held (both in ``fleetd/shard/holdings.py``).  Its events are rare things (an upstream
  reconnect, a gap, a self-fence), at most :data:`MAX_EVENTS` per tenure; past that they are only
  counted (``fleetd.events_dropped``), so an upstream that gaps on every frame costs a counter.
* **Never in the way.**  No call raises: an OpenTelemetry call that fails is logged (at most once every
  10 s) and dropped, so a tracing fault can never skip a fence or a release.
* **The event loop only queues.**  An ended span goes to the SDK's batch processor, whose own thread
  encodes and exports it (OTLP/HTTP protobuf).  :meth:`Tracer.close`, the last step of the shard's
  shutdown, gives the queue a bounded time on another thread; what is not exported then is lost,
  never waited for.

A tenure span is the root of its own trace: a tenure lasts hours or days, the round that claimed it
a second.  It carries a link to the span it began in (the reconcile round or takeover), if any.

Quiet spans (reconcile rounds, takeovers): most rounds find nothing to do, and a span for each would
be most of the traces, and of the bill.  A quiet span is recorded only if something happened in it
(a tenure began, a child span was recorded, :meth:`Span.keep` or :meth:`Span.event` was called, or it
raised); until then it is a start time and a few attributes in a Python object.

Trace ids start with their epoch second, the form AWS X-Ray requires (it rejects a trace whose
id-time is more than 30 days old, which includes a tenure longer than that); other backends only
see 96 random bits instead of 128.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import random
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar

from fleetd.logs import RateLimiter

# Nothing heavier than the standard library at import: the supervisor, which runs no event loop,
# imports this module for ``preload``.
if TYPE_CHECKING:
    from opentelemetry.context import Context as OtelContext
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span as OtelSpan
    from opentelemetry.trace import Tracer as OtelTracer

log = logging.getLogger(__name__)
_limiter = RateLimiter(10.0)

Attr = str | bool | int | float
ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
# What tracing imports; the supervisor preloads them into its forkserver when tracing is on, so a
# shard's boot (a restart after a crash) does not pay their ~0.25 s each time.
MODULES = ("opentelemetry.sdk.trace", "opentelemetry.sdk.trace.export",
           "opentelemetry.exporter.otlp.proto.http.trace_exporter")
MAX_EVENTS = 32  # per tenure; the SDK would keep 128, but each one costs its call on the event loop
PREFIX = "fleetd."


def _named(attrs: Mapping[str, Attr]) -> dict[str, Attr]:
    return {PREFIX + key: value for key, value in attrs.items()}


class _Failsafe:
    """``with FAILSAFE:`` around OpenTelemetry calls: an exception is logged (rate-limited) and swallowed."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if not isinstance(exc, Exception):
            return False
        if _limiter.allow("tracing"):
            log.warning("tracing call failed; span data dropped", extra={"error": f"{type(exc).__name__}: {exc}"})
        return True


FAILSAFE = _Failsafe()


# ----- the interface, and its null implementation (tracing off) ----------------------------------------


class Tenure:
    """One stream's tenure on this shard: from the moment it became held to the moment it stopped being
    held.  This base is the null tenure: its calls do nothing."""

    __slots__ = ()

    def event(self, name: str, **attrs: Attr) -> None:
        """Something rare happened to the stream (a reconnect, a gap, a self-fence)."""

    def end(self, reason: str, **attrs: Attr) -> None:
        """The stream stopped being held, for ``reason``; a second end is ignored."""


class Span:
    """One operation of the shard (a reconcile round, a takeover, a hand-over), as a context manager.
    This base is the null span: its calls do nothing."""

    __slots__ = ()

    def set(self, **attrs: Attr) -> None:
        """Attributes known only as the operation goes on (counts, outcomes)."""

    def event(self, name: str, **attrs: Attr) -> None:
        """A step of the operation worth its own timestamp (records a quiet span)."""

    def keep(self) -> None:
        """Record this quiet span: it did something."""

    def __enter__(self) -> Span:
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        return None


class Tracer:
    """A shard's tracer.  This base is the null tracer (tracing off): its calls return shared null objects."""

    __slots__ = ()
    enabled: ClassVar[bool] = False

    def tenure(self, connection_id: str, session_id: str, epoch: int, resume_seq: int | None,
               **attrs: Attr) -> Tenure:
        """A stream became held under ``session_id`` at lease ``epoch``; it resumes after ``resume_seq``
        (None: it connects without ``from_seq``)."""
        return NO_TENURE

    def span(self, name: str, quiet: bool = False, **attrs: Attr) -> Span:
        """An operation; ``quiet``: recorded only if something happens in it (module docstring)."""
        return NO_SPAN

    async def close(self, timeout_s: float) -> None:
        """Export what is queued, for at most ``timeout_s``, then stop."""


NO_TENURE = Tenure()
NO_SPAN = Span()
NULL = Tracer()


def enabled_by_env(env: Mapping[str, str] | None = None) -> bool:
    """An OTLP endpoint is configured and the SDK is not disabled (the packages may still be missing)."""
    env = os.environ if env is None else env
    return any(env.get(key) for key in ENDPOINTS) and env.get("OTEL_SDK_DISABLED", "").strip().lower() != "true"


def preload() -> list[str]:
    """The modules a forkserver should import before forking shards: tracing's, when it is on."""
    return list(MODULES) if enabled_by_env() else []


def from_env(resource: Mapping[str, Attr], queue_size: int = 2048) -> Tracer:
    """The shard's tracer: OpenTelemetry with the standard ``OTEL_*`` settings, or :data:`NULL`.

    ``resource`` names the shard (``fleetd.`` is prefixed); ``queue_size`` is the batch queue's
    default length (``OTEL_BSP_MAX_QUEUE_SIZE`` wins).  Never raises: tracing that cannot start is
    logged once and off, the shard streams on."""
    if not enabled_by_env():
        return NULL
    try:
        return _start(_named(resource), queue_size)
    except ImportError as e:
        log.warning("an OTLP endpoint is set but OpenTelemetry is not installed (pip install 'fleetd[otel]'): "
                    "tracing off", extra={"error": str(e)})
    except Exception as e:
        log.warning("tracing could not start: tracing off", extra={"error": f"{type(e).__name__}: {e}"})
    return NULL


# ----- OpenTelemetry (imported only by _start) -----------------------------------------------------------

# The quiet or recorded span that code runs in (a task started inside one inherits it).
_current: contextvars.ContextVar[_OtelSpan | None] = contextvars.ContextVar("fleetd_span", default=None)


def _start(resource: dict[str, Attr], queue_size: int) -> _OtelTracer:
    from opentelemetry.context import Context
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    class XRayIds(IdGenerator):  # type: ignore[misc, unused-ignore]  # (Any without the packages)
        """Trace ids whose first 32 bits are the epoch second (module docstring)."""

        def generate_span_id(self) -> int:
            return random.getrandbits(64) or 1

        def generate_trace_id(self) -> int:
            return (int(time.time()) << 96) | random.getrandbits(96)

    service = os.environ.get("OTEL_SERVICE_NAME") or "fleetd"
    # Not registered at exit (shutdown_on_exit): the shard closes it itself, bounded; an atexit
    # shutdown would wait up to 30 s for an unreachable collector.
    provider = TracerProvider(resource=Resource.create({"service.name": service, **resource}),
                              id_generator=XRayIds(), shutdown_on_exit=False)
    explicit = "OTEL_BSP_MAX_QUEUE_SIZE" in os.environ
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(),
                                                   max_queue_size=None if explicit else queue_size))
    return _OtelTracer(provider, Context())


class _OtelTracer(Tracer):
    __slots__ = ("_provider", "_root", "_tracer")
    enabled: ClassVar[bool] = True

    def __init__(self, provider: TracerProvider, root: OtelContext) -> None:
        self._provider = provider
        self._tracer: OtelTracer = provider.get_tracer("fleetd")
        self._root = root  # an empty context: a span started in it is a root

    def start(self, name: str, attrs: dict[str, Attr], start_ns: int | None = None,
              parent: OtelSpan | None = None) -> OtelSpan:
        from opentelemetry.trace import set_span_in_context

        context = self._root if parent is None else set_span_in_context(parent, self._root)
        return self._tracer.start_span(name, context=context, attributes=attrs, start_time=start_ns)

    def tenure(self, connection_id: str, session_id: str, epoch: int, resume_seq: int | None,
               **attrs: Attr) -> Tenure:
        from opentelemetry.trace import Link

        named = _named({"connection_id": connection_id, "session_id": session_id, "lease_epoch": epoch,
                        **({} if resume_seq is None else {"resume_seq": resume_seq}), **attrs})
        began_in = _current.get()
        with FAILSAFE:
            links = [Link(began_in.recorded().get_span_context())] if began_in is not None else None
            return _OtelTenure(self._tracer.start_span("tenure", context=self._root, attributes=named, links=links))
        return NO_TENURE

    def span(self, name: str, quiet: bool = False, **attrs: Attr) -> Span:
        return _OtelSpan(self, name, quiet, _named(attrs))

    async def close(self, timeout_s: float) -> None:
        # The SDK's shutdown blocks (it joins its export thread, up to 30 s): on a daemon thread of its
        # own, so neither the event loop nor the process exit waits for a collector that does not answer.
        import asyncio

        from fleetd.aio import wait

        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def shut() -> None:
            try:
                self._provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                    loop.call_soon_threadsafe(done.set)

        threading.Thread(target=shut, name="trace-close", daemon=True).start()
        if not await wait(done, timeout_s):
            log.warning("traces not all exported at shutdown", extra={"timeout_s": timeout_s})


class _OtelTenure(Tenure):
    __slots__ = ("_dropped", "_events", "_span")

    def __init__(self, span: OtelSpan) -> None:
        self._span = span
        self._events = 0
        self._dropped = 0

    def event(self, name: str, **attrs: Attr) -> None:
        if self._events >= MAX_EVENTS:
            self._dropped += 1
            return
        self._events += 1
        with FAILSAFE:
            self._span.add_event(name, _named(attrs))

    def end(self, reason: str, **attrs: Attr) -> None:
        with FAILSAFE:
            if not self._span.is_recording():
                return  # ended already (or not sampled)
            dropped = {"events_dropped": self._dropped} if self._dropped else {}
            self._span.set_attributes(_named({"end_reason": reason, **attrs, **dropped}))
            self._span.end()


class _OtelSpan(Span):
    """A span started at ``__enter__``, or, quiet, only once something happens in it (``recorded``),
    with the time of ``__enter__`` and as the child of the span it was entered in."""

    __slots__ = ("_attrs", "_name", "_parent", "_quiet", "_span", "_start_ns", "_token", "_tracer")

    def __init__(self, tracer: _OtelTracer, name: str, quiet: bool, attrs: dict[str, Attr]) -> None:
        self._tracer = tracer
        self._name = name
        self._quiet = quiet
        self._attrs = attrs
        self._span: OtelSpan | None = None
        self._parent: _OtelSpan | None = None
        self._start_ns = 0
        self._token: contextvars.Token[_OtelSpan | None] | None = None

    def recorded(self) -> OtelSpan:
        """The OpenTelemetry span, started now if it was not (and its parents with it)."""
        if self._span is None:
            parent = self._parent.recorded() if self._parent is not None else None
            self._span = self._tracer.start(self._name, self._attrs, self._start_ns, parent)
        return self._span

    def set(self, **attrs: Attr) -> None:
        if self._span is None:
            self._attrs.update(_named(attrs))
            return
        with FAILSAFE:
            self._span.set_attributes(_named(attrs))

    def event(self, name: str, **attrs: Attr) -> None:
        with FAILSAFE:
            self.recorded().add_event(name, _named(attrs))

    def keep(self) -> None:
        with FAILSAFE:
            self.recorded()

    def __enter__(self) -> _OtelSpan:
        self._parent = _current.get()
        self._start_ns = time.time_ns()
        self._token = _current.set(self)
        if not self._quiet:
            self.keep()
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._token is not None:
            _current.reset(self._token)
        with FAILSAFE:
            self._finish(exc)

    def _finish(self, exc: BaseException | None) -> None:
        if isinstance(exc, Exception):
            from opentelemetry.trace import Status, StatusCode

            span = self.recorded()
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        elif exc is not None and self._span is not None:
            self._span.set_attribute(PREFIX + "cancelled", True)  # the shard is stopping
        if self._span is not None:
            self._span.end()
