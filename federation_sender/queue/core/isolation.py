"""Item isolation: a pure policy deciding what a refused transaction means.

A refusal (400, or 500 with a response) of a transaction of several items splits it
(bisection). A single item refused alone is *quarantined*: it waits, spaced
(``retry_delay_ms``: 1 s, 2 s, 4 s ... at most 30 s), while the rest of the queue is
delivered, and is retried alone. It is dropped after ``max_item_failures`` refusals
(three times as many for a 500, which may just as well be a flaky server) **only if
something else got through in between**: a destination that refuses everything must
never make the queue drop everything. Without a success since the item's first refusal,
or after ``MAX_REFUSALS_WITHOUT_SUCCESS`` refusals in a row (a burst of poison items
being bisected), an empty *probe* transaction asks whether the destination is up; only
a refused probe blames the destination (a normal failure: backoff, the frozen
transaction kept).

Dropping an item is itself evidence that the destination works (something got through
since), so it resets the run of refusals: poison items one after another are each
dropped alone and never add up to a backoff of the whole queue.

No clock, no I/O: ``now_ms`` is passed in.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

from federation_sender.queue.core.batching import Batch
from federation_sender.queue.core.items import EduItem, PduItem

REFUSAL_STATUSES = frozenset({400, 500})
MAX_REFUSALS_WITHOUT_SUCCESS = 16
SERVER_ERROR_FACTOR = 3
"""Enough to bisect 150 items twice over; beyond it the destination is the problem."""
RETRY_BASE_MS = 1_000
RETRY_CAP_MS = 30_000


def retry_delay_ms(refusals: int) -> int:
    """How long a quarantined item waits after its ``refusals``-th refusal."""
    return min(RETRY_CAP_MS, RETRY_BASE_MS << min(refusals - 1, 16))


class Verdict(enum.Enum):
    SPLIT = "split"
    """Several items: bisect (the caller queues both halves in front)."""
    QUARANTINED = "quarantined"
    """Held, retried alone later."""
    PROBE = "probe"
    """Split (several items) or held (one); send an empty transaction first to learn
    whether the destination is up."""
    DROP = "drop"
    """Refused alone, again and again, while other transactions got through."""
    DESTINATION = "destination"
    """The destination, not an item, is broken: a normal failure."""


def failure_key(item: PduItem | EduItem) -> str | int:
    """PDUs by event id (catch-up re-reads them as new objects), outbox rows by stream
    id, other EDUs by identity."""
    if isinstance(item, PduItem):
        return item.event_id
    if item.outbox_key is not None:
        return f"{item.edu_type}/{item.outbox_key[0]}/{item.outbox_key[1]}/{item.outbox_key[2]}"
    return item.uid


def describe(item: PduItem | EduItem) -> str:
    """How the drop log line names an item: event id or message id, and stream id."""
    if isinstance(item, PduItem):
        return f"event {item.event_id} (stream {item.stream_ordering})"
    parts = [item.edu_type]
    message_id = item.content.get("message_id")
    if isinstance(message_id, str):
        parts.append(f"message_id {message_id}")
    if item.outbox_key is not None:
        sid, user, device = item.outbox_key
        parts.append(f"(stream {sid}{f', {user} {device}' if user else ''})")
    return " ".join(parts)


@dataclass(frozen=True, slots=True)
class Held:
    batch: Batch
    ready_at_ms: int


class ItemIsolation:
    __slots__ = (
        "failures",
        "max_item_failures",
        "quarantine",
        "refusals_without_success",
        "retry_first",
        "successes",
    )

    def __init__(self, max_item_failures: int = 3) -> None:
        self.max_item_failures = max_item_failures
        self.quarantine: list[Held] = []
        self.failures: dict[str | int, tuple[int, int]] = {}
        """failure key -> (refusals of the item alone, ``successes`` at the first one)"""
        self.successes = 0
        self.refusals_without_success = 0
        self.retry_first = False
        """A success just happened: a ready quarantined item goes before new items."""

    # --- what is held ----------------------------------------------------------------

    def __bool__(self) -> bool:
        return bool(self.quarantine)

    def batches(self) -> Iterator[Batch]:
        return (h.batch for h in self.quarantine)

    def clear(self) -> None:
        self.quarantine.clear()
        self.failures.clear()

    def take_ready(self, now_ms: int, others_waiting: bool) -> Batch | None:
        """The first quarantined batch due for a retry, unless new items should go
        first (``others_waiting`` and no success since the last retry)."""
        if not self.quarantine or (others_waiting and not self.retry_first):
            return None
        for i, held in enumerate(self.quarantine):
            if held.ready_at_ms <= now_ms:
                del self.quarantine[i]
                self.retry_first = False
                return held.batch
        return None

    def next_ready_ms(self) -> int | None:
        return min((h.ready_at_ms for h in self.quarantine), default=None)

    # --- results -----------------------------------------------------------------------

    def is_refusal(self, status: int | None, batch: Batch) -> bool:
        """A refusal to handle here, rather than a failure of the destination."""
        return status in REFUSAL_STATUSES and not batch.probe

    def on_success(self, batch: Batch) -> None:
        self.successes += 1
        self.refusals_without_success = 0
        self.retry_first = bool(self.quarantine)
        if self.failures:
            for p in batch.pdus:
                self.failures.pop(p.event_id, None)
            for e in batch.edus:
                self.failures.pop(failure_key(e), None)

    def on_destination_failure(self) -> None:
        self.refusals_without_success = 0

    def on_refusal(self, batch: Batch, status: int | None, now_ms: int) -> Verdict:
        """``batch`` was refused (:meth:`is_refusal` said so)."""
        self.refusals_without_success += 1
        # Many refusals and no success: time to ask whether the destination is up.
        ask = self.refusals_without_success >= MAX_REFUSALS_WITHOUT_SUCCESS
        if batch.item_count >= 2:
            return Verdict.PROBE if ask else Verdict.SPLIT
        items: list[PduItem | EduItem] = [*batch.pdus, *batch.edus]
        if not items:
            return Verdict.DESTINATION
        limit = self.max_item_failures
        if status != 400:
            # A 400 names the transaction as bad; a 500 may be a server failing at
            # random (at a 20 % error rate: 0.2**9 instead of 0.2**3 per held item).
            limit *= SERVER_ERROR_FACTOR
        key = failure_key(items[0])
        n, since = self.failures.get(key, (0, self.successes))
        n += 1
        self.failures[key] = (n, since)
        if n < limit:
            self.quarantine.append(Held(batch, now_ms + retry_delay_ms(n)))
            return Verdict.PROBE if ask else Verdict.QUARANTINED
        if self.successes > since:
            # Refused alone, again and again, while other transactions got through:
            # the item is the problem, not the destination.
            self.forget(batch)
            self.refusals_without_success = 0
            return Verdict.DROP
        if n == limit:
            # Nothing else got through meanwhile: ask the destination whether it is up
            # (the caller sends an empty transaction) before blaming the item.
            self.quarantine.insert(0, Held(batch, now_ms + retry_delay_ms(n)))
            return Verdict.PROBE
        return Verdict.DESTINATION

    def supersede(self, key: tuple[str, Hashable]) -> None:
        """A newer keyed EDU was queued: a held older one must not be sent after it."""
        if not self.quarantine:
            return
        stale = [h for h in self.quarantine if any(e.key == key for e in h.batch.edus)]
        for h in stale:
            self.quarantine.remove(h)
            self.forget(h.batch)

    def forget(self, batch: Batch) -> None:
        items: list[PduItem | EduItem] = [*batch.pdus, *batch.edus]
        for item in items:
            self.failures.pop(failure_key(item), None)
