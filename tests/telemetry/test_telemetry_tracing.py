from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from federation_sender.config import TelemetrySettings
from federation_sender.telemetry import names as n
from federation_sender.telemetry.logging import current_log_context
from federation_sender.telemetry.tracing import Tracing, setup_tracing


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
