"""The queue's read model: a destination's status (parked destinations, in-flight ages)
and the totals over the statuses that the metrics' gauges show."""

from __future__ import annotations

from dataclasses import replace

from federation_sender.queue.core.states import DestinationState
from federation_sender.queue.core.status import QueueTotals, oldest_age_s, parked_status


def test_a_parked_destination_is_backing_off_in_catch_up_with_nothing_in_memory() -> None:
    s = parked_status("d.test", retry_at_ms=5_000, retry_interval_ms=60_000,
                      last_error="HTTP 502")
    assert s.state is DestinationState.BACKING_OFF and s.catching_up
    assert (s.pending_pdus, s.pending_edus, s.in_flight_txn_id, s.in_flight_attempts) == (
        0, 0, None, 0,
    )
    assert (s.next_retry_ts_ms, s.retry_interval_ms, s.last_error) == (5_000, 60_000,
                                                                        "HTTP 502")
    assert s.last_successful_stream_ordering is None and not s.short_retrying


def test_the_oldest_attempt_in_flight_ignores_idle_runners() -> None:
    assert oldest_age_s([None, 7.0, 3.5, None], now_s=10.0) == 6.5
    assert oldest_age_s([None, None], now_s=10.0) is None
    assert oldest_age_s([], now_s=10.0) is None


def test_the_totals_count_each_status_once_per_property() -> None:
    parked = parked_status("a.test", retry_at_ms=5_000, retry_interval_ms=60_000,
                           last_error=None)
    sending = replace(parked, destination="b.test", state=DestinationState.SENDING,
                      pending_pdus=3, pending_edus=2, in_flight_txn_id="t1",
                      catching_up=False)
    retrying = replace(sending, destination="c.test", pending_pdus=1, pending_edus=0,
                       in_flight_txn_id=None, short_retrying=True)
    assert QueueTotals.of([parked, sending, retrying]) == QueueTotals(
        pending_pdus=4, pending_edus=2, backing_off=1, catching_up=1, short_retrying=1,
        in_flight_transactions=1,
    )
    assert QueueTotals.of([]) == QueueTotals()
