"""Adapts the queue engine's :class:`QueueObserver` hooks to metrics and spans.

The queue reports each transaction attempt when it ends, with its duration; the span
is recorded with explicit start and end times so traces show the real attempt.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Status, StatusCode

from federation_sender.clock import Clock
from federation_sender.queue.destination import DestinationState
from federation_sender.telemetry import names as n
from federation_sender.telemetry.metrics import Metrics
from federation_sender.transport.result import Outcome

log = logging.getLogger("federation_sender.queue.events")


class TelemetryObserver:
    """Implements :class:`federation_sender.queue.observer.QueueObserver`."""

    def __init__(self, metrics: Metrics, provider: TracerProvider | None, clock: Clock) -> None:
        self._metrics = metrics
        self._tracer = provider.get_tracer("federation_sender.queue") if provider else None
        self._clock = clock
        self.events_processed_total = 0
        self.last_position = 0
        self._pokes: deque[tuple[int, float]] = deque(maxlen=10_000)

    def note_poke(self, token: int) -> None:
        """The events stream announced ``token``: the clock starts for its lag."""
        if not self._pokes or token > self._pokes[-1][0]:
            self._pokes.append((token, self._clock.monotonic_s()))

    def transaction_sent(
        self,
        destination: str,
        txn_id: str,
        outcome: Outcome,
        http_status: int | None,
        pdu_count: int,
        edu_count: int,
        edu_types: Mapping[str, int],
        request_bytes: int,
        duration_s: float,
        catchup: bool,
    ) -> None:
        self._metrics.transaction_finished(
            destination, outcome.value, pdu_count, edu_types, duration_s
        )
        if self._tracer is None:
            return
        end_ns = int(self._clock.time_s() * 1e9)
        start_ns = end_ns - int(max(0.0, duration_s) * 1e9)
        span = self._tracer.start_span(
            n.SPAN_TRANSACTION,
            start_time=start_ns,
            attributes={
                n.ATTR_DESTINATION: destination,
                n.ATTR_TXN_ID: txn_id,
                n.ATTR_PDU_COUNT: pdu_count,
                n.ATTR_EDU_COUNT: edu_count,
                n.ATTR_CATCHUP: catchup,
                n.ATTR_OUTCOME: outcome.value,
            },
        )
        if http_status is not None:
            span.set_attribute(n.ATTR_HTTP_STATUS, http_status)
        if outcome is not Outcome.SUCCESS:
            span.set_status(Status(StatusCode.ERROR, outcome.value))
        span.end(end_time=end_ns)

    def item_dropped(self, destination: str, item_type: str, reason: str) -> None:
        self._metrics.item_dropped(item_type, reason)

    def state_changed(
        self, destination: str, old: DestinationState, new: DestinationState
    ) -> None:
        log.debug("destination %s: %s -> %s", destination, old.value, new.value)

    def backoff_changed(self, destination: str, retry_interval_s: float) -> None:
        pass

    def catchup_entered(self, destination: str, dropped_items: int) -> None:
        if dropped_items:
            self._metrics.item_dropped("queued", "catchup", dropped_items)

    def catchup_progress(self, destination: str, rooms: int, pdus: int) -> None:
        self._metrics.catchup_step("success")
        if self._tracer is not None:
            now_ns = int(self._clock.time_s() * 1e9)
            span = self._tracer.start_span(
                n.SPAN_CATCHUP_STEP,
                start_time=now_ns,
                attributes={
                    n.ATTR_DESTINATION: destination,
                    n.ATTR_ROOMS: rooms,
                    n.ATTR_EVENTS: pdus,
                },
            )
            span.end(end_time=now_ns)

    def events_processed(self, count: int, position: int, fanned_out: int) -> None:
        self.events_processed_total += count
        self.last_position = position
        announced: float | None = None
        while self._pokes and self._pokes[0][0] <= position:
            announced = self._pokes.popleft()[1]
        # Lag: from the replication announcement of the newest event now fanned out to
        # the end of its fan-out (0 once the intake is caught up and idle).
        lag = 0.0 if announced is None else self._clock.monotonic_s() - announced
        self._metrics.event_processing_lag(
            lag, position=position, last_ts_ms=int(self._clock.time_s() * 1000)
        )

    def queues_changed(self, active: int) -> None:
        pass
