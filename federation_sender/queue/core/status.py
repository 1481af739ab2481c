"""The queue's read model: each destination's :class:`DestinationStatus`, built from a
live queue's core or a parked destination's remembered retry. The admin API shows it;
the metrics' whole-queue gauges are its sums
(:meth:`~federation_sender.queue.manager.QueueManager.snapshot`). Nothing else reads a
queue's state."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from federation_sender.queue.core.states import DestinationState

if TYPE_CHECKING:
    from federation_sender.queue.core.destination import DestinationCore


@dataclass(frozen=True, slots=True)
class DestinationStatus:
    destination: str
    state: DestinationState
    pending_pdus: int
    pending_edus: int
    in_flight_txn_id: str | None
    in_flight_age_s: float | None
    in_flight_attempts: int
    last_error: str | None
    next_retry_ts_ms: int | None
    """Wall-clock ms of the next retry while backing off (or paused by a 429), else None."""
    retry_interval_ms: int
    catching_up: bool
    last_successful_stream_ordering: int | None
    last_success_ts_ms: int | None = None
    """Wall-clock ms of the last delivered transaction since the queue loaded, else None."""
    short_retrying: bool = False
    """In the short-retry phase (failed, retried in memory before a persisted backoff)."""


def live_status(
    core: DestinationCore, in_flight_since: float | None, now_s: float
) -> DestinationStatus:
    """A queue with a runner; ``in_flight_since`` (monotonic) while an attempt runs."""
    c = core
    return DestinationStatus(
        destination=c.destination,
        state=c.sm.state,
        pending_pdus=c.pending_pdus,
        pending_edus=c.pending_edus,
        in_flight_txn_id=(
            c.current.txn_id if c.current and in_flight_since is not None else None
        ),
        in_flight_age_s=now_s - in_flight_since if in_flight_since is not None else None,
        in_flight_attempts=c.current.attempts if c.current else 0,
        last_error=c.last_error,
        next_retry_ts_ms=c.retry_at_ms(),
        retry_interval_ms=c.backoff.retry_interval_ms,
        catching_up=c.catching_up,
        last_successful_stream_ordering=(
            c.last_successful if c.last_successful >= 0 else None
        ),
        last_success_ts_ms=c.last_success_ms,
        short_retrying=c.short_retry.in_phase,
    )


def parked_status(
    destination: str, retry_at_ms: int, retry_interval_ms: int, last_error: str | None
) -> DestinationStatus:
    """A destination parked in a long backoff: no runner, nothing in memory."""
    return DestinationStatus(
        destination=destination,
        state=DestinationState.BACKING_OFF,
        pending_pdus=0,
        pending_edus=0,
        in_flight_txn_id=None,
        in_flight_age_s=None,
        in_flight_attempts=0,
        last_error=last_error,
        next_retry_ts_ms=retry_at_ms,
        retry_interval_ms=retry_interval_ms,
        catching_up=True,
        last_successful_stream_ordering=None,
    )


def oldest_age_s(starts: Iterable[float | None], now_s: float) -> float | None:
    """Age of the oldest attempt in flight, from their monotonic start times."""
    oldest = min((t for t in starts if t is not None), default=None)
    return None if oldest is None else now_s - oldest
