"""What the queue engine reports, as a Protocol; telemetry implements it.

The queue calls these synchronously on the event loop; implementations must be cheap
and must not raise. :class:`NoopObserver` is the default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from federation_sender.queue.destination import DestinationState
from federation_sender.transport.result import Outcome


class QueueObserver(Protocol):
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
        """After every attempt (including failures and deadline expiries)."""

    def item_dropped(self, destination: str, item_type: str, reason: str) -> None:
        """An item was given up: ``item_type`` is ``pdu`` or an EDU type; ``reason`` is
        ``too_large``, ``refused`` or ``catchup`` (volatile items dropped on entering
        catch-up, reported once per queue with the count in ``item_type``)."""

    def state_changed(
        self, destination: str, old: DestinationState, new: DestinationState
    ) -> None: ...

    def backoff_changed(self, destination: str, retry_interval_s: float) -> None:
        """0 means reset."""

    def catchup_entered(self, destination: str, dropped_items: int) -> None: ...

    def catchup_progress(self, destination: str, rooms: int, pdus: int) -> None: ...

    def events_processed(self, count: int, position: int, fanned_out: int) -> None:
        """The intake finished a batch: events read, new position, PDUs enqueued."""

    def queues_changed(self, active: int) -> None:
        """The number of live destination queues changed."""


class NoopObserver:
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
        pass

    def item_dropped(self, destination: str, item_type: str, reason: str) -> None:
        pass

    def state_changed(
        self, destination: str, old: DestinationState, new: DestinationState
    ) -> None:
        pass

    def backoff_changed(self, destination: str, retry_interval_s: float) -> None:
        pass

    def catchup_entered(self, destination: str, dropped_items: int) -> None:
        pass

    def catchup_progress(self, destination: str, rooms: int, pdus: int) -> None:
        pass

    def events_processed(self, count: int, position: int, fanned_out: int) -> None:
        pass

    def queues_changed(self, active: int) -> None:
        pass
