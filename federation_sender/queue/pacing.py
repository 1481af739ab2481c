"""Pacing a catch-up replay so that a receiver which stages what it is sent keeps it.

Synapse answers ``/send`` once a transaction's PDUs are in its inbound staging table
(``federation_inbound_events_staging``), before it processes them, one room at a
time. Once a room holds 100 staged events it prunes them down to their forward
extremities (``prune_staged_events_in_room``): what was pruned is absent until someone
backfills. Sending a long gap back to back (a transaction holds at most 50 PDUs)
fills that queue faster than it drains.

So a catch-up transaction that sends the leading chunk of a room (the rest of the
room's events follow in the next one: ``Batch.catchup_position`` is None) is
*confirmed* before the next catch-up transaction goes out: the runner asks the
receiver for the chunk's last event (``GET /_matrix/federation/v1/event/{eventId}``).
Synapse answers it from its events table (``on_pdu_request``, ``get_persisted_pdu``):
a 200 means the event was processed and persisted, and since a room's staged events
are processed oldest first, so were the chunk's others; a 404 means not yet. At most
one chunk per room (50 events, half the limit) is then staged at a time.

Bounded: the confirmation has a deadline (``deadline_s``); past it, or when the
receiver does not answer the request at all, the queue sends on as it would without
pacing (a log line and a metric say so), and does not wait for that destination
again for ``off_after_failure_s``. Only this destination's queue waits; it holds no
transaction slot while it does.

Pure: the runner does the requests and the waiting.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass

from federation_sender.queue.batching import Batch

__all__ = ["CatchupPacing"]


@dataclass(frozen=True, slots=True)
class CatchupPacing:
    deadline_s: float = 30.0
    """How long one confirmation may take; 0 turns pacing off."""
    first_poll_s: float = 0.05
    """The first pause between two requests for the same event (doubling)."""
    max_poll_s: float = 1.0
    """The longest pause between two requests for the same event."""
    off_after_failure_s: float = 600.0
    """After a confirmation failed, this destination is not paced for so long."""

    @property
    def enabled(self) -> bool:
        return self.deadline_s > 0

    def event_to_confirm(self, batch: Batch, refused: Collection[str] = ()) -> str | None:
        """The event the receiver must hold before the next catch-up transaction: the
        last PDU of a catch-up batch that leaves the rest of its room for later, not
        counting PDUs the receiver refused in its answer (``refused``: they are never
        persisted). None: send on at once (a live batch, or one that completes its
        rooms)."""
        if not self.enabled or not batch.catchup or batch.catchup_position is not None:
            return None  # live, or every room of the batch is complete
        for pdu in reversed(batch.pdus):
            if pdu.event_id not in refused:
                return pdu.event_id
        return None

    def poll_delays(self) -> Iterator[float]:
        """Pauses between requests: doubling from ``first_poll_s`` up to ``max_poll_s``."""
        delay = self.first_poll_s
        while True:
            yield delay
            delay = min(self.max_poll_s, delay * 2)

    def paced_after(self, failed_at_s: float | None, now_s: float) -> bool:
        """Whether to confirm for a destination whose last confirmation failed at
        ``failed_at_s`` (monotonic; None: never)."""
        return self.enabled and (
            failed_at_s is None or now_s - failed_at_s >= self.off_after_failure_s
        )
