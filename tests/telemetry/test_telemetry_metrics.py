from __future__ import annotations

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from federation_sender.admin.server import start_http_server
from federation_sender.telemetry import names as n
from federation_sender.telemetry.metrics import (
    CHILD_CACHE_LIMIT,
    Metrics,
    QueueSnapshot,
    metrics_app,
    new_registry,
)


def value(registry: CollectorRegistry, metric: str, /, **labels: str) -> float | None:
    return registry.get_sample_value(metric, labels)


def test_transaction_outcomes_feed_synapse_and_own_counters() -> None:
    reg = CollectorRegistry()
    m = Metrics(reg)
    m.transaction_finished("a.org", "success", 3, {"m.typing": 2, "m.receipt": 1}, 0.2)
    m.transaction_finished("b.org", "success", 0, {"m.typing": 1, "m.presence": 0}, 0.05)
    m.transaction_finished("c.org", "transient", 7, {"m.typing": 4}, 30.0)
    assert value(reg, n.SENT_TRANSACTIONS + "_total") == 2
    assert value(reg, n.DELIVERED_PDUS + "_total") == 3
    assert value(reg, n.SENT_EDUS + "_total") == 4
    assert value(reg, n.SENT_EDUS_BY_TYPE + "_total", type="m.typing") == 3
    assert value(reg, n.SENT_EDUS_BY_TYPE + "_total", type="m.presence") is None
    assert value(reg, n.TRANSACTION_ATTEMPTS + "_total", outcome="success") == 2
    assert value(reg, n.TRANSACTION_ATTEMPTS + "_total", outcome="transient") == 1
    assert value(reg, n.TRANSACTION_ATTEMPTS + "_total", outcome="permanent") == 0
    assert value(reg, n.TRANSACTION_DURATION + "_count", outcome="success") == 2
    assert value(reg, n.TRANSACTION_DURATION + "_bucket", outcome="success", le="0.1") == 1
    assert value(reg, n.TRANSACTION_DURATION + "_sum", outcome="transient") == 30.0
    with pytest.raises(ValueError):
        m.transaction_finished("a.org", "meh", 0, {}, 0.1)


def test_snapshot_gauges_are_read_at_scrape_time() -> None:
    reg = CollectorRegistry()
    m = Metrics(reg)
    assert value(reg, n.PENDING_PDUS) is None
    snap = QueueSnapshot(pending_destinations=2, pending_pdus=10, pending_edus=4,
                         backing_off=5, catching_up=1, in_flight_transactions=2,
                         oldest_in_flight_age_s=12.5, short_retrying=3)
    m.set_snapshot_source(lambda: snap)
    assert value(reg, n.PENDING_DESTINATIONS) == 2
    assert value(reg, n.PENDING_PDUS) == 10
    assert value(reg, n.PENDING_EDUS) == 4
    assert value(reg, n.DESTINATIONS_BACKING_OFF) == 5
    assert value(reg, n.DESTINATIONS_CATCHING_UP) == 1
    assert value(reg, n.DESTINATIONS_SHORT_RETRYING) == 3
    assert value(reg, n.OLDEST_IN_FLIGHT_AGE) == 12.5
    snap = QueueSnapshot(pending_pdus=1)
    assert value(reg, n.PENDING_PDUS) == 1


def test_snapshot_counters_are_exported_as_counters() -> None:
    reg = CollectorRegistry()
    m = Metrics(reg)
    m.set_snapshot_source(lambda: QueueSnapshot(group_commits=3, group_commit_results=45,
                                                first_reads=2, transaction_signatures=9,
                                                shared_content_signatures=7))
    assert reg.get_sample_value(n.DB_GROUP_COMMITS + "_total") == 3
    assert reg.get_sample_value(n.DB_GROUP_COMMIT_RESULTS + "_total") == 45
    assert reg.get_sample_value(n.QUEUE_FIRST_READS + "_total") == 2
    assert reg.get_sample_value(n.TRANSACTION_SIGNATURES + "_total") == 9
    assert reg.get_sample_value(n.SHARED_CONTENT_SIGNATURES + "_total") == 7


def test_signature_counts_come_from_a_sender_that_keeps_them() -> None:
    from federation_sender.transport.result import signature_counts

    class Counting:
        signature_counts = (5, 3)

    assert signature_counts(Counting()) == (5, 3)
    assert signature_counts(object()) == (0, 0)  # a test sender counts nothing


def test_short_retry_counters() -> None:
    reg = CollectorRegistry()
    m = Metrics(reg)
    m.short_retry(False)
    m.short_retry(False)
    m.short_retry(True)
    m.short_retry_phase_ended(True)
    m.short_retry_phase_ended(False)
    assert value(reg, n.SHORT_RETRY_ATTEMPTS + "_total", outcome="unanswered") == 2
    assert value(reg, n.SHORT_RETRY_ATTEMPTS + "_total", outcome="answered") == 1
    assert value(reg, n.SHORT_RETRY_PHASES + "_total", ended="answered") == 1
    assert value(reg, n.SHORT_RETRY_PHASES + "_total", ended="backed_off") == 1


def test_failing_snapshot_source_is_omitted_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    reg = CollectorRegistry()
    m = Metrics(reg)

    def broken() -> QueueSnapshot:
        raise RuntimeError("nope")

    m.set_snapshot_source(broken)
    m.item_dropped("pdu", "too_large")
    assert value(reg, n.PENDING_PDUS) is None
    assert value(reg, n.DROPPED_ITEMS + "_total", kind="pdu", reason="too_large") == 1
    assert "queue snapshot" in caplog.text


def test_replication_and_event_processing() -> None:
    reg = CollectorRegistry()
    m = Metrics(reg)
    m.replication_position("events", "master", 120, 5)
    m.replication_position("events", "writer2", 80, -3)
    m.replication_batch("events", 7)
    m.event_processing_lag(1.5, position=119, last_ts_ms=1_700_000_000_000)
    m.catchup_step("done")
    m.shard_membership(3, 40)
    assert value(reg, n.REPLICATION_POSITION, stream="events", instance="master") == 120
    assert value(reg, n.REPLICATION_LAG, stream="events", instance="master") == 5
    assert value(reg, n.REPLICATION_LAG, stream="events", instance="writer2") == 0
    assert value(reg, n.REPLICATION_ROWS + "_total", stream="events") == 7
    assert value(reg, n.EVENT_PROCESSING_LAG_MS, name="federation_sender") == 1500
    assert value(reg, n.EVENT_PROCESSING_LAG_S) == 1.5
    assert value(reg, n.EVENT_PROCESSING_POSITIONS, name="federation_sender") == 119
    assert value(reg, n.SHARD_LEASES_HELD) == 40


def test_registries_are_isolated() -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    Metrics(a).item_dropped("pdu", "x")
    Metrics(b)
    assert value(b, n.DROPPED_ITEMS + "_total", kind="pdu", reason="x") is None


async def test_metrics_server_serves_exposition_and_stops() -> None:
    reg = new_registry()
    m = Metrics(reg)
    m.set_snapshot_source(lambda: QueueSnapshot(pending_pdus=3))
    m.transaction_finished("a.org", "success", 1, {}, 0.1)
    server = await start_http_server(metrics_app(reg), "127.0.0.1", 0)
    try:
        assert server.port > 0
        async with aiohttp.ClientSession() as session:
            for path in ("/metrics", "/_synapse/metrics"):
                async with session.get(server.url + path) as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"].startswith("text/plain")
                    text = await resp.text()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            assert families[n.PENDING_PDUS].samples[0].value == 3
            assert families[n.SENT_TRANSACTIONS].samples[0].value == 1
            assert "process_cpu_seconds" in families
    finally:
        await server.stop()
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(server.url + "/metrics")


def test_labelled_children_are_cached_up_to_a_bound_and_all_counted() -> None:
    registry = new_registry(process_metrics=False)
    m = Metrics(registry)
    codes = range(100, 100 + CHILD_CACHE_LIMIT + 50)  # more label sets than the cache
    for _ in range(2):
        for code in codes:
            m.http_response("PUT", code)
        m.transaction_finished("d.test", "success", 1, {"m.typing": 2}, 0.01)
    assert len(m._responses) == CHILD_CACHE_LIMIT
    assert all(value(registry, n.HTTP_RESPONSES + "_total", method="PUT", code=str(c)) == 2
               for c in codes)
    assert value(registry, n.SENT_EDUS_BY_TYPE + "_total", type="m.typing") == 4
    assert value(registry, n.TRANSACTION_ATTEMPTS + "_total", outcome="success") == 2
    assert value(registry, n.TRANSACTION_ATTEMPTS + "_total", outcome="permanent") == 0
    with pytest.raises(ValueError, match="unknown transaction outcome"):
        m.transaction_finished("d.test", "bogus", 1, {}, 0.01)


async def test_synapse_series_carry_the_server_name_label_as_synapses_do() -> None:
    reg = new_registry()
    m = Metrics(reg)
    m.set_snapshot_source(lambda: QueueSnapshot(pending_pdus=3))
    m.transaction_finished("a.org", "success", 1, {"m.typing": 1}, 0.1)
    server = await start_http_server(metrics_app(reg, "example.org"), "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session, session.get(
                server.url + "/_synapse/metrics") as resp:
            text = await resp.text()
    finally:
        await server.stop()
    families = list(text_string_to_metric_families(text))
    synapse = [s for f in families if f.name.startswith("synapse_") for s in f.samples]
    own = [s for f in families if f.name.startswith("federation_sender_") for s in f.samples]
    assert synapse and own
    assert all(s.labels["server_name"] == "example.org" for s in synapse)
    assert all("server_name" not in s.labels for s in own)
    by_type = [s for s in synapse if s.name == n.SENT_EDUS_BY_TYPE + "_total"]
    assert by_type[0].labels == {"type": "m.typing", "server_name": "example.org"}
    # The registry itself is unchanged: recording and in-process reads see no new label.
    assert value(reg, n.SENT_TRANSACTIONS + "_total") == 1


def test_per_transaction_counters_are_published_at_each_collection_exactly_once() -> None:
    # Plain tallies between scrapes: each collection adds only what is new.
    registry = new_registry(process_metrics=False)
    m = Metrics(registry)
    seen = []
    for k in (1, 2, 5):
        while m._sent_txns_tally.n < k:
            m.http_request("PUT")
            m.http_response("PUT", 200)
            m.transaction_finished("e.test", "success", 2, {}, 0.01)
        for _ in range(2):  # a second collection with nothing new changes nothing
            seen.append((value(registry, n.SENT_TRANSACTIONS + "_total"),
                         value(registry, n.DELIVERED_PDUS + "_total"),
                         value(registry, n.HTTP_REQUESTS + "_total", method="PUT"),
                         value(registry, n.HTTP_RESPONSES + "_total", method="PUT",
                               code="200")))
    assert seen == [(k, 2 * k, k, k) for k in (1, 1, 2, 2, 5, 5)]
