from __future__ import annotations

import asyncio
import logging

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from federation_sender.config import TelemetrySettings
from federation_sender.queue.telemetry_observer import TelemetryObserver
from federation_sender.telemetry import names as n
from federation_sender.telemetry.logging import current_log_context
from federation_sender.telemetry.metrics import Metrics, new_registry
from federation_sender.telemetry.tracing import (
    Tracing,
    child_span_dropped,
    leaf_span,
    setup_tracing,
)
from federation_sender.testing.clock import FakeClock
from federation_sender.transport.result import Outcome


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracing(spans: InMemorySpanExporter) -> Tracing:
    provider = setup_tracing(TelemetrySettings(), instance_name="w1", exporter=spans)
    return Tracing(provider)


def test_none_exporter_gives_no_provider_and_noop_spans() -> None:
    assert setup_tracing(TelemetrySettings()) is None
    t = Tracing(None)
    with t.transaction_attempt("a.org", "t1", pdu_count=1, edu_count=0) as span:
        span.finish("success")
    t.shutdown()


@pytest.mark.parametrize("exporter", ["console", "otlp"])
def test_configured_exporters_build(exporter: str) -> None:
    provider = setup_tracing(TelemetrySettings(tracing_exporter=exporter))  # type: ignore[arg-type]
    assert provider is not None
    provider.shutdown()


def test_transaction_span(tracing: Tracing, spans: InMemorySpanExporter) -> None:
    with tracing.transaction_attempt("a.org", "t1", pdu_count=3, edu_count=2) as span:
        assert current_log_context() == {"destination": "a.org", "txn_id": "t1"}
        span.finish("success", http_status=200)
    assert current_log_context() == {}
    (s,) = spans.get_finished_spans()
    assert s.name == n.SPAN_TRANSACTION
    assert s.attributes is not None
    assert dict(s.attributes) == {
        n.ATTR_DESTINATION: "a.org", n.ATTR_TXN_ID: "t1", n.ATTR_PDU_COUNT: 3,
        n.ATTR_EDU_COUNT: 2, n.ATTR_CATCHUP: False, n.ATTR_OUTCOME: "success",
        n.ATTR_HTTP_STATUS: 200}
    assert s.status.status_code is StatusCode.OK
    assert s.resource.attributes["service.name"] == "federation-sender"
    assert s.resource.attributes[n.ATTR_SERVICE_INSTANCE] == "w1"


def test_failed_and_raising_transactions(tracing: Tracing, spans: InMemorySpanExporter) -> None:
    with tracing.transaction_attempt("b.org", "t2", pdu_count=1, edu_count=0) as span:
        span.finish("transient", http_status=502, error="bad gateway")
    with pytest.raises(ConnectionError), \
            tracing.transaction_attempt("b.org", "t3", pdu_count=1, edu_count=0):
        raise ConnectionError("refused")
    failed, raised = spans.get_finished_spans()
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.status.description == "bad gateway"
    assert raised.attributes is not None and raised.attributes[n.ATTR_OUTCOME] == "error"
    assert [e.name for e in raised.events] == ["exception"]


def test_catchup_and_replication_spans(tracing: Tracing, spans: InMemorySpanExporter) -> None:
    with tracing.replication_batch("events", "master", 42, 7):
        pass
    with tracing.catchup_step("c.org", rooms=50) as span:
        span.set_attribute(n.ATTR_EVENTS, 12)
        with tracing.transaction_attempt("c.org", "t9", pdu_count=12, edu_count=0,
                                         catchup=True) as txn:
            txn.finish("success")
    batch, txn_span, step = spans.get_finished_spans()
    assert batch.name == n.SPAN_REPLICATION_BATCH
    assert batch.attributes is not None and batch.attributes[n.ATTR_ROWS] == 7
    assert step.name == n.SPAN_CATCHUP_STEP
    assert step.attributes is not None and step.attributes[n.ATTR_EVENTS] == 12
    # The attempt inside the step is its child.
    assert txn_span.parent is not None and txn_span.parent.span_id == step.context.span_id


def test_log_lines_inside_a_span_carry_the_context(
        tracing: Tracing, caplog: pytest.LogCaptureFixture) -> None:
    from federation_sender.telemetry.logging import ContextFilter

    caplog.handler.addFilter(ContextFilter())
    with caplog.at_level(logging.INFO), \
            tracing.transaction_attempt("d.org", "t5", pdu_count=0, edu_count=1) as span:
        logging.getLogger("federation_sender.test").info("sending")
        span.finish("success")
    (record,) = [r for r in caplog.records if r.getMessage() == "sending"]
    assert record.context == {"destination": "d.org", "txn_id": "t5"}  # type: ignore[attr-defined]


def test_child_spans_are_skipped_when_nothing_would_record_them(
        tracing: Tracing) -> None:
    assert child_span_dropped(Tracing(None).tracer)  # tracing off: a no-op tracer
    assert not child_span_dropped(tracing.tracer)  # no parent: a root is sampled
    with tracing.transaction_attempt("a.org", "t1", pdu_count=1, edu_count=0):
        assert not child_span_dropped(tracing.tracer)  # a sampled parent
    unsampled = Tracing(setup_tracing(TelemetrySettings(trace_sample_ratio=0.0),
                                      exporter=InMemorySpanExporter()))
    with unsampled.transaction_attempt("a.org", "t2", pdu_count=1, edu_count=0):
        assert child_span_dropped(unsampled.tracer)  # the root was not sampled


def test_leaf_spans_are_children_never_current_and_record_errors(
        tracing: Tracing, spans: InMemorySpanExporter) -> None:
    tracer = tracing.tracer
    with tracing.transaction_attempt("a.org", "t1", pdu_count=1, edu_count=0) as txn:
        with leaf_span(tracer, n.SPAN_HTTP_REQUEST, SpanKind.CLIENT,
                       {n.ATTR_SERVER_PORT: 8448}) as ok:
            # Not made current: the transaction stays the parent of anything opened here.
            assert trace.get_current_span() is txn.span
            ok.set_attribute(n.ATTR_HTTP_STATUS, 200)
        with pytest.raises(ConnectionRefusedError), \
                leaf_span(tracer, n.SPAN_HTTP_REQUEST, SpanKind.CLIENT, {}):
            raise ConnectionRefusedError("refused")
        txn.finish("transient")
    first, refused, root = spans.get_finished_spans()
    assert root.name == n.SPAN_TRANSACTION and root.context is not None
    assert all(s.parent is not None and s.parent.span_id == root.context.span_id
               for s in (first, refused))
    assert first.kind is SpanKind.CLIENT
    assert dict(first.attributes or {}) == {n.ATTR_SERVER_PORT: 8448, n.ATTR_HTTP_STATUS: 200}
    assert first.status.status_code is StatusCode.UNSET and not first.events
    assert refused.status.status_code is StatusCode.ERROR
    assert refused.status.description == "ConnectionRefusedError: refused"
    assert [e.name for e in refused.events] == ["exception"]


def test_persist_span_is_a_child_ending_at_the_commit(spans: InMemorySpanExporter) -> None:
    provider = setup_tracing(TelemetrySettings(), exporter=spans)
    observer = TelemetryObserver(Metrics(new_registry(process_metrics=False)), provider,
                                 FakeClock())

    async def run() -> None:
        loop = asyncio.get_running_loop()
        committed: asyncio.Future[None] = loop.create_future()
        failed: asyncio.Future[None] = loop.create_future()
        with observer.attempt("a.org", "t1", 1, 0, False):
            observer.persisting("a.org", committed)
        with observer.attempt("a.org", "t2", 1, 0, False):
            observer.persisting("a.org", failed)
        assert [s.name for s in spans.get_finished_spans()] == [n.SPAN_TRANSACTION] * 2
        committed.set_result(None)
        failed.set_exception(OSError("disk full"))
        await asyncio.sleep(0)
        failed.exception()

    asyncio.run(run())
    txn1, txn2, ok, bad = spans.get_finished_spans()
    for txn, persist in ((txn1, ok), (txn2, bad)):
        assert persist.name == n.SPAN_PERSIST and txn.context is not None
        assert persist.parent is not None and persist.parent.span_id == txn.context.span_id
        assert not persist.attributes  # the parent names the destination
    assert ok.status.status_code is StatusCode.UNSET
    assert bad.status.status_code is StatusCode.ERROR and bad.status.description == "OSError"


def _observed_attempts(observer: TelemetryObserver, count: int) -> None:
    """The telemetry calls of ``count`` transactions, children opened as the
    federation client opens them (skipped when ``child_span_dropped``)."""

    async def run() -> None:
        tracer = observer.tracing.tracer
        loop = asyncio.get_running_loop()
        for i in range(count):
            with observer.attempt("a.org", f"t{i}", 1, 0, False):
                if not child_span_dropped(tracer):
                    with leaf_span(tracer, n.SPAN_HTTP_REQUEST, SpanKind.CLIENT, {}):
                        pass
                committed: asyncio.Future[None] = loop.create_future()
                observer.persisting("a.org", committed)
                observer.transaction_sent("a.org", f"t{i}", Outcome.SUCCESS, 200, 1, 0, {},
                                          10, 0.01, False)
            committed.set_result(None)
        await asyncio.sleep(0)

    asyncio.run(run())


def test_sampled_traces_are_whole_or_absent() -> None:
    spans = InMemorySpanExporter()
    provider = setup_tracing(TelemetrySettings(trace_sample_ratio=0.5, trace_max_per_s=0),
                             exporter=spans)
    observer = TelemetryObserver(Metrics(new_registry(process_metrics=False)), provider,
                                 FakeClock())
    _observed_attempts(observer, 200)
    by_trace: dict[int, list[str]] = {}
    for s in spans.get_finished_spans():
        assert s.context is not None
        by_trace.setdefault(s.context.trace_id, []).append(s.name)
    # About half the roots, each with both children (p of 0 or 200 kept: 2^-199).
    assert 0 < len(by_trace) < 200
    assert all(sorted(names) == sorted([n.SPAN_TRANSACTION, n.SPAN_HTTP_REQUEST,
                                        n.SPAN_PERSIST]) for names in by_trace.values())
    assert observer.tracing.provider is not None
    assert observer.tracing.provider.sampler.get_description().startswith("ParentBased")


def test_traces_are_limited_per_second_and_still_whole() -> None:
    spans = InMemorySpanExporter()
    clock = FakeClock()
    provider = setup_tracing(TelemetrySettings(trace_max_per_s=10), exporter=spans,
                             clock=clock)
    observer = TelemetryObserver(Metrics(new_registry(process_metrics=False)), provider,
                                 clock)

    def traces() -> dict[int, list[str]]:
        by_trace: dict[int, list[str]] = {}
        for s in spans.get_finished_spans():
            assert s.context is not None
            by_trace.setdefault(s.context.trace_id, []).append(s.name)
        return by_trace

    _observed_attempts(observer, 25)
    assert len(traces()) == 10  # the bucket holds one second's worth
    clock.advance(0.5)
    _observed_attempts(observer, 25)
    assert len(traces()) == 15  # half a second refills five
    clock.advance(60.0)
    _observed_attempts(observer, 25)
    assert len(traces()) == 25  # never more than one second's worth at once
    assert all(sorted(names) == sorted([n.SPAN_TRANSACTION, n.SPAN_HTTP_REQUEST,
                                        n.SPAN_PERSIST]) for names in traces().values())
    assert observer.tracing.provider is not None
    assert "RateLimited{10/s" in observer.tracing.provider.sampler.get_description()


def test_an_attempt_over_the_limit_asks_nothing_of_the_sdk_and_drops_its_children() -> None:
    spans = InMemorySpanExporter()
    clock = FakeClock()
    provider = setup_tracing(TelemetrySettings(trace_max_per_s=1), exporter=spans,
                             clock=clock)
    assert provider is not None
    observer = TelemetryObserver(Metrics(new_registry(process_metrics=False)), provider,
                                 clock)
    tracer = observer.tracing.tracer
    with observer.attempt("a.org", "t0", 1, 0, False):  # the bucket's one token
        assert trace.get_current_span().is_recording()
        assert not child_span_dropped(tracer)
    asked: list[str] = []
    sampler = provider.sampler
    original = sampler.should_sample

    def should_sample(*args: object, **kwargs: object) -> object:
        asked.append(str(args[2]) if len(args) > 2 else str(kwargs.get("name")))
        return original(*args, **kwargs)  # type: ignore[arg-type]

    sampler.should_sample = should_sample  # type: ignore[method-assign]
    with observer.attempt("a.org", "t1", 1, 0, False):
        assert not trace.get_current_span().is_recording()
        assert child_span_dropped(tracer)
    assert asked == []  # no root was asked for: the bucket was known to be empty
    assert not trace.get_current_span().get_span_context().is_valid
    clock.advance(1.0)
    with observer.attempt("a.org", "t2", 1, 0, False):
        assert trace.get_current_span().is_recording()
    assert asked == [n.SPAN_TRANSACTION]
    assert [s.name for s in spans.get_finished_spans()] == [n.SPAN_TRANSACTION] * 2


def test_tracing_off_opens_no_span_and_still_counts() -> None:
    registry = new_registry(process_metrics=False)
    observer = TelemetryObserver(Metrics(registry), None, FakeClock())
    assert not observer.tracing.enabled
    # The same no-op context for every attempt: nothing allocated per transaction.
    assert observer.attempt("a.org", "t1", 1, 0, False) is observer.attempt(
        "b.org", "t2", 1, 0, False)
    _observed_attempts(observer, 3)
    assert registry.get_sample_value(n.SENT_TRANSACTIONS + "_total") == 3


def test_transactions_get_the_trace_budget_before_replication_batches() -> None:
    """Dozens of one-event replication batches a second must not take the budget
    (10 a second by default) from the transactions: in the demo they took 1,599 traces
    against 174 transactions'."""
    spans = InMemorySpanExporter()
    clock = FakeClock()
    provider = setup_tracing(TelemetrySettings(), exporter=spans, clock=clock)
    observer = TelemetryObserver(Metrics(new_registry(process_metrics=False)), provider,
                                 clock)
    tracing = observer.tracing
    token = 0
    for _ in range(30):  # 3 s: 50 replication batches and 5 transactions every 0.1 s
        for _ in range(50):
            token += 1
            with tracing.replication_batch("events", "master", token, 1):
                pass
        _observed_attempts(observer, 5)
        clock.advance(0.1)
    finished = spans.get_finished_spans()
    txns = sum(1 for s in finished if s.name == n.SPAN_TRANSACTION)
    batches = sum(1 for s in finished if s.name == n.SPAN_REPLICATION_BATCH)
    # 10 + 3 s x 10 = 40 tokens in all: the transactions asked 150 and get nearly all of
    # them (the replication batches only ever take what keeps half the bucket).
    assert txns >= 30, (txns, batches)
    assert txns + batches <= 41
    # A quiet worker still traces replication batches.
    spans.clear()
    clock.advance(10.0)
    with tracing.replication_batch("events", "master", token + 1, 1):
        pass
    assert [s.name for s in spans.get_finished_spans()] == [n.SPAN_REPLICATION_BATCH]


def test_a_dropped_attempt_keeps_whatever_context_it_is_entered_in() -> None:
    # Its context is built once per parent and reused: a different parent (here one
    # carrying a value, as a span or baggage would) gets its own, not the last one.
    tracing = Tracing(None)
    tracer = trace.NoOpTracerProvider().get_tracer("t")
    key = otel_context.create_key("k")
    for value in (None, 1, 1, 2, None):
        token = otel_context.attach(otel_context.set_value(key, value)) if value else None
        with tracing.dropped_attempt():
            assert otel_context.get_value(key) == value
            assert trace.get_current_span().get_span_context().trace_id == 1
            assert child_span_dropped(tracer)
        assert otel_context.get_value(key) == value
        if token is not None:
            otel_context.detach(token)
        assert trace.get_current_span() is trace.INVALID_SPAN
