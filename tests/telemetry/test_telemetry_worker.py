"""A whole worker in this process (SQLite, TCP replication from a stand-in main process,
the real federation client to a loopback fake homeserver), looked at as an operator
would: its trace tree, its log lines and its metrics."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from federation_sender.app.worker import Worker
from federation_sender.clock import SystemClock
from federation_sender.config import (
    AdminSettings,
    DatabaseSettings,
    FederationSettings,
    QueueSettings,
    ReplicationSettings,
    Settings,
    TelemetrySettings,
)
from federation_sender.replication.rows import EventsStreamRow
from federation_sender.replication.server import ReplicationWriter
from federation_sender.replication.tcp import TcpReplicationServer
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.telemetry import names as n
from federation_sender.telemetry.logging import setup_logging
from federation_sender.testing.fake_homeserver import FakeHomeserver
from federation_sender.testing.queue_writer import HomeserverWriter, WrittenEvent
from federation_sender.testing.waiting import wait_until

LOCAL = "local.test"
GOOD = "good.test"
FLAKY = "flaky.test"
ALICE = f"@alice:{LOCAL}"
WAIT_S = 20.0  # real time: the worker, its HTTP and its database run on the real clock


@dataclass
class Run:
    worker: Worker
    hs: FakeHomeserver
    writer: HomeserverWriter
    repl: ReplicationWriter
    spans: InMemorySpanExporter
    log: io.StringIO

    def announce(self, evs: list[WrittenEvent]) -> None:
        for ev in evs:
            token = self.repl.publish("events", EventsStreamRow(
                ev.event_id, ev.room_id, "m.room.message", None, None, None, None, False,
                False))
            assert token == ev.stream_ordering

    def log_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.getvalue().splitlines()]


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
async def run(tmp_path: Path, restore_logging: None) -> AsyncIterator[Run]:
    url = f"sqlite:///{tmp_path}/w.db"
    engine = create_engine(url)
    await upgrade(engine)
    writer = await HomeserverWriter(engine, LOCAL).init()
    repl = ReplicationWriter(LOCAL)
    repl.add_stream("events", current=writer.stream_ordering)
    server = TcpReplicationServer(repl, clock=SystemClock(), port=0)
    await server.start()
    hs = FakeHomeserver()
    await hs.start()
    telemetry = TelemetrySettings(metrics_port=None, tracing_exporter="console",
                                  log_format="json", log_level="DEBUG")
    settings = Settings(
        server_name=LOCAL, instance_name="fed1", data_dir=str(tmp_path / "data"),
        shutdown_deadline_s=1.0,
        database=DatabaseSettings(url=url),
        replication=ReplicationSettings(transport="tcp", host="127.0.0.1", port=server.port),
        federation=FederationSettings(
            signing_key_path=str(tmp_path / "data" / "signing.key"), use_tls=False,
            ip_allow_list=["127.0.0.0/8"], request_timeout_s=5.0,
            destination_overrides={d: f"127.0.0.1:{hs.port}" for d in (GOOD, FLAKY)}),
        # Backoff past the catch-up threshold at once, so a failure leads to catch-up
        # (no short-retry phase first).
        queue=QueueSettings(backoff_initial_s=0.3, backoff_jitter_min=1.0,
                            backoff_jitter_max=1.0, catchup_threshold_s=0.1,
                            wakeup_interval_s=0.2, max_long_retries=0,
                            short_retry_probe_window_s=0.0),
        admin=AdminSettings(port=0, token="t0ken-for-tests"),
        telemetry=telemetry,
    )
    log = io.StringIO()
    setup_logging(telemetry, stream=log)
    worker = await Worker.create(settings)
    spans = InMemorySpanExporter()
    provider = worker.observer.tracing.provider
    assert provider is not None
    provider.add_span_processor(SimpleSpanProcessor(spans))
    await worker.start()
    try:
        yield Run(worker, hs, writer, repl, spans, log)
    finally:
        await worker.stop()
        await hs.close()
        await server.close()
        await engine.dispose()


def _children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[str]:
    assert parent.context is not None
    return sorted(s.name for s in spans
                  if s.parent is not None and s.parent.span_id == parent.context.span_id)


def _duration_s(span: ReadableSpan) -> float:
    assert span.start_time is not None and span.end_time is not None
    return (span.end_time - span.start_time) / 1e9


async def test_an_operator_sees_trees_contexts_and_state_changes(run: Run) -> None:
    await wait_until(run.worker.is_ready, "the worker to connect", timeout_s=WAIT_S)
    run.hs.behave(FLAKY, status=503)
    joins = [await run.writer.join("!r1:local.test", user)
             for user in (ALICE, f"@bob:{GOOD}", f"@carol:{FLAKY}")]
    evs = await run.writer.messages("!r1:local.test", ALICE, 3)
    run.announce(joins + evs)
    want = {e.event_id for e in evs}
    await wait_until(lambda: (_missing(run, want, GOOD), len(run.hs.attempts[FLAKY])),
                     "delivery to GOOD and three refused attempts to FLAKY",
                     accept=lambda seen: not seen[0] and seen[1] >= 3, timeout_s=WAIT_S)
    # While it fails: owed events, and its last error, kept through catch-up and parking.
    await wait_until(lambda: _status_error(run), "the parked queue's error",
                     accept=lambda e: e is not None, timeout_s=WAIT_S)
    assert "503" in str(_status_error(run))
    assert run.worker.metrics.registry.get_sample_value(n.PENDING_DESTINATIONS) == 1
    run.hs.behave(FLAKY)
    try:
        await wait_until(lambda: _missing(run, want, GOOD, FLAKY), "delivery to both",
                         accept=lambda missing: not missing, timeout_s=WAIT_S)
    except AssertionError:
        print("LOGDUMP", run.log.getvalue(), run.hs.attempts)
        raise
    await wait_until(lambda: any("answers again" in r["message"] for r in run.log_lines()),
                     "the recovery line", timeout_s=WAIT_S)
    spans = list(run.spans.get_finished_spans())

    # Traces: each transaction attempt is a tree, not a flat list of roots.
    txns = [s for s in spans if s.name == n.SPAN_TRANSACTION]
    assert txns and all(s.parent is None for s in txns)
    ok = [s for s in txns if s.attributes and s.attributes[n.ATTR_OUTCOME] == "success"]
    assert ok
    # No discovery span: the destinations are overrides, which need no lookup (one
    # that does is spanned: tests/transport/test_discovery.py).
    await wait_until(lambda: [_children(list(run.spans.get_finished_spans()), t) for t in ok],
                     "each successful transaction's request and persist spans",
                     accept=lambda kids: all(k == [n.SPAN_HTTP_REQUEST, n.SPAN_PERSIST]
                                             for k in kids), timeout_s=WAIT_S)
    spans = list(run.spans.get_finished_spans())
    assert not [s for s in spans if s.name == n.SPAN_DISCOVERY]
    failed = [s for s in txns if s.attributes and s.attributes[n.ATTR_OUTCOME] == "transient"]
    assert len(failed) >= 1
    http = [s for s in spans if s.name == n.SPAN_HTTP_REQUEST
            and s.parent is not None and s.parent.span_id == failed[0].context.span_id]
    assert http and http[0].attributes is not None
    assert http[0].attributes[n.ATTR_HTTP_STATUS] == 503
    # Catch-up steps span their work; replication batches are spanned.
    steps = [s for s in spans if s.name == n.SPAN_CATCHUP_STEP]
    assert steps and all(_duration_s(s) > 0 for s in steps)
    batches = [s for s in spans if s.name == n.SPAN_REPLICATION_BATCH]
    assert batches and batches[0].attributes is not None
    assert batches[0].attributes[n.ATTR_STREAM] == "events"

    # Logs: every queue line names its destination; lines inside an attempt its txn.
    lines = run.log_lines()
    queue_lines = [r for r in lines if r["logger"].startswith("federation_sender.queue")]
    assert queue_lines and all(r["destination"] for r in queue_lines), queue_lines
    failing = [r for r in lines if "is failing" in r["message"]]
    assert [(r["level"], r["destination"]) for r in failing] == [("WARNING", FLAKY)]
    assert failing[0]["txn_id"]
    again = [r for r in lines if "failed again" in r["message"]]
    assert len(again) >= 2 and {r["level"] for r in again} == {"DEBUG"}
    refused = sum(1 for t in run.hs.attempts[FLAKY] if t.status == 503)
    assert len(again) == refused - 1
    assert not any(r["level"] == "WARNING" for r in lines if r["destination"] == GOOD)
    assert any(r["message"].startswith("replication: connected to tcp://") for r in lines)


def _missing(run: Run, want: set[str], *destinations: str) -> dict[str, set[str]]:
    """The events of ``want`` each destination has not received yet."""
    missing = {d: want - set(run.hs.received_event_ids(d)) for d in destinations}
    return {d: ids for d, ids in missing.items() if ids}


def _status_error(run: Run) -> str | None:
    st = run.worker.manager.status(FLAKY)
    return None if st is None else st.last_error


def _sample(run: Run, metric: str, **labels: str) -> float:
    value = run.worker.metrics.registry.get_sample_value(metric, labels)
    return 0.0 if value is None else value


async def test_synapse_dashboard_metrics(run: Run) -> None:
    await wait_until(run.worker.is_ready, "the worker to connect", timeout_s=WAIT_S)
    run.hs.behave(FLAKY, status=503, times=2)
    joins = [await run.writer.join(room, user) for room in ("!a:local.test", "!b:local.test")
             for user in (ALICE, f"@bob:{GOOD}", f"@carol:{FLAKY}")]
    evs = await run.writer.messages_in_rooms([("!a:local.test", ALICE), ("!b:local.test",
                                                                          ALICE)] * 2)
    run.announce(joins + evs)
    want = {e.event_id for e in evs}
    await wait_until(lambda: _missing(run, want, GOOD, FLAKY), "delivery to both",
                     accept=lambda missing: not missing, timeout_s=WAIT_S)
    await wait_until(lambda: _sample(run, n.PENDING_DESTINATIONS), "nothing owed",
                     accept=lambda owed: owed == 0, timeout_s=WAIT_S)
    # Synapse's meanings: events read; (PDU, destination) pairs and PDUs queued; batches
    # and the rooms in them.
    assert _sample(run, n.EVENTS_PROCESSED + "_total") == len(joins) + len(evs)
    # Only our own users' events are sent: the messages, each to both remotes (Alice
    # joined first, alone; the others' joins are theirs to send).
    assert _sample(run, n.SENT_PDUS_COUNT + "_total") == len(evs)
    assert _sample(run, n.SENT_PDUS + "_total") == 2 * len(evs)
    loops = _sample(run, n.EVENT_PROCESSING_LOOP_COUNT + "_total", name="federation_sender")
    assert loops >= 1
    rooms = _sample(run, n.EVENT_PROCESSING_LOOP_ROOM_COUNT + "_total",
                    name="federation_sender")
    assert loops <= rooms <= 2 * loops
    # One request per attempt (one target each), every response counted by code.
    attempts = sum(len(run.hs.attempts[d]) for d in (GOOD, FLAKY))
    assert _sample(run, n.HTTP_REQUESTS + "_total", method="PUT") == attempts
    assert _sample(run, n.HTTP_RESPONSES + "_total", method="PUT", code="503") == 2
    assert _sample(run, n.HTTP_RESPONSES + "_total", method="PUT", code="200") == attempts - 2
    delivered = sum(len(t.event_ids) for d in (GOOD, FLAKY) for t in run.hs.accepted(d))
    assert _sample(run, n.DELIVERED_PDUS + "_total") == delivered
    # Synapse's Grafana dashboard: "Federation send PDU lag" reads the lag histogram by
    # event; the failed-transactions line is _send_new_transaction's block count minus
    # the sent transactions (here the two 503s).
    assert _sample(run, n.BLOCK_COUNT + "_total", block_name="_send_new_transaction") == attempts
    assert _sample(run, n.BLOCK_TIME + "_total", block_name="_send_new_transaction") > 0
    failed = (_sample(run, n.BLOCK_COUNT + "_total", block_name="_send_new_transaction")
              - _sample(run, n.SENT_TRANSACTIONS + "_total"))
    assert failed == 2
    assert _sample(run, n.BLOCK_COUNT + "_total", block_name="handle_room_events") == rooms
    assert _sample(run, n.EVENT_PROCESSING_LAG_BY_EVENT + "_count",
                   name="federation_sender") == len(evs)
    # As scraped (/metrics, /_synapse/metrics): with the server_name label, as Synapse's.
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from federation_sender.telemetry.metrics import ServerNameLabelled

    text = generate_latest(ServerNameLabelled(run.worker.metrics.registry, LOCAL)).decode()
    samples = {(s.name, tuple(sorted(s.labels.items())))
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert ("synapse_util_metrics_block_count_total",
            (("block_name", "_send_new_transaction"), ("server_name", LOCAL))) in samples
    assert ("synapse_event_processing_lag_by_event_bucket",
            (("le", "+Inf"), ("name", "federation_sender"), ("server_name", LOCAL))) in samples
