"""OpenTelemetry tracing: provider setup from config, and one helper per span kind.

The provider is *not* installed globally: :class:`Tracing` wraps the provider it is
given (or a no-op one), so tests and several workers in one process stay isolated.
The composition root may still call ``opentelemetry.trace.set_tracer_provider``.

Spans (names in :mod:`.names`): one per transaction attempt (its children: the HTTP
request, the database write of its result, and discovery when it looks something up),
per catch-up step (the database read of the plan) and per replication batch. Children
find their parent through OpenTelemetry's context (a contextvar), so the client needs
only the tracer; leaves (the HTTP request) are not made current themselves
(:func:`leaf_span`), which saves the context switch of a span nothing is opened in. The
transaction and catch-up helpers also enter
:func:`~federation_sender.telemetry.logging.log_context`, so every log line written
inside them carries the destination (and txn id).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from types import TracebackType

from opentelemetry import context, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, Span, Status, StatusCode
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes, AttributeValue

from federation_sender.clock import Clock, SystemClock
from federation_sender.config import TelemetrySettings
from federation_sender.errors import ConfigError
from federation_sender.telemetry import names as n
from federation_sender.telemetry.logging import log_context

SERVICE_NAME = "federation-sender"


LOW_PRIORITY_ROOTS = frozenset({n.SPAN_REPLICATION_BATCH})
"""Roots traced only from what transactions leave (:class:`RateLimitedSampler`)."""


class RateLimitedSampler(Sampler):
    """Roots kept by ``inner`` (a ratio by trace id), at most ``max_per_s`` a second:
    a token bucket holding one second's worth (at least one), refilled continuously on
    ``clock``. What the bucket refuses is dropped, so tracing costs at most
    ``max_per_s`` traces a second however busy the worker is, and a quiet worker still
    traces everything the ratio keeps. ``max_per_s`` 0: no limit.

    Transactions (and catch-up steps) get the budget first: a low-priority root (a
    replication batch, :data:`LOW_PRIORITY_ROOTS`, dozens a second of one event each)
    takes a token only while the bucket holds more than half its capacity, so it is
    traced from what transactions leave and never drains the tokens they need."""

    def __init__(self, inner: Sampler, max_per_s: float, clock: Clock) -> None:
        self._inner = inner
        self._rate = max_per_s
        self._capacity = max(1.0, max_per_s)
        self._reserve = max(1.0, self._capacity / 2)
        """Tokens a low-priority root leaves in the bucket for transactions."""
        self._tokens = self._capacity
        self._clock = clock
        self._last = clock.monotonic_s()

    def should_sample(
        self,
        parent_context: context.Context | None,
        trace_id: int,
        name: str,
        kind: trace.SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        result = self._inner.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state)
        if not self._rate or result.decision is not Decision.RECORD_AND_SAMPLE:
            return result
        now = self._clock.monotonic_s()
        self._tokens = min(self._capacity, self._tokens + (now - self._last) * self._rate)
        self._last = now
        floor = 1.0 + self._reserve if name in LOW_PRIORITY_ROOTS else 1.0
        if self._tokens < floor:
            return SamplingResult(Decision.DROP, None, result.trace_state)
        self._tokens -= 1.0
        return result

    def get_description(self) -> str:
        return f"RateLimited{{{self._rate:g}/s, {self._inner.get_description()}}}"

    def exhausted(self) -> bool:
        """Whether a root asked for now would be dropped whatever its trace id: the
        bucket is empty (refilled to now first, as :meth:`should_sample` does)."""
        if not self._rate:
            return False
        now = self._clock.monotonic_s()
        self._tokens = min(self._capacity, self._tokens + (now - self._last) * self._rate)
        self._last = now
        return self._tokens < 1.0


class WorkerSampler(ParentBased):
    """``ParentBased`` over the worker's root sampler, keeping a handle on its rate
    limit (``limiter``) so that a root it would drop is not even asked for."""

    def __init__(self, root: Sampler, limiter: RateLimitedSampler | None) -> None:
        super().__init__(root)
        self.limiter = limiter


def make_sampler(settings: TelemetrySettings, clock: Clock | None = None) -> WorkerSampler:
    """The worker's sampler: roots by ratio and rate limit, children follow their root."""
    root: Sampler = TraceIdRatioBased(settings.trace_sample_ratio)
    limiter = None
    if settings.trace_max_per_s:
        root = limiter = RateLimitedSampler(root, settings.trace_max_per_s,
                                            clock or SystemClock())
    return WorkerSampler(root, limiter)


def setup_tracing(
    settings: TelemetrySettings,
    *,
    instance_name: str | None = None,
    exporter: SpanExporter | None = None,
    clock: Clock | None = None,
) -> TracerProvider | None:
    """Build a provider for ``settings.tracing_exporter``: ``none`` gives ``None``;
    ``console`` prints spans as they end; ``otlp`` batches them to
    ``settings.otlp_endpoint`` (OTLP/HTTP protobuf). ``exporter`` overrides the
    configured one with synchronous export (tests pass an in-memory exporter).

    Root spans (a transaction attempt, a catch-up step, a replication batch) are
    sampled with probability ``settings.trace_sample_ratio`` by trace id, at most
    ``settings.trace_max_per_s`` a second (on ``clock``, :class:`RateLimitedSampler`);
    their children (the HTTP request, the result's write, a discovery lookup) follow the
    root's decision, so a trace is whole or absent."""
    if exporter is None and settings.tracing_exporter == "none":
        return None
    attrs: dict[str, str] = {"service.name": SERVICE_NAME}
    if instance_name:
        attrs[n.ATTR_SERVICE_INSTANCE] = instance_name
    provider = TracerProvider(resource=Resource.create(attrs),
                              sampler=make_sampler(settings, clock))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif settings.tracing_exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif settings.tracing_exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ConfigError("telemetry.tracing_exporter",
                              "'otlp' only with opentelemetry-exporter-otlp-proto-http "
                              "installed", "otlp") from e
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
    return provider


_OK = Status(StatusCode.OK)

_DROPPED = trace.NonRecordingSpan(trace.SpanContext(
    trace_id=1, span_id=1, is_remote=False, trace_flags=trace.TraceFlags(0)))
"""Made current for an attempt whose trace the rate limit drops without asking the SDK:
a valid, unsampled context, so its children are dropped as they would be under the
SDK's own unsampled root (:func:`child_span_dropped`, ``ParentBased``). Never exported,
never a parent of anything recorded."""


_in_dropped_attempt: ContextVar[bool] = ContextVar("fs_in_dropped_attempt", default=False)
"""True inside a :class:`DroppedAttempt`: :func:`child_span_dropped` answers from it
without asking OpenTelemetry's context for the current span (twice per transaction)."""


def child_span_dropped(tracer: trace.Tracer) -> bool:
    """Whether a span opened now with ``tracer`` would be thrown away: tracing is off
    (a no-op tracer), or the current span belongs to a trace that was not sampled
    (its children follow the root's decision). Callers then skip the span and the
    computing of its attributes altogether."""
    if _in_dropped_attempt.get() or isinstance(tracer, trace.NoOpTracer):
        return True
    ctx = trace.get_current_span().get_span_context()
    return ctx.is_valid and not ctx.trace_flags.sampled


class LeafSpan:
    """A span that ends when its block exits and is never made current: for leaves,
    which open nothing inside them, so the context attach and detach (and the two
    generator layers) of ``start_as_current_span`` are saved. An exception escaping the
    block is recorded and sets the status to ERROR, as ``start_as_current_span`` does."""

    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def __enter__(self) -> Span:
        return self.span

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        span = self.span
        if isinstance(exc, Exception):  # not a cancellation: that is no error of the span
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        span.end()


def leaf_span(tracer: trace.Tracer, name: str, kind: trace.SpanKind,
              attributes: Mapping[str, AttributeValue]) -> LeafSpan:
    """``with leaf_span(...) as span:`` a child of the current span (see :class:`LeafSpan`)."""
    return LeafSpan(tracer.start_span(name, kind=kind, attributes=attributes))


_dropped_under: tuple[context.Context, context.Context] | None = None
"""(parent, the parent with :data:`_DROPPED` current) last built by :class:`DroppedAttempt`."""


def _remember_dropped_under(parent: context.Context, child: context.Context) -> None:
    global _dropped_under
    _dropped_under = (parent, child)


class DroppedAttempt:
    """``with``: :data:`_DROPPED` is the current span (a class, not a generator: one
    per transaction of a busy worker)."""

    __slots__ = ("_flag", "_token")

    def __enter__(self) -> None:
        # The same parent context (the queue tasks' empty one, as a rule) gives the
        # same child: OpenTelemetry's contexts are immutable, so the one built for it
        # last is reused (building it copied a dict: 2 of the 2.7 us of this block).
        parent = context.get_current()
        last = _dropped_under
        if last is not None and last[0] is parent:
            child = last[1]
        else:
            child = trace.set_span_in_context(_DROPPED, parent)
            _remember_dropped_under(parent, child)
        self._token = context.attach(child)
        self._flag = _in_dropped_attempt.set(True)

    def __exit__(self, *exc: object) -> None:
        _in_dropped_attempt.reset(self._flag)
        context.detach(self._token)


@dataclass(slots=True)
class TransactionSpan:
    """Handle for a transaction attempt's span; call :meth:`finish` with the outcome."""

    span: Span
    outcome: str | None = None

    def finish(self, outcome: str, *, http_status: int | None = None,
               error: str | None = None) -> None:
        self.outcome = outcome
        # One call: the SDK takes its lock and checks the attributes once.
        self.span.set_attributes({n.ATTR_OUTCOME: outcome} if http_status is None else
                                 {n.ATTR_OUTCOME: outcome, n.ATTR_HTTP_STATUS: http_status})
        if outcome == "success":
            self.span.set_status(_OK)
        else:
            self.span.set_status(Status(StatusCode.ERROR, error or outcome))


class Tracing:
    """Span helpers over one provider (``None``: every span is a cheap no-op)."""

    def __init__(self, provider: TracerProvider | None) -> None:
        self.provider = provider
        self.enabled = provider is not None
        """False: no span is ever recorded; the hot paths skip opening any."""
        source: trace.TracerProvider = provider or trace.NoOpTracerProvider()
        self.tracer: trace.Tracer = source.get_tracer("federation_sender")
        """For components that open their own child spans (the federation client)."""
        self._tracer = self.tracer
        sampler = provider.sampler if provider is not None else None
        self._limiter = sampler.limiter if isinstance(sampler, WorkerSampler) else None

    def roots_exhausted(self) -> bool:
        """Whether the rate limit would drop a trace begun now, whatever its id."""
        limiter = self._limiter
        return limiter is not None and limiter.exhausted()

    def dropped_attempt(self) -> DroppedAttempt:
        """An attempt not traced (:meth:`roots_exhausted`): no span, and its children
        see an unsampled parent. What the SDK does for a dropped root, for a fifth of
        its cost."""
        return DroppedAttempt()

    @contextmanager
    def transaction_attempt(self, destination: str, txn_id: str, *, pdu_count: int,
                            edu_count: int, catchup: bool = False,
                            set_log_context: bool = True) -> Iterator[TransactionSpan]:
        """Span one attempt. An exception escaping the block marks outcome ``error``
        (unless :meth:`TransactionSpan.finish` already set one) and is recorded.
        ``set_log_context=False``: the caller already put destination and txn id in
        the log context (the queue runner does)."""
        attrs: dict[str, AttributeValue] = {n.ATTR_DESTINATION: destination, n.ATTR_TXN_ID: txn_id,
                 n.ATTR_PDU_COUNT: pdu_count, n.ATTR_EDU_COUNT: edu_count,
                 n.ATTR_CATCHUP: catchup}
        with (log_context(destination=destination, txn_id=txn_id) if set_log_context
              else nullcontext()):
            # Made current by hand, not with start_as_current_span: its two generator
            # layers would only wrap what this one does anyway.
            span = self._tracer.start_span(n.SPAN_TRANSACTION, attributes=attrs)
            token = context.attach(trace.set_span_in_context(span))
            handle = TransactionSpan(span)
            try:
                yield handle
            except BaseException as e:
                span.record_exception(e)
                if handle.outcome is None:
                    handle.finish("error", error=type(e).__name__)
                raise
            finally:
                context.detach(token)
                span.end()

    @contextmanager
    def catchup_step(self, destination: str, *, rooms: int = 0) -> Iterator[Span]:
        """Span one catch-up step; set :data:`names.ATTR_EVENTS` etc. on the span."""
        with log_context(destination=destination), self._tracer.start_as_current_span(
                n.SPAN_CATCHUP_STEP,
                attributes={n.ATTR_DESTINATION: destination, n.ATTR_ROOMS: rooms}) as span:
            yield span

    @contextmanager
    def replication_batch(self, stream: str, instance: str, token: int, rows: int
                          ) -> Iterator[Span]:
        with self._tracer.start_as_current_span(
                n.SPAN_REPLICATION_BATCH,
                attributes={n.ATTR_STREAM: stream, n.ATTR_INSTANCE: instance,
                            n.ATTR_TOKEN: token, n.ATTR_ROWS: rows}) as span:
            yield span

    def shutdown(self) -> None:
        """Flush and stop exporters."""
        if self.provider is not None:
            self.provider.shutdown()
