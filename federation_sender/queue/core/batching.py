"""Building transactions from pending items: pure, deterministic, no I/O.

A transaction carries at most ``max_pdus`` PDUs and ``max_edus`` EDUs and its estimated
body stays under ``max_bytes`` (an item larger than the budget on its own still goes,
alone, so it can be refused with 413 and dropped rather than stall the queue). EDUs go
in this order: presence, receipts, to-device (leaving slots for device-list updates),
device lists, other EDUs, keyed EDUs. As in Synapse, one presence EDU carries at most
50 states and at most 5 receipt EDUs go in one transaction.

:meth:`Batch.split` halves a batch; the queue uses it on 413 and to isolate the item a
destination keeps refusing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from federation_sender.config import QueueSettings
from federation_sender.queue.core.items import (
    EduItem,
    EduKind,
    JsonDict,
    PduItem,
    PendingItems,
    make_edu,
)

TXN_OVERHEAD_BYTES = 160
"""origin, origin_server_ts, the two array brackets and keys."""

MAX_PRESENCE_STATES_PER_EDU = 50
"""Synapse's bound on one ``m.presence`` EDU; the rest waits for the next transaction."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_pdus: int = 50
    max_edus: int = 100
    max_bytes: int = 4_000_000
    device_list_reserve: int = 10
    """EDU slots kept from to-device messages while device-list updates wait."""
    max_receipt_edus: int = 5
    """Receipt EDUs per transaction (Synapse's limit): a burst of receipts cannot crowd
    out to-device messages and device-list updates."""

    @classmethod
    def from_settings(cls, q: QueueSettings) -> Limits:
        return cls(
            max_pdus=q.max_pdus_per_txn,
            max_edus=q.max_edus_per_txn,
            max_bytes=q.max_txn_bytes,
            device_list_reserve=max(1, q.max_edus_per_txn // 10),
        )


@dataclass(frozen=True, slots=True)
class Batch:
    """The content of one transaction, frozen until it is delivered or split."""

    pdus: tuple[PduItem, ...]
    edus: tuple[EduItem, ...]
    catchup: bool = False
    catchup_position: int | None = None
    """On success, ``last_successful_stream_ordering`` advances to this (catch-up)."""
    catchup_prune: tuple[tuple[str, int], ...] = ()
    """``destination_rooms`` rows to delete on success (rooms the destination left)."""
    probe: bool = False
    """An empty transaction sent to learn whether the destination is up."""
    _size: int | None = field(default=None, compare=False, repr=False)
    _max_so: int | None = field(default=None, compare=False, repr=False)

    @property
    def size_bytes(self) -> int:
        """Estimated body size (computed once: batches are immutable)."""
        cached: int | None = self._size
        if cached is None:
            cached = (
                TXN_OVERHEAD_BYTES
                + sum(p.size + 1 for p in self.pdus)
                + sum(e.size + 1 for e in self.edus)
            )
            object.__setattr__(self, "_size", cached)
        return cached

    @property
    def item_count(self) -> int:
        return len(self.pdus) + len(self.edus)

    def __bool__(self) -> bool:
        # Asked several times per transaction: no item count, just "any at all".
        return bool(self.pdus) or bool(self.edus) or self.probe

    @property
    def max_stream_ordering(self) -> int | None:
        if not self.pdus:
            return None
        cached: int | None = self._max_so
        if cached is None:
            cached = max([p.stream_ordering for p in self.pdus])
            object.__setattr__(self, "_max_so", cached)
        return cached

    def pdu_json(self) -> list[JsonDict]:
        return [p.pdu for p in self.pdus]

    def pdu_bytes(self) -> list[bytes] | None:
        """The PDUs' canonical encodings in order, if every item carries its own."""
        encoded = [p.encoded for p in self.pdus]
        return None if None in encoded else encoded  # type: ignore[return-value]

    def edu_json(self) -> list[JsonDict]:
        return [e.as_json() for e in self.edus]

    def split(self) -> tuple[Batch, Batch]:
        """Two non-empty halves by item count (PDUs first), order kept. The catch-up
        position rides on the second half. A pruned room's row rides on the last half
        holding one of the room's PDUs (else on the second): the first half may be
        quarantined while the second goes through, and a row deleted before its
        room's event is delivered is never read by catch-up again. Requires at least
        two items."""
        if self.item_count < 2:
            raise ValueError("cannot split a batch of fewer than two items")
        items: list[PduItem | EduItem] = [*self.pdus, *self.edus]
        mid = len(items) // 2
        first, second = items[:mid], items[mid:]
        second_rooms = {i.room_id for i in second if isinstance(i, PduItem)}
        first_rooms = {i.room_id for i in first if isinstance(i, PduItem)} - second_rooms
        prune_first = tuple(r for r in self.catchup_prune if r[0] in first_rooms)
        prune_second = tuple(r for r in self.catchup_prune if r[0] not in first_rooms)

        def make(part: list[PduItem | EduItem], last: bool,
                 prune: tuple[tuple[str, int], ...]) -> Batch:
            return Batch(
                pdus=tuple(i for i in part if isinstance(i, PduItem)),
                edus=tuple(i for i in part if isinstance(i, EduItem)),
                catchup=self.catchup,
                catchup_position=self.catchup_position if last else None,
                catchup_prune=prune,
            )

        return make(first, False, prune_first), make(second, True, prune_second)


class Budget:
    """What one transaction under construction has used of its byte budget."""

    def __init__(self, limits: Limits, used_bytes: int = TXN_OVERHEAD_BYTES) -> None:
        self.limits = limits
        self.used = used_bytes
        self.items = 0

    def fits(self, size: int) -> bool:
        # The first item always fits: an oversized item goes alone.
        return self.items == 0 or self.used + size + 1 <= self.limits.max_bytes

    def add(self, size: int) -> None:
        self.used += size + 1
        self.items += 1


def take_batch(pending: PendingItems, limits: Limits) -> Batch:
    """Remove and return the next transaction's content from ``pending``."""
    budget = Budget(limits)
    queue = pending.pdus
    pdus = queue.head(limits.max_pdus)
    n = len(pdus)
    total = sum([p.size for p in pdus]) + n
    if budget.used + total <= limits.max_bytes:
        # The common case: the next ``max_pdus`` fit the byte budget.
        budget.used += total
        budget.items += n
    else:
        n = 0
        while n < len(pdus) and budget.fits(pdus[n].size):
            budget.add(pdus[n].size)
            n += 1
        del pdus[n:]
    queue.drop(n)
    edus = take_edus(pending, limits, budget) if pending.has_edus() else []
    # PDUs handed over in stream order end with the highest one.
    top = None if not pdus or pending.unsorted else pdus[-1].stream_ordering
    return Batch(tuple(pdus), tuple(edus), _size=budget.used, _max_so=top)


def take_edus(
    pending: PendingItems, limits: Limits, budget: Budget | None = None
) -> list[EduItem]:
    """EDUs in transaction order; used alone for catch-up transactions."""
    budget = budget or Budget(limits)
    edus: list[EduItem] = []
    room = limits.max_edus

    if pending.presence and room > 0:
        users = list(itertools.islice(pending.presence, MAX_PRESENCE_STATES_PER_EDU))
        edu = make_edu(
            EduKind.PRESENCE, "m.presence", {"push": [pending.presence[u] for u in users]}
        )
        if budget.fits(edu.size):
            for u in users:
                del pending.presence[u]
            budget.add(edu.size)
            edus.append(edu)
            room -= 1
    receipts = pending.receipts
    receipt_room = limits.max_receipt_edus
    while receipts and room > 0 and receipt_room > 0:
        edu = make_edu(EduKind.RECEIPT, "m.receipt", receipts[0])
        if not budget.fits(edu.size):
            break
        del receipts[0]
        budget.add(edu.size)
        edus.append(edu)
        room -= 1
        receipt_room -= 1

    reserve = min(len(pending.device_lists), limits.device_list_reserve)
    _drain(pending.to_device, max(0, room - reserve), budget, edus)
    room = limits.max_edus - len(edus)
    room = _drain(pending.device_lists, room, budget, edus)
    room = _drain(pending.other, room, budget, edus)
    keyed = pending.keyed
    while keyed and room > 0:
        k, edu = next(iter(keyed.items()))
        if not budget.fits(edu.size):
            break
        del keyed[k]
        budget.add(edu.size)
        edus.append(edu)
        room -= 1
    return edus


def _drain(q: list[EduItem], room: int, budget: Budget, out: list[EduItem]) -> int:
    n = 0
    while n < len(q) and room > 0 and budget.fits(q[n].size):
        budget.add(q[n].size)
        n += 1
        room -= 1
    out.extend(q[:n])
    del q[:n]
    return room


def fill_edus(batch: Batch, pending: PendingItems, limits: Limits) -> Batch:
    """``batch`` (a catch-up batch of PDUs) with pending EDUs added within what is
    left of the byte budget."""
    rest = Limits(
        max_pdus=limits.max_pdus,
        max_edus=limits.max_edus,
        max_bytes=max(0, limits.max_bytes - batch.size_bytes),
        device_list_reserve=limits.device_list_reserve,
    )
    edus = take_edus(pending, rest)
    if not edus:
        return batch
    return Batch(batch.pdus, tuple(edus), True, batch.catchup_position, batch.catchup_prune)
