"""Composing the next transaction from what a destination queue holds: complete and
prompt at once. Pure, deterministic, no I/O.

A room whose PDUs the receiver has not confirmed yet is *held*
(:class:`~federation_sender.queue.core.pacing.RoomPacer`: a receiving Synapse stages
what it accepts and prunes a room's staging queue past 100 events). Pacing is per room,
as the receiver's limit is: a held room holds back only its own PDUs. Around that, one
transaction is filled in this order, within ``max_pdus``, ``max_edus`` and ``max_bytes``:

1. what is new: the PDUs of *live* rooms, rooms with at most :data:`LIVE_ROOM_PDUS`
   pending, oldest first, up to every PDU slot, or up to half of them and half the
   bytes when a backlogged room could send too (so neither starves the other);
2. the next page of *backlogged* rooms (more than :data:`LIVE_ROOM_PDUS` pending),
   round-robin (:class:`RoomRotation`): in turn order, each given the slots left; a
   room that got some goes to the back. Slots still left go to the live PDUs past the
   half: a transaction leaves a sendable PDU behind only when it is full (its PDU
   limit, or the byte limit for that PDU);
3. EDUs (presence, receipts, to-device, device lists, typing...), as
   :func:`~federation_sender.queue.core.batching.take_edus` orders them: they never
   wait behind PDUs, held or not.

A room's own order is kept: its PDUs are taken from its front, and once one of them
does not fit the byte budget none after it goes in the same transaction. A live event
of a backlogged room waits behind that room's backlog only. The transaction lists its
PDUs in the queue's order (stream order, as handed over).

The common cases take the plain path
(:func:`~federation_sender.queue.core.batching.take_batch`, the oldest ``max_pdus`` in
order): no held room and either at most one transaction's worth pending (by count and
bytes) or every pending PDU in one room (a big room's spike: nothing to be fair
between). Otherwise the composer looks at the oldest :data:`SCAN_LIMIT`
pending PDUs: a room whose PDUs all lie beyond them waits until the queue's head gets
there (bounded work per transaction, whatever a queue holds).
"""

from __future__ import annotations

import itertools
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from federation_sender.queue.core.batching import (
    TXN_OVERHEAD_BYTES,
    Batch,
    Budget,
    Limits,
    take_batch,
    take_edus,
)
from federation_sender.queue.core.items import PduItem, PendingItems

__all__ = ["LIVE_ROOM_PDUS", "SCAN_LIMIT", "RoomRotation", "compose", "edus_only"]

LIVE_ROOM_PDUS = 5
"""A room with at most this many pending PDUs is *live* (what is new); a room with
more is *backlogged* (a catch-up, a burst, what a short outage left)."""

SCAN_LIMIT = 5_000
"""Pending PDUs the composer looks at, oldest first (100 transactions' worth)."""


@dataclass(slots=True)
class RoomRotation:
    """The round-robin over backlogged rooms: their turn order (a dict as an ordered
    set): a room that got PDUs into a transaction goes to the back, a new one joins
    there."""

    order: dict[str, None] = field(default_factory=dict)


def compose(pending: PendingItems, limits: Limits, held: AbstractSet[str],
            rotation: RoomRotation) -> Batch:
    """Remove and return the next transaction's content from ``pending``, leaving the
    PDUs of ``held`` rooms (and whatever does not fit) in it."""
    pdus = pending.pdus
    if not pdus:
        return take_batch(pending, limits)
    room = pdus.single_room()
    if room is not None:
        # One room (a big room's spike, one busy conversation): in order, unless held.
        if room not in held:
            return take_batch(pending, limits)
        return edus_only(pending, limits)
    if not held and len(pdus) <= limits.max_pdus and (
            TXN_OVERHEAD_BYTES + sum([p.size + 1 for p in pdus]) <= limits.max_bytes):
        return take_batch(pending, limits)  # all of them, in order
    return _compose_rooms(pending, limits, held, rotation)


def edus_only(pending: PendingItems, limits: Limits) -> Batch:
    """A transaction of the pending EDUs alone (the PDUs wait)."""
    budget = Budget(limits)
    edus = take_edus(pending, limits, budget) if pending.has_edus() else []
    return Batch((), tuple(edus), _size=budget.used)


def _compose_rooms(pending: PendingItems, limits: Limits, held: AbstractSet[str],
                   rotation: RoomRotation) -> Batch:
    window = list(itertools.islice(pending.pdus, SCAN_LIMIT))
    by_room: dict[str, list[int]] = {}
    for i, p in enumerate(window):
        ix = by_room.get(p.room_id)
        if ix is None:
            by_room[p.room_id] = [i]
        else:
            ix.append(i)
    live: list[int] = []
    backlogged: list[str] = []  # in the order of their oldest pending PDU
    for room_id, ix in by_room.items():
        if room_id in held:
            continue
        if len(ix) <= LIVE_ROOM_PDUS:
            live.extend(ix)
        else:
            backlogged.append(room_id)
    slots = limits.max_pdus
    live.sort()
    cap = slots // 2 if backlogged else slots
    live_bytes = limits.max_bytes // 2 if backlogged else limits.max_bytes
    budget = Budget(limits)
    taken: list[int] = []
    stopped: set[str] = set()

    def offer(indexes: list[int]) -> None:
        for i in indexes:
            if len(taken) == slots:
                return
            item = window[i]
            if item.room_id in stopped:
                continue
            if not budget.fits(item.size):
                stopped.add(item.room_id)  # the room's order: none of its later PDUs
                continue
            budget.add(item.size)
            taken.append(i)

    # What is new: up to half the slots and half the bytes while a backlog can send.
    n = 0
    for i in live[:cap]:
        if taken and budget.used + window[i].size + 1 > live_bytes:
            break
        offer([i])
        n += 1
    if backlogged:
        turns = rotation.order
        for room_id in backlogged:
            if room_id not in turns:
                turns[room_id] = None
        for room_id in [r for r in turns if r not in by_room]:
            del turns[room_id]  # nothing pending any more: the order stays bounded
        before = len(taken)
        for room_id in list(turns):
            if room_id in held or len(by_room[room_id]) <= LIVE_ROOM_PDUS:
                continue
            offer(by_room[room_id])
            if len(taken) > before:
                del turns[room_id]
                turns[room_id] = None  # its turn is over: to the back
                before = len(taken)
    offer(live[n:])  # what the backlog leaves room for
    taken.sort()
    batch_pdus: tuple[PduItem, ...] = tuple(window[i] for i in taken)
    pending.pdus.take(taken, len(window))
    edus = take_edus(pending, limits, budget) if pending.has_edus() else []
    top = batch_pdus[-1].stream_ordering if batch_pdus and not pending.unsorted else None
    return Batch(batch_pdus, tuple(edus), _size=budget.used, _max_so=top)
