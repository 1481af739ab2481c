"""Event intake: new events from the database, fanned out to destination queues.

On a poke (or a poll), read events past the persisted position up to the poked token,
``batch_size`` at a time. For each event that originates here and is not out-of-band,
the destinations are the servers joined to the room after the event, plus the target's
server of a leave/ban (a kicked or leaving server receives its own kick or leave), minus
ourselves, filtered by the shard. Per batch, in one database transaction:
``destinations`` and ``destination_rooms`` are upserted and the position is saved; only
then are the PDUs handed to the queues, in stream order. A crash between the commit and
the hand-over loses nothing: queues start in catch-up mode, which reads
``destination_rooms``.

Room membership for all rooms of a batch is resolved with at most two queries through
:class:`RoomHostsCache` (rooms in parallel, events of a room in order), instead of a
query per room or per event.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from federation_sender.clock import Clock
from federation_sender.queue.catchup import is_sendable, server_of
from federation_sender.queue.items import PduItem
from federation_sender.queue.observer import QueueObserver
from federation_sender.queue.timing import wait_or_timeout
from federation_sender.storage import destinations as dst
from federation_sender.storage import events as ev
from federation_sender.storage import positions as pos
from federation_sender.storage.engine import run_in_transaction
from federation_sender.storage.events import EventRow
from federation_sender.storage.rooms import RoomHostsCache

log = logging.getLogger(__name__)


def _everyone(_destination: str) -> bool:
    return True


def recipients(
    event: EventRow, joined: frozenset[str], server_name: str, shard: Callable[[str], bool]
) -> list[str]:
    dests = set(joined)
    if event.type == "m.room.member" and event.state_key:
        try:
            membership = json.loads(event.json).get("content", {}).get("membership")
        except ValueError:
            membership = None
        if membership in ("leave", "ban"):
            dests.add(server_of(event.state_key))
    dests.discard(server_name)
    dests.discard("")
    return sorted(d for d in dests if shard(d))


class EventIntake:
    def __init__(
        self,
        engine: AsyncEngine,
        server_name: str,
        instance_name: str,
        batch_size: int,
        shard_filter: Callable[[str], bool],
        enqueue: Callable[[str, Sequence[PduItem]], None],
        observer: QueueObserver,
        clock: Clock,
        poll_interval_s: float | None = None,
        hosts_cache: RoomHostsCache | None = None,
    ) -> None:
        self.engine = engine
        self.server_name = server_name
        self.instance_name = instance_name
        self.batch_size = batch_size
        self.shard = shard_filter
        self.enqueue = enqueue
        self.observer = observer
        self.clock = clock
        self.poll_interval_s = poll_interval_s
        self.hosts = hosts_cache or RoomHostsCache()
        self.position = 0
        self.target = 0
        self._poked = asyncio.Event()
        self.stopping = False
        self._known_destinations: set[str] = set()

    def _remember(self, names: set[str]) -> None:
        # Known to exist in ``destinations``: skip re-inserting them every batch. Bounded;
        # forgetting only costs a no-op insert.
        if len(self._known_destinations) + len(names) > 200_000:
            self._known_destinations.clear()
        self._known_destinations |= names

    async def load(self) -> None:
        """Load the persisted position; on first start, begin at the current end (there
        is nothing to catch up on for a worker that never sent anything)."""

        async def fn(conn: AsyncConnection) -> int:
            p = await pos.load_position(conn, pos.EVENTS_STREAM, self.instance_name)
            if p is None:
                p = await ev.max_stream_ordering(conn)
                await pos.save_position(conn, pos.EVENTS_STREAM, self.instance_name, p)
            return p

        self.position = await run_in_transaction(self.engine, fn)
        self.target = max(self.target, self.position)

    def notify(self, max_stream_ordering: int) -> None:
        if max_stream_ordering > self.target:
            self.target = max_stream_ordering
            self._poked.set()

    async def run(self) -> None:
        while not self.stopping:
            self._poked.clear()
            if self.poll_interval_s is not None:
                await self._poll()
            while self.position < self.target and not self.stopping:
                await self.process_batch()
            await wait_or_timeout(self.clock, self._poked, self.poll_interval_s)

    async def _poll(self) -> None:
        async def fn(conn: AsyncConnection) -> int:
            return await ev.max_stream_ordering(conn)

        self.notify(await run_in_transaction(self.engine, fn))

    def stop(self) -> None:
        self.stopping = True
        self._poked.set()

    async def process_batch(self) -> int:
        """Handle one batch; returns how many PDUs were handed to queues."""
        after, upto = self.position, self.target

        async def read(conn: AsyncConnection) -> tuple[list[EventRow], dict[str, list[Any]]]:
            rows = await ev.events_after(conn, after, upto, self.batch_size)
            sendable = [e for e in rows if is_sendable(e, self.server_name)]
            by_room: dict[str, list[int]] = {}
            for e in sendable:
                by_room.setdefault(e.room_id, []).append(e.stream_ordering)
            hosts = await self.hosts.hosts_for_events(conn, by_room)
            return rows, dict(hosts)

        rows, hosts = await run_in_transaction(self.engine, read)
        new_position = rows[-1].stream_ordering if len(rows) == self.batch_size else upto
        fanout: list[tuple[EventRow, list[str]]] = []
        index: dict[str, int] = {}
        for e in rows:
            if not is_sendable(e, self.server_name):
                continue
            i = index.get(e.room_id, 0)
            index[e.room_id] = i + 1
            # Every destination is recorded in destination_rooms, whichever instance
            # owns it now: during a shard membership change two instances' views
            # differ, and a destination recorded by nobody would never be caught up.
            # Only this instance's own destinations are queued.
            dests = recipients(e, hosts[e.room_id][i], self.server_name, _everyone)
            if dests:
                fanout.append((e, dests))

        # Per (destination, room) only the batch's last event matters: walk backwards.
        dr_rows: list[tuple[str, str, int]] = []
        seen: dict[str, set[str]] = {}
        for e, ds in reversed(fanout):
            done = seen.setdefault(e.room_id, set())
            fresh = set(ds) - done
            if fresh:
                done |= fresh
                dr_rows.extend((d, e.room_id, e.stream_ordering) for d in fresh)
        new_dests = {r[0] for r in dr_rows} - self._known_destinations

        async def write(conn: AsyncConnection) -> None:
            await dst.ensure_destinations(conn, new_dests)
            await dst.upsert_destination_rooms(conn, dr_rows, skip_destinations=True)
            await pos.save_position(conn, pos.EVENTS_STREAM, self.instance_name, new_position)

        await run_in_transaction(self.engine, write)
        self._remember(new_dests)
        self.position = new_position
        n = 0
        per_dest: dict[str, list[PduItem]] = {}
        for e, all_dests in fanout:
            dests = [d for d in all_dests if self.shard(d)]
            if not dests:
                continue
            try:
                pdu = json.loads(e.json)
            except ValueError:
                log.warning("event %s has unparseable JSON; not sent", e.event_id)
                continue
            # One parsed PDU shared by every destination's queue.
            item = PduItem(e.stream_ordering, e.event_id, e.room_id, pdu, len(e.json))
            for d in dests:
                per_dest.setdefault(d, []).append(item)
                n += 1
        for d, items in per_dest.items():
            self.enqueue(d, items)
        self.observer.events_processed(len(rows), new_position, n)
        return n
