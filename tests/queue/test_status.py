"""The queue's read model: a destination's status (parked destinations, in-flight ages)."""

from __future__ import annotations

from federation_sender.queue.core.states import DestinationState
from federation_sender.queue.core.status import oldest_age_s, parked_status


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

