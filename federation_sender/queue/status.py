"""The queryable state of a destination queue (for the admin API)."""

from __future__ import annotations

from dataclasses import dataclass

from federation_sender.queue.destination import DestinationState


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
    """Wall-clock ms of the next retry while backing off, else None."""
    retry_interval_ms: int
    catching_up: bool
    last_successful_stream_ordering: int | None
