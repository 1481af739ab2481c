"""Event intake: new events from the database, fanned out to destination queues.

On a poke (or a poll), read events past the persisted position up to the poked token,
``batch_size`` at a time. For each event that originates here and is not out-of-band,
the destinations are the servers joined to the room after the event, plus the target's
server of a leave/ban (a kicked or leaving server receives its own kick or leave), minus
ourselves, filtered by the shard.

Each batch is one database transaction: read the events and the membership they need,
upsert ``destinations`` and ``destination_rooms`` and save the position; after the
commit, this shard's PDUs go to the queues, in stream order. A crash between the commit
and the hand-over loses nothing: queues start in catch-up mode, which reads
``destination_rooms``. (Handing over before the commit started sending a round trip
sooner, but a 15-minute chaos run then lost one event of 1.7 million without an
explanation found in time; the order that keeps the rows ahead of every queue stays.)

Room membership for all rooms of a batch is resolved with at most two queries through
:class:`RoomHostsCache` (rooms in parallel, events of a room in order), instead of a
query per room or per event.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

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


def _leaving_server(event: EventRow) -> str | None:
    """The target's server of a leave or ban (it receives its own kick or leave)."""
    if event.type != "m.room.member" or not event.state_key:
        return None
    try:
        membership = json.loads(event.json).get("content", {}).get("membership")
    except ValueError:
        membership = None
    return server_of(event.state_key) if membership in ("leave", "ban") else None


def recipients(
    event: EventRow, joined: frozenset[str], server_name: str, shard: Callable[[str], bool]
) -> list[str]:
    return _recipients(joined, _leaving_server(event), server_name, shard)


def _recipients(
    joined: frozenset[str], extra: str | None, server_name: str, shard: Callable[[str], bool]
) -> list[str]:
    dests = set(joined)
    if extra is not None:
        dests.add(extra)
    dests.discard(server_name)
    dests.discard("")
    return sorted(d for d in dests if shard(d))


class _Fanout:
    """One batch's recipient lists, computed once per distinct membership snapshot.

    Events of a room between two membership changes share one frozen set of joined
    servers (:class:`RoomHostsCache` hands out the same object), so they share one
    recipient tuple here too; everything per destination below is then done per
    distinct tuple instead of per event and destination."""

    def __init__(self, server_name: str, shard: Callable[[str], bool]) -> None:
        self.server_name = server_name
        self.shard = shard
        self._all: dict[tuple[int, str | None], tuple[frozenset[str], tuple[str, ...]]] = {}
        self._own: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {}

    def everyone(self, event: EventRow, joined: frozenset[str]) -> tuple[str, ...]:
        extra = _leaving_server(event)
        key = (id(joined), extra)
        hit = self._all.get(key)
        if hit is None:
            dests = tuple(_recipients(joined, extra, self.server_name, _everyone))
            # The set is kept referenced, so its id cannot be reused within the batch.
            self._all[key] = hit = (joined, dests)
        return hit[1]

    def own(self, dests: tuple[str, ...]) -> tuple[str, ...]:
        hit = self._own.get(id(dests))
        if hit is None:
            self._own[id(dests)] = hit = (dests, tuple(d for d in dests if self.shard(d)))
        return hit[1]


@dataclass(frozen=True, slots=True)
class _Batch:
    events: int
    new_position: int
    new_dests: set[str]
    fanout: list[tuple[EventRow, tuple[str, ...]]]
    fan: _Fanout


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
        """Handle one batch (one database transaction, then the hand-over); returns how
        many PDUs were handed to queues."""
        after, upto = self.position, self.target

        async def fn(conn: AsyncConnection) -> _Batch:
            rows = await ev.events_after(conn, after, upto, self.batch_size)
            sendable = [e for e in rows if is_sendable(e, self.server_name)]
            by_room: dict[str, list[int]] = {}
            for e in sendable:
                by_room.setdefault(e.room_id, []).append(e.stream_ordering)
            hosts = await self.hosts.hosts_for_events(conn, by_room)
            new_position = rows[-1].stream_ordering if len(rows) == self.batch_size else upto
            fan = _Fanout(self.server_name, self.shard)
            fanout = _fan_out(rows, hosts, fan, self.server_name)
            dr_rows = _last_per_room(fanout)
            new_dests = {r[0] for r in dr_rows} - self._known_destinations
            await dst.ensure_destinations(conn, new_dests)
            await dst.upsert_destination_rooms(conn, dr_rows, skip_destinations=True)
            await pos.save_position(conn, pos.EVENTS_STREAM, self.instance_name, new_position)
            return _Batch(len(rows), new_position, new_dests, fanout, fan)

        b = await run_in_transaction(self.engine, fn)
        self._remember(b.new_dests)
        self.position = b.new_position
        n = self._hand_over(b.fanout, b.fan)
        self.observer.events_processed(b.events, b.new_position, n)
        return n

    def _hand_over(
        self, fanout: Sequence[tuple[EventRow, tuple[str, ...]]], fan: _Fanout
    ) -> int:
        """Give each of this shard's destinations its PDUs of the batch, in stream order.

        PDUs are grouped by recipient tuple ("segments"); a destination in one segment
        (the usual case) gets that segment's tuple itself, shared with every other
        destination in it, and one in several gets them merged. Returns the number of
        PDUs handed over."""
        segments: dict[int, tuple[tuple[str, ...], list[PduItem]]] = {}
        for e, all_dests in fanout:
            dests = fan.own(all_dests)
            if not dests:
                continue
            try:
                pdu = json.loads(e.json)
            except ValueError:
                log.warning("event %s has unparseable JSON; not sent", e.event_id)
                continue
            # One parsed PDU shared by every destination's queue.
            item = PduItem(e.stream_ordering, e.event_id, e.room_id, pdu, len(e.json))
            seg = segments.get(id(dests))
            if seg is None:
                segments[id(dests)] = seg = (dests, [])
            seg[1].append(item)
        per_dest: dict[str, list[tuple[PduItem, ...]]] = {}
        n = 0
        for dests, items in segments.values():
            shared = tuple(items)
            n += len(dests) * len(shared)
            for d in dests:
                got = per_dest.get(d)
                if got is None:
                    per_dest[d] = [shared]
                else:
                    got.append(shared)
        for d, parts in per_dest.items():
            if len(parts) == 1:
                self.enqueue(d, parts[0])
            else:
                self.enqueue(d, tuple(heapq.merge(*parts, key=_stream_ordering)))
        return n


def _stream_ordering(item: PduItem) -> int:
    return item.stream_ordering


def _fan_out(
    rows: Sequence[EventRow],
    hosts: Mapping[str, Sequence[frozenset[str]]],
    fan: _Fanout,
    server_name: str,
) -> list[tuple[EventRow, tuple[str, ...]]]:
    """The sendable events of a batch with every recipient (all shards)."""
    fanout: list[tuple[EventRow, tuple[str, ...]]] = []
    index: dict[str, int] = {}
    for e in rows:
        if not is_sendable(e, server_name):
            continue
        i = index.get(e.room_id, 0)
        index[e.room_id] = i + 1
        # Every destination is recorded in destination_rooms, whichever instance owns
        # it now: during a shard membership change two instances' views differ, and a
        # destination recorded by nobody would never be caught up. Only this
        # instance's own destinations are queued.
        dests = fan.everyone(e, hosts[e.room_id][i])
        if dests:
            fanout.append((e, dests))
    return fanout


def _last_per_room(
    fanout: Sequence[tuple[EventRow, tuple[str, ...]]],
) -> list[tuple[str, str, int]]:
    """``destination_rooms`` rows: per (destination, room) only the batch's last event
    matters. Walks backwards, once per distinct recipient tuple of a room."""
    dr_rows: list[tuple[str, str, int]] = []
    seen: dict[str, tuple[set[str], set[int]]] = {}
    for e, ds in reversed(fanout):
        room_seen = seen.get(e.room_id)
        if room_seen is None:
            seen[e.room_id] = room_seen = (set(), set())
        done, lists = room_seen
        if id(ds) in lists:
            continue
        lists.add(id(ds))
        fresh = [d for d in ds if d not in done]
        if fresh:
            done.update(fresh)
            dr_rows.extend((d, e.room_id, e.stream_ordering) for d in fresh)
    return dr_rows
