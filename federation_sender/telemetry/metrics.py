"""Prometheus metrics over a registry passed in (tests use a fresh one each).

Per-destination labels are deliberately absent: with 100k destinations they would
explode the series count. Per-destination detail is in the admin API instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from federation_sender.telemetry import names as n

log = logging.getLogger(__name__)

TRANSACTION_DURATION_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """Whole-queue figures, computed by the queue manager at scrape time."""

    pending_destinations: int = 0
    """Destinations owed events or EDUs: queued, in flight, or a catch-up under way or due
    (Synapse: transmission loop running, which it is until the destination is caught up)."""
    pending_pdus: int = 0
    pending_edus: int = 0
    backing_off: int = 0
    catching_up: int = 0
    short_retrying: int = 0
    in_flight_transactions: int = 0
    oldest_in_flight_age_s: float = 0.0
    group_commits: int = 0
    group_commit_results: int = 0
    first_reads: int = 0
    transaction_signatures: int = 0
    shared_content_signatures: int = 0
    """Counters since start (exported as such), read with the gauges."""


_SNAPSHOT_GAUGES: tuple[tuple[str, str, str], ...] = (
    (n.PENDING_DESTINATIONS, "pending_destinations",
     "Destinations owed PDUs or EDUs (queued, in flight, or to catch up)"),
    (n.PENDING_PDUS, "pending_pdus", "PDUs queued in memory for all destinations"),
    (n.PENDING_EDUS, "pending_edus", "EDUs queued in memory for all destinations"),
    (n.DESTINATIONS_BACKING_OFF, "backing_off", "Destinations waiting out a backoff"),
    (n.DESTINATIONS_CATCHING_UP, "catching_up", "Destinations in catch-up mode"),
    (n.DESTINATIONS_SHORT_RETRYING, "short_retrying",
     "Destinations in the short-retry phase (retried in memory before a persisted backoff)"),
    (n.IN_FLIGHT_TRANSACTIONS, "in_flight_transactions", "Transactions awaiting a response"),
    (n.OLDEST_IN_FLIGHT_AGE, "oldest_in_flight_age_s",
     "Age of the oldest in-flight transaction (0 when none)"),
)


_SNAPSHOT_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (n.DB_GROUP_COMMITS, "group_commits",
     "Database transactions that wrote transaction results (group commits)"),
    (n.DB_GROUP_COMMIT_RESULTS, "group_commit_results",
     "Transaction results written by those group commits"),
    (n.QUEUE_FIRST_READS, "first_reads",
     "Database transactions that read new queues' rows and outboxes, gathered"),
    (n.TRANSACTION_SIGNATURES, "transaction_signatures",
     "Transaction requests signed (a retry that resends the same request is not)"),
    (n.SHARED_CONTENT_SIGNATURES, "shared_content_signatures",
     "Of those, signed over a content (body and first hash) another destination's "
     "transaction had built"),
)


class _SnapshotCollector(Collector):
    def __init__(self) -> None:
        self.source: Callable[[], QueueSnapshot] | None = None

    def describe(self) -> Iterable[Metric]:
        return [
            *(GaugeMetricFamily(name, doc) for name, _, doc in _SNAPSHOT_GAUGES),
            *(CounterMetricFamily(name, doc) for name, _, doc in _SNAPSHOT_COUNTERS),
        ]

    def collect(self) -> Iterable[Metric]:
        if self.source is None:
            return []
        try:
            snap = self.source()
        except Exception:
            # A scrape must not fail because one source did; log and omit.
            log.exception("queue snapshot for metrics failed")
            return []
        out: list[Metric] = []
        for name, attr, doc in _SNAPSHOT_GAUGES:
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], float(getattr(snap, attr)))
            out.append(family)
        for name, attr, doc in _SNAPSHOT_COUNTERS:
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], float(getattr(snap, attr)))
            out.append(counter)
        return out


class _Tally:
    """One counter child's increments as a plain integer: ``n`` grows on the event
    loop (no lock, no call into the client library); :class:`_Tallies` adds what is
    new to the child when the registry is collected. Two fields, each written by one
    side only, so a collection from another thread loses nothing."""

    __slots__ = ("child", "n", "published")

    def __init__(self, child: Counter) -> None:
        self.child = child
        self.n = 0
        self.published = 0

    def publish(self) -> None:
        n = self.n
        if n != self.published:
            self.child.inc(n - self.published)
            self.published = n


class _Tallies:
    """Registered before the counters it feeds: each collection of the registry
    (a scrape, ``get_sample_value``) first publishes every tally, so the exposition
    carries the same names, labels and values as when each increment went to the
    child at once (integers: the sums are exact either way). No ``describe``: it
    exports nothing of its own."""

    def __init__(self) -> None:
        self.tallies: list[_Tally] = []
        self._publishing = threading.Lock()
        """Two scrapes at once (the exposition server answers each in a thread of its
        own) must not both add the same increments: one publishes at a time."""

    def tally(self, child: Counter) -> _Tally:
        t = _Tally(child)
        self.tallies.append(t)
        return t

    def collect(self) -> Iterable[Metric]:
        with self._publishing:
            for t in self.tallies:
                t.publish()
        return []


def new_registry(*, process_metrics: bool = True) -> CollectorRegistry:
    """A fresh registry, with the standard process/platform/GC collectors if asked."""
    registry = CollectorRegistry()
    if process_metrics:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    return registry


class Metrics:
    """Typed recording methods; one instance per registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # The metric catalogue: one declaration per metric, in the order of docs/
        # operations.md (and of the exposition), in three groups.
        self.registry = registry
        # Before the counters: a collection publishes the tallies first (_Tallies).
        self._tallies = _Tallies()
        registry.register(self._tallies)
        self._declare_sending(registry)
        self._declare_processing(registry)
        self._declare_catchup_and_shards(registry)
        self._snapshot = _SnapshotCollector()
        registry.register(self._snapshot)
        self._resolve_children()

    def _declare_sending(self, r: CollectorRegistry) -> None:
        """What is sent: transactions, PDUs (queued, delivered), the fan-out's events and
        loop, requests and responses, EDUs, attempts and their durations, short
        retries, items dropped."""
        self._sent_txns = Counter(n.SENT_TRANSACTIONS, "Transactions sent successfully",
                                  registry=r)
        self._sent_pdus = Counter(n.SENT_PDUS, "PDUs queued for sending, counted per "
                                  "destination", registry=r)
        self._sent_pdus_count = Counter(n.SENT_PDUS_COUNT, "PDUs queued for sending to one "
                                        "or more destinations", registry=r)
        self._delivered_pdus = Counter(n.DELIVERED_PDUS, "PDUs in accepted transactions, "
                                       "counted per destination", registry=r)
        self._events_processed = Counter(n.EVENTS_PROCESSED, "Events read by the fan-out",
                                         registry=r)
        self._loops = Counter(n.EVENT_PROCESSING_LOOP_COUNT, "Event processing loop "
                              "iterations", ["name"], registry=r)
        self._loop_rooms = Counter(n.EVENT_PROCESSING_LOOP_ROOM_COUNT, "Rooms seen per "
                                   "event processing loop iteration", ["name"], registry=r)
        self._http_requests = Counter(n.HTTP_REQUESTS, "Outgoing federation requests",
                                      ["method"], registry=r)
        self._http_responses = Counter(n.HTTP_RESPONSES, "Responses to outgoing federation "
                                       "requests", ["method", "code"], registry=r)
        self._sent_edus = Counter(n.SENT_EDUS, "EDUs sent", registry=r)
        self._sent_edus_by_type = Counter(n.SENT_EDUS_BY_TYPE, "EDUs sent, by EDU type",
                                          ["type"], registry=r)
        self._attempts = Counter(n.TRANSACTION_ATTEMPTS, "Transaction attempts by outcome",
                                 ["outcome"], registry=r)
        self._duration = Histogram(n.TRANSACTION_DURATION,
                                   "Time from sending a transaction to its outcome",
                                   ["outcome"], buckets=TRANSACTION_DURATION_BUCKETS_S,
                                   registry=r)
        self._short_retries = Counter(n.SHORT_RETRY_ATTEMPTS, "Retries in the short-retry "
                                      "phase, by outcome", ["outcome"], registry=r)
        self._short_phases = Counter(n.SHORT_RETRY_PHASES, "Short-retry phases ended, by "
                                     "how", ["ended"], registry=r)
        self._return_probes = Counter(n.RETURN_PROBES, "Return probes of destinations in "
                                      "their backoff, by outcome", ["outcome"], registry=r)
        self._dropped = Counter(n.DROPPED_ITEMS, "Queued items dropped, by kind and reason",
                                ["kind", "reason"], registry=r)

    def _declare_processing(self, r: CollectorRegistry) -> None:
        """Replication positions and the event processing loop's progress and lag."""
        self._repl_pos = Gauge(n.REPLICATION_POSITION, "Processed position per stream/writer",
                               ["stream", "instance"], registry=r)
        self._repl_lag = Gauge(n.REPLICATION_LAG,
                               "Stream ids the writer is ahead of our processed position",
                               ["stream", "instance"], registry=r)
        self._repl_batches = Counter(n.REPLICATION_BATCHES, "Replication batches applied",
                                     ["stream"], registry=r)
        self._repl_rows = Counter(n.REPLICATION_ROWS, "Replication rows applied", ["stream"],
                                  registry=r)
        self._lag_ms = Gauge(n.EVENT_PROCESSING_LAG_MS,
                             "Milliseconds between an event's persistence and its processing",
                             ["name"], registry=r)
        self._lag_s = Gauge(n.EVENT_PROCESSING_LAG_S,
                            "Seconds between an event's persistence and its processing",
                            registry=r)
        self._positions = Gauge(n.EVENT_PROCESSING_POSITIONS, "Last processed stream ordering",
                                ["name"], registry=r)
        self._last_ts = Gauge(n.EVENT_PROCESSING_LAST_TS,
                              "Persistence time (ms) of the last processed event", ["name"],
                              registry=r)
        self._lag_by_event = Histogram(n.EVENT_PROCESSING_LAG_BY_EVENT,
                                       "Time between an event being persisted and it being "
                                       "queued up to be sent to the relevant remote servers",
                                       ["name"], registry=r)
        self._block_count = Counter(n.BLOCK_COUNT, "", ["block_name"], registry=r)
        self._block_time = Counter(n.BLOCK_TIME, "", ["block_name"], registry=r)

    def _declare_catchup_and_shards(self, r: CollectorRegistry) -> None:
        """Catch-up steps, pacing waits, the shard membership."""
        self._catchup_steps = Counter(n.CATCHUP_STEPS, "Catch-up steps by outcome",
                                      ["outcome"], registry=r)
        self._send_time_withheld = Counter(n.SEND_TIME_WITHHELD, "PDUs withheld just before "
                                           "their transaction went out, by reason",
                                           ["reason"], registry=r)
        self._send_time_pruned = Counter(n.SEND_TIME_PRUNED, "PDUs sent pruned: redacted "
                                         "since they were queued", registry=r)
        self._pacing_confirmations = Counter(
            n.PACING_CONFIRMATIONS,
            "Waits for a receiver to process what it accepted, by outcome "
            "(confirmed, not_yet, no_answer, unsupported)",
            ["outcome"], registry=r)
        self._pacing_wait = Counter(
            n.PACING_WAIT, "Time spent waiting for receivers to process what they accepted",
            registry=r)
        self._live_instances = Gauge(n.SHARD_LIVE_INSTANCES,
                                     "Live federation sender instances seen by this one",
                                     registry=r)
        self._leases_held = Gauge(n.SHARD_LEASES_HELD, "Destination leases held", registry=r)

    def _resolve_children(self) -> None:
        # Labelled children resolved once (``labels()`` costs a lock and a tuple per
        # call): created here, they also export zeros so rate() works from the start.
        # The counters every transaction (and its request) moves are tallies
        # (``_Tally``): plain integers, published at collection.
        tally = self._tallies.tally
        self._by_outcome = {o: (tally(self._attempts.labels(o)), self._duration.labels(o))
                            for o in n.TRANSACTION_OUTCOMES}
        self._sent_txns_tally = tally(self._sent_txns)
        self._delivered_pdus_tally = tally(self._delivered_pdus)
        self._loop = self._loops.labels(n.EVENT_PROCESSING_NAME)
        self._loop_room = self._loop_rooms.labels(n.EVENT_PROCESSING_NAME)
        self._lag_ms_child = self._lag_ms.labels(n.EVENT_PROCESSING_NAME)
        self._position_child = self._positions.labels(n.EVENT_PROCESSING_NAME)
        self._last_ts_child = self._last_ts.labels(n.EVENT_PROCESSING_NAME)
        self._lag_by_event_child = self._lag_by_event.labels(n.EVENT_PROCESSING_NAME)
        self._send_block_count = tally(self._block_count.labels(n.BLOCK_SEND_TRANSACTION))
        self._send_block_time = self._block_time.labels(n.BLOCK_SEND_TRANSACTION)
        self._rooms_block = (self._block_count.labels(n.BLOCK_HANDLE_ROOM_EVENTS),
                             self._block_time.labels(n.BLOCK_HANDLE_ROOM_EVENTS))
        self._requests: dict[str, _Tally] = {"PUT": tally(self._http_requests.labels("PUT"))}
        self._responses: dict[tuple[str, int], _Tally] = {}
        self._edus_by_type: dict[str, Counter] = {}

    def set_snapshot_source(self, source: Callable[[], QueueSnapshot] | None) -> None:
        """Gauges of whole-queue state come from ``source()`` at each scrape."""
        self._snapshot.source = source

    def transaction_finished(
        self,
        destination: str,
        outcome: str,
        pdu_count: int,
        edu_counts_by_type: Mapping[str, int],
        duration_s: float,
    ) -> None:
        """Record one transaction attempt. ``destination`` is accepted for symmetry
        with the span and log line but is not a label (cardinality)."""
        children = self._by_outcome.get(outcome)
        if children is None:
            raise ValueError(f"unknown transaction outcome {outcome!r}")
        children[0].n += 1
        children[1].observe(max(0.0, duration_s))
        self._send_block_count.n += 1
        self._send_block_time.inc(max(0.0, duration_s))
        if outcome != "success":
            return
        self._sent_txns_tally.n += 1
        if pdu_count:
            self._delivered_pdus_tally.n += pdu_count
        total_edus = 0
        for edu_type, count in edu_counts_by_type.items():
            if count:
                _child(self._edus_by_type, self._sent_edus_by_type, edu_type,
                       (edu_type,)).inc(count)
                total_edus += count
        if total_edus:
            self._sent_edus.inc(total_edus)

    def events_fanned_out(self, events: int, rooms: int, pdus: int,
                          pdu_destinations: int, *, duration_s: float = 0.0) -> None:
        """One fan-out batch: ``events`` read, in ``rooms`` rooms; ``pdus`` of them
        queued for ``pdu_destinations`` (PDU, destination) pairs, in ``duration_s``
        (Synapse's ``handle_room_events`` block, once per room: the batch's time is
        counted once, where Synapse's concurrent per-room blocks each count theirs)."""
        if rooms:
            self._rooms_block[0].inc(rooms)
            self._rooms_block[1].inc(max(0.0, duration_s))
        self._events_processed.inc(events)
        self._loop.inc()
        self._loop_room.inc(rooms)
        self._sent_pdus_count.inc(pdus)
        self._sent_pdus.inc(pdu_destinations)

    def http_request(self, method: str) -> None:
        t = self._requests.get(method)
        if t is not None:
            t.n += 1
        else:
            self._new_tally(self._requests, self._http_requests, method, (method,))

    def http_response(self, method: str, code: int) -> None:
        t = self._responses.get((method, code))
        if t is not None:
            t.n += 1
        else:
            self._new_tally(self._responses, self._http_responses, (method, code),
                            (method, str(code)))

    def _new_tally(self, cache: dict[_K, _Tally], metric: Counter, key: _K,
                   labels: tuple[str, ...]) -> None:
        """Count one for a label set not seen before: a new tally, or past
        ``CHILD_CACHE_LIMIT`` of them, straight into the child (correct, only slower)."""
        child = metric.labels(*labels)
        if len(cache) < CHILD_CACHE_LIMIT:
            t = cache[key] = self._tallies.tally(child)
            t.n += 1
        else:
            child.inc()

    def dashboard_counters(self) -> dict[str, float]:
        """Running totals and current lags for the admin dashboard's charts."""
        get = self.registry.get_sample_value
        failed = sum(get(n.TRANSACTION_ATTEMPTS + "_total", {"outcome": o}) or 0.0
                     for o in n.TRANSACTION_OUTCOMES if o != "success")
        lags = [s.value for m in self._repl_lag.collect() for s in m.samples]
        return {
            "transactions_sent": get(n.SENT_TRANSACTIONS + "_total") or 0.0,
            "transactions_failed": failed,
            "pdus_delivered": get(n.DELIVERED_PDUS + "_total") or 0.0,
            "edus_sent": get(n.SENT_EDUS + "_total") or 0.0,
            "replication_lag": max(lags, default=0.0),
            "event_processing_lag_s": get(n.EVENT_PROCESSING_LAG_S) or 0.0,
        }

    def item_dropped(self, kind: str, reason: str, count: int = 1) -> None:
        """``kind``: ``pdu`` or an EDU type; ``reason``: e.g. ``too_large``,
        ``max_failures``, ``catchup`` (queue dropped for catch-up)."""
        self._dropped.labels(kind, reason).inc(count)

    def replication_position(self, stream: str, instance: str, token: int, lag: int) -> None:
        self._repl_pos.labels(stream, instance).set(token)
        self._repl_lag.labels(stream, instance).set(max(0, lag))

    def replication_batch(self, stream: str, rows: int) -> None:
        self._repl_batches.labels(stream).inc()
        if rows:
            self._repl_rows.labels(stream).inc(rows)

    def event_processing_lag(self, seconds: float, *, position: int | None = None,
                             last_ts_ms: int | None = None) -> None:
        """Lag of the event reader behind persistence (seconds; exported in ms too,
        under Synapse's name)."""
        seconds = max(0.0, seconds)
        self._lag_s.set(seconds)
        self._lag_ms_child.set(seconds * 1000.0)
        if position is not None:
            self._position_child.set(position)
        if last_ts_ms is not None:
            self._last_ts_child.set(last_ts_ms)

    def pdus_queued_lag(self, seconds: float, pdus: int) -> None:
        """``pdus`` PDUs of one fan-out batch were queued ``seconds`` after the newest
        of them was announced (Synapse's ``event_processing_lag_by_event``, one
        observation per PDU; the batch's older PDUs are counted with its newest's lag)."""
        child, seconds = self._lag_by_event_child, max(0.0, seconds)
        for _ in range(pdus):
            child.observe(seconds)

    def short_retry(self, answered: bool) -> None:
        """One retry of the short-retry phase."""
        self._short_retries.labels("answered" if answered else "unanswered").inc()

    def short_retry_phase_ended(self, answered: bool) -> None:
        self._short_phases.labels("answered" if answered else "backed_off").inc()

    def return_probe(self, up: bool) -> None:
        self._return_probes.labels("up" if up else "down").inc()

    def catchup_step(self, outcome: str) -> None:
        self._catchup_steps.labels(outcome).inc()

    def send_time_filtered(self, withheld: Mapping[str, int], pruned: int) -> None:
        for reason, count in withheld.items():
            self._send_time_withheld.labels(reason).inc(count)
        if pruned:
            self._send_time_pruned.inc(pruned)

    def pacing_confirmation(self, outcome: str, waited_s: float) -> None:
        self._pacing_confirmations.labels(outcome).inc()
        self._pacing_wait.inc(waited_s)

    def shard_membership(self, live_instances: int, leases_held: int) -> None:
        self._live_instances.set(live_instances)
        self._leases_held.set(leases_held)


CHILD_CACHE_LIMIT = 256
"""Labelled children kept per metric (HTTP codes, EDU types: a few dozen in practice);
past it, a new label set is resolved on each use (correct, only slower)."""


_M = TypeVar("_M", Counter, Histogram)
_K = TypeVar("_K", bound=Hashable)


def _child(cache: dict[_K, _M], metric: _M, key: _K, labels: tuple[str, ...]) -> _M:
    child = cache.get(key)
    if child is None:
        child = metric.labels(*labels)
        if len(cache) < CHILD_CACHE_LIMIT:
            cache[key] = child
    return child


SERVER_NAME_LABEL = "server_name"


class ServerNameLabelled:
    """The registry as scraped: every ``synapse_*`` sample also carries
    ``server_name="<ours>"``, as Synapse labels its own (so a dashboard or alert that
    selects by server name finds the worker's series). Added at scrape time: recording
    stays as cheap as before, and our own ``federation_sender_*`` series are unchanged."""

    def __init__(self, registry: CollectorRegistry, server_name: str) -> None:
        self._registry = registry
        self._server_name = server_name

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            if family.name.startswith("synapse_"):
                family.samples = [
                    s._replace(labels={**s.labels, SERVER_NAME_LABEL: self._server_name})
                    for s in family.samples
                ]
            yield family


def metrics_app(registry: CollectorRegistry, server_name: str | None = None) -> web.Application:
    """``GET /metrics`` (and Synapse's ``/_synapse/metrics``) in text exposition format;
    with ``server_name``, Synapse's series carry it as a label (:class:`ServerNameLabelled`)."""
    source = registry if server_name is None else ServerNameLabelled(registry, server_name)

    async def scrape(request: web.Request) -> web.Response:
        body = generate_latest(source)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    app.router.add_get("/_synapse/metrics", scrape)
    return app

