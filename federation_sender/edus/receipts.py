"""``m.receipt`` EDUs from the replication ``receipts`` stream (see the package docstring).

Synapse's rule (``federation/sender/__init__.py:send_read_receipt``), kept here:

* only receipts of local users, and never ``m.read.private``;
* the room's current hosts other than us; fewer than :data:`SMALL_ROOM_HOSTS` of them:
  every host gets the receipt at once;
* otherwise, when the event was received less than :data:`RECENT_EVENT_MS` ago, every
  host at once; else only the event sender's server at once, and the others get the
  receipt queued without starting a transaction: it goes with their next transaction,
  or when :class:`WakeupQueue` reaches them. That queue wakes one destination every
  ``min(max_delay_s, 30 s / queued)`` seconds, so all are woken within 30 s
  (``max_delay_s`` is ``1 / federation_rr_transactions_per_room_per_second``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Iterable

from federation_sender.clock import Clock, time_ms
from federation_sender.edus import EduSink, RoomHosts
from federation_sender.ids import server_of
from federation_sender.queue.core.items import JsonDict
from federation_sender.replication.rows import ReceiptsRow

log = logging.getLogger(__name__)

PRIVATE_READ = "m.read.private"
SMALL_ROOM_HOSTS = 10
RECENT_EVENT_MS = 60_000
MAX_TIME_IN_QUEUE_S = 30.0
DEFAULT_MAX_DELAY_S = 1.0 / 50
"""Synapse's default ``federation_rr_transactions_per_room_per_second`` is 50."""


def receipt_json(row: ReceiptsRow) -> JsonDict:
    """The receipt as it goes in an ``m.receipt`` EDU (the thread id inside ``data``)."""
    data = dict(row.data)
    if row.thread_id is not None:
        data["thread_id"] = row.thread_id
    return {"event_ids": [row.event_id], "data": data}


Receipt = tuple[str, str, str, JsonDict]
"""(room_id, receipt_type, user_id, receipt json)"""


class WakeupQueue:
    """Destinations to wake, one at a time, all within :data:`MAX_TIME_IN_QUEUE_S`.

    A destination with no live queue could not hold its paced receipts: they wait here
    and are queued, waking it, when its turn comes."""

    def __init__(self, sink: EduSink, clock: Clock, max_delay_s: float) -> None:
        self._sink = sink
        self._clock = clock
        self._max_delay_s = max_delay_s
        self._queue: OrderedDict[str, list[Receipt]] = OrderedDict()
        self._more = asyncio.Event()

    def add(self, destination: str, held: Receipt | None = None) -> None:
        receipts = self._queue.setdefault(destination, [])
        if held is not None:
            receipts.append(held)
        self._more.set()

    def __len__(self) -> int:
        return len(self._queue)

    def _wake(self, destination: str, held: list[Receipt]) -> bool:
        if not held:
            return self._sink.wake(destination)
        for room_id, receipt_type, user_id, receipt in held:
            self._sink.enqueue_receipt(destination, room_id, receipt_type, user_id, receipt)
        return True

    async def run(self) -> None:
        """Drain forever; runs until cancelled."""
        while True:
            await self._more.wait()
            self._more.clear()
            delay = min(self._max_delay_s, MAX_TIME_IN_QUEUE_S / max(1, len(self._queue)))
            while self._queue:
                destination, held = self._queue.popitem(last=False)
                if not self._wake(destination, held):
                    continue  # already went with another transaction
                await self._clock.sleep(delay)
                if self._queue:
                    delay = min(delay, MAX_TIME_IN_QUEUE_S / len(self._queue))


class ReceiptFanout:
    """Implements the ``receipts`` stream's part of the replication handler."""

    def __init__(
        self,
        server_name: str,
        hosts: RoomHosts,
        sink: EduSink,
        clock: Clock,
        max_delay_s: float = DEFAULT_MAX_DELAY_S,
    ) -> None:
        self._server_name = server_name
        self._hosts = hosts
        self._sink = sink
        self._clock = clock
        self.wakeups = WakeupQueue(sink, clock, max_delay_s)

    def wanted(self, row: ReceiptsRow) -> bool:
        return server_of(row.user_id) == self._server_name and row.receipt_type != PRIVATE_READ

    async def on_rows(self, rows: Iterable[ReceiptsRow]) -> None:
        for row in rows:
            if self.wanted(row):
                await self._send(row)

    async def _send(self, row: ReceiptsRow) -> None:
        me = self._server_name
        domains = [d for d in await self._hosts.receipt_hosts(row.room_id) if d != me]
        if not domains:
            return
        delayed: list[str] = []
        if len(domains) >= SMALL_ROOM_HOSTS:
            meta = await self._hosts.event_meta(row.room_id, row.event_id)
            if meta is not None and time_ms(self._clock) - meta.received_ts >= RECENT_EVENT_MS:
                sender_domain = server_of(meta.sender)
                delayed = [d for d in domains if d != sender_domain]
                domains = [d for d in domains if d == sender_domain]
        receipt = receipt_json(row)
        for d in domains:
            self._sink.enqueue_receipt(d, row.room_id, row.receipt_type, row.user_id, receipt)
        for d in delayed:
            taken = self._sink.enqueue_receipt(
                d, row.room_id, row.receipt_type, row.user_id, receipt, wake=False
            )
            held = None if taken else (row.room_id, row.receipt_type, row.user_id, receipt)
            self.wakeups.add(d, held)
