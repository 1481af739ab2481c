"""Adapts the queue engine's :class:`QueueObserver` hooks to metrics, spans and logs.

A transaction attempt is spanned while it runs (:meth:`TelemetryObserver.attempt`), so
what runs inside it, the federation client's HTTP request span (and its discovery span
when discovery looks something up), become its children; the database write of its
result is a child that ends at the commit, after the attempt itself: the one record of
how long the group commit kept the result waiting, and of a failed write. A catch-up
step's span covers reading its plan.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Status, StatusCode

from federation_sender.clock import Clock
from federation_sender.queue.core.states import DestinationState
from federation_sender.telemetry import names as n
from federation_sender.telemetry.metrics import Metrics
from federation_sender.telemetry.tracing import Tracing, TransactionSpan, child_span_dropped
from federation_sender.transport.result import Outcome

log = logging.getLogger("federation_sender.queue.events")

_attempt: ContextVar[TransactionSpan | None] = ContextVar("federation_sender_attempt",
                                                         default=None)

_NO_SPAN: AbstractContextManager[None] = nullcontext()  # reusable: it holds no state


class TelemetryObserver:
    """Implements :class:`federation_sender.queue.observer.QueueObserver`."""

    def __init__(self, metrics: Metrics, provider: TracerProvider | None, clock: Clock) -> None:
        self._metrics = metrics
        self.tracing = Tracing(provider)
        self._clock = clock
        self._pokes: deque[tuple[int, float]] = deque(maxlen=10_000)

    def note_poke(self, token: int) -> None:
        """The events stream announced ``token``: the clock starts for its lag."""
        if not self._pokes or token > self._pokes[-1][0]:
            self._pokes.append((token, self._clock.monotonic_s()))

    def attempt(self, destination: str, txn_id: str, pdu_count: int, edu_count: int,
                catchup: bool) -> AbstractContextManager[None]:
        if not self.tracing.enabled:
            return _NO_SPAN  # nothing to record: no span, no attributes
        if self.tracing.roots_exhausted():
            return self.tracing.dropped_attempt()  # over the traces-per-second limit
        return self._traced_attempt(destination, txn_id, pdu_count, edu_count, catchup)

    @contextmanager
    def _traced_attempt(self, destination: str, txn_id: str, pdu_count: int,
                        edu_count: int, catchup: bool) -> Iterator[None]:
        # The runner has put destination and txn id in the log context already.
        with self.tracing.transaction_attempt(destination, txn_id, pdu_count=pdu_count,
                                              edu_count=edu_count, catchup=catchup,
                                              set_log_context=False) as span:
            token = _attempt.set(span)
            try:
                yield
            finally:
                _attempt.reset(token)

    def persisting(self, destination: str, committed: asyncio.Future[None]) -> None:
        tracer = self.tracing.tracer
        if child_span_dropped(tracer):
            return
        # No attributes: its parent, the transaction span, names the destination.
        span = tracer.start_span(n.SPAN_PERSIST)

        def done(f: asyncio.Future[None]) -> None:
            error = None if f.cancelled() else f.exception()
            if f.cancelled() or error is not None:
                span.set_status(Status(StatusCode.ERROR, type(error).__name__ if error
                                       else "cancelled"))
            span.end()

        committed.add_done_callback(done)

    def catchup_step(self, destination: str) -> AbstractContextManager[None]:
        if not self.tracing.enabled:
            return _NO_SPAN
        return self._traced_catchup_step(destination)

    @contextmanager
    def _traced_catchup_step(self, destination: str) -> Iterator[None]:
        with self.tracing.catchup_step(destination):
            yield

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
        span = _attempt.get()
        if span is not None:
            span.finish(outcome.value, http_status=http_status)

    def item_dropped(self, destination: str, item_type: str, reason: str) -> None:
        self._metrics.item_dropped(item_type, reason)

    def state_changed(
        self, destination: str, old: DestinationState, new: DestinationState
    ) -> None:
        if log.isEnabledFor(logging.DEBUG):  # twice per transaction: skip the enum reads
            log.debug("destination %s: %s -> %s", destination, old.value, new.value)

    def backoff_changed(self, destination: str, retry_interval_s: float) -> None:
        pass

    def catchup_entered(self, destination: str, dropped_items: int) -> None:
        if dropped_items:
            self._metrics.item_dropped("queued", "catchup", dropped_items)

    def short_retry(self, destination: str, answered: bool) -> None:
        self._metrics.short_retry(answered)

    def short_retry_phase_ended(self, destination: str, answered: bool) -> None:
        self._metrics.short_retry_phase_ended(answered)

    def return_probe(self, destination: str, up: bool) -> None:
        self._metrics.return_probe(up)

    def send_time_filtered(self, destination: str, withheld: Mapping[str, int],
                           pruned: int) -> None:
        self._metrics.send_time_filtered(withheld, pruned)

    def catchup_progress(self, destination: str, rooms: int, pdus: int) -> None:
        self._metrics.catchup_step("success")
        step = trace.get_current_span()  # called inside catchup_step
        step.set_attribute(n.ATTR_ROOMS, rooms)
        step.set_attribute(n.ATTR_EVENTS, pdus)

    def pacing_confirmed(self, destination: str, outcome: str, waited_s: float) -> None:
        self._metrics.pacing_confirmation(outcome, waited_s)

    def events_processed(self, count: int, position: int, fanned_out: int, *,
                         pdus: int = 0, rooms: int = 0, duration_s: float = 0.0) -> None:
        self._metrics.events_fanned_out(count, rooms, pdus, fanned_out, duration_s=duration_s)
        announced: float | None = None
        while self._pokes and self._pokes[0][0] <= position:
            announced = self._pokes.popleft()[1]
        # Lag: from the replication announcement of the newest event now fanned out to
        # the end of its fan-out (0 once the fan-out is caught up and idle).
        lag = 0.0 if announced is None else self._clock.monotonic_s() - announced
        self._metrics.event_processing_lag(
            lag, position=position, last_ts_ms=int(self._clock.time_s() * 1000)
        )
        if announced is not None and pdus:
            self._metrics.pdus_queued_lag(lag, pdus)

    def queues_changed(self, active: int) -> None:
        pass
