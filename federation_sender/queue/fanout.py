"""Event fan-out: new events from the database, fanned out to destination queues.

On a poke (or a poll), read events past the persisted position up to the poked token,
``batch_size`` at a time. For each event that originates here and is not out-of-band,
the destinations are the servers the storage backend says must receive it
(``RoomHostsReader``; natively the servers joined to the room after the event, plus the
target's server of a leave/ban), minus ourselves and any name that is no server name
(:func:`refused_destination`: never reachable, so never queued), filtered by the shard.

Each batch is one database transaction: read the events and the membership they need,
upsert ``destinations`` and ``destination_rooms`` and save the position; after the
commit, this shard's PDUs go to the queues, in stream order. A crash between the commit
and the hand-over loses nothing: queues start in catch-up mode, which reads
``destination_rooms``. (Handing over before the commit started sending a round trip
sooner, but a 15-minute chaos run then lost one event of 1.7 million without an
explanation found in time; the order that keeps the rows ahead of every queue stays.)

The hosts for all rooms of a batch are asked for in one call (rooms in parallel, events
of a room in order; natively at most two queries), instead of a query per room or per
event.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from federation_sender.aio.idle import IdleSignal
from federation_sender.aio.timing import wait_or_timeout
from federation_sender.clock import Clock
from federation_sender.ids import server_name_error
from federation_sender.model import EVENTS_STREAM, EventRow
from federation_sender.queue.coalesce import HandOverGate
from federation_sender.queue.core.catchup import is_sendable, parsed_pdu_item
from federation_sender.queue.core.items import PduItem
from federation_sender.queue.observer import QueueObserver
from federation_sender.storage.protocols import Backend, Tx

log = logging.getLogger(__name__)


def _everyone(_destination: str) -> bool:
    return True


def refused_destination(name: str) -> bool:
    """Whether nothing can ever be sent to ``name``: it is not a server name (``x'--``,
    a ``<``, a bad port). Such a name in a room's membership is logged once (per name,
    while it is remembered) and gets no queue, no ``destination_rooms`` row and no
    retries: no backoff would ever make it reachable."""
    error = server_name_error(name)
    if error is None:
        return False
    _log_refused(name, error)
    return True


@functools.lru_cache(maxsize=4096)
def _log_refused(name: str, error: str) -> None:
    log.warning("never sending to %s: not a server name (%s)", name, error)


def recipients(
    hosts: frozenset[str], server_name: str, shard: Callable[[str], bool]
) -> list[str]:
    """An event's destinations from the hosts the backend gave: minus ourselves (and
    empty names, and names that are no server name), this shard's only."""
    dests = set(hosts)
    dests.discard(server_name)
    dests.discard("")
    return sorted(d for d in dests if shard(d) and not refused_destination(d))


class _Fanout:
    """One batch's recipient lists, computed once per distinct hosts set.

    Events of a room between two membership changes share one frozen set of hosts (the
    backend hands out the same object), so they share one recipient tuple here too;
    everything per destination below is then done per distinct tuple instead of per
    event and destination."""

    def __init__(self, server_name: str, shard: Callable[[str], bool]) -> None:
        self.server_name = server_name
        self.shard = shard
        self._all: dict[int, tuple[frozenset[str], tuple[str, ...]]] = {}
        self._own: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {}

    def everyone(self, hosts: frozenset[str]) -> tuple[str, ...]:
        hit = self._all.get(id(hosts))
        if hit is None:
            dests = tuple(recipients(hosts, self.server_name, _everyone))
            # The set is kept referenced, so its id cannot be reused within the batch.
            self._all[id(hosts)] = hit = (hosts, dests)
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


class EventFanout:
    def __init__(
        self,
        storage: Backend,
        server_name: str,
        instance_name: str,
        batch_size: int,
        shard_filter: Callable[[str], bool],
        enqueue: Callable[[str, Sequence[PduItem]], None],
        observer: QueueObserver,
        clock: Clock,
        poll_interval_s: float | None = None,
        gate: HandOverGate | None = None,
        idle: IdleSignal | None = None,
    ) -> None:
        self.storage = storage
        self._idle = idle or IdleSignal()
        """Raised when the loop, caught up, starts waiting for a poke (and when it ends)."""
        self.gate = gate
        self.server_name = server_name
        self.instance_name = instance_name
        self.batch_size = batch_size
        self.shard = shard_filter
        self.enqueue = enqueue
        self.observer = observer
        self.clock = clock
        self.poll_interval_s = poll_interval_s
        self.position = 0
        self.target = 0
        self._poked = asyncio.Event()
        self._busy = False
        """Polling, reading or handing over (not waiting for a poke or the poll)."""
        self.stopping = False
        self._known_destinations: set[str] = set()
        self.replay_upto: int | None = None
        """Set when a changed instance list moved the position back to a slower
        instance's (Synapse's reset at start): up to here this instance handed its own
        destinations their events already, so an event at or below it goes only to the
        destinations whose ``last_successful_stream_ordering`` is below it (those
        another instance served, or ours still owed it), not again to every one."""
        self.replay_skipped = 0
        """(event, destination) pairs the replay window left out as delivered."""

    def _remember(self, names: set[str]) -> None:
        # Known to exist in ``destinations``: skip re-inserting them every batch. Bounded;
        # forgetting only costs a no-op insert.
        if len(self._known_destinations) + len(names) > 200_000:
            self._known_destinations.clear()
        self._known_destinations |= names

    async def load(self) -> None:
        """Load the persisted position; on first start, begin at the current end (there
        is nothing to catch up on for a worker that never sent anything)."""

        async def fn(tx: Tx) -> tuple[int, int | None]:
            p = await tx.positions.load(EVENTS_STREAM, self.instance_name)
            if p is None:
                p = await tx.events.max_stream_ordering()
                await tx.positions.save(EVENTS_STREAM, self.instance_name, p)
            return p, await tx.positions.replay_upto(EVENTS_STREAM, self.instance_name)

        self.position, upto = await self.storage.run(fn)
        self.target = max(self.target, self.position)
        if upto is not None and upto > self.position:
            self.replay_upto = upto
            log.info(
                "Events position moved back from %d to %d (another instance's, the "
                "instance list changed): events up to %d go only to destinations whose "
                "own position is below them", upto, self.position, upto,
            )  # fmt: skip

    def notify(self, max_stream_ordering: int) -> None:
        if max_stream_ordering > self.target:
            self.target = max_stream_ordering
            self._poked.set()
            if self.gate is not None:
                self.gate.behind = True

    @property
    def idle(self) -> bool:
        """Caught up, and waiting for a poke or the next poll (or not running)."""
        return not self._busy and self.position >= self.target

    async def run(self) -> None:
        try:
            while not self.stopping:
                self._busy = True
                self._poked.clear()
                if self.poll_interval_s is not None:
                    await self._poll()
                while self.position < self.target and not self.stopping:
                    await self.process_batch()
                if self.gate is not None:
                    self.gate.set_behind(self.position < self.target)
                self._busy = False
                self._idle.went_idle()
                await wait_or_timeout(self.clock, self._poked, self.poll_interval_s)
        finally:
            self._busy = False
            self._idle.went_idle()
            if self.gate is not None:
                self.gate.set_behind(False)  # nobody waits for a hand-over that won't come

    async def _poll(self) -> None:
        self.notify(await self.storage.run(_max_stream_ordering))

    def stop(self) -> None:
        self.stopping = True
        self._poked.set()

    async def process_batch(self) -> int:
        """Handle one batch (one database transaction, then the hand-over); returns how
        many PDUs were handed to queues."""
        after, upto = self.position, self.target
        started = self.clock.monotonic_s()

        async def fn(tx: Tx) -> _Batch:
            rows = await tx.events.events_after(after, upto, self.batch_size)
            by_room: dict[str, list[EventRow]] = {}
            for e in rows:
                if is_sendable(e, self.server_name):
                    by_room.setdefault(e.room_id, []).append(e)
            hosts = await tx.hosts.hosts_for_events(by_room)
            new_position = rows[-1].stream_ordering if len(rows) == self.batch_size else upto
            fan = _Fanout(self.server_name, self.shard)
            fanout = _fan_out(rows, hosts, fan, self.server_name)
            dr_rows = _last_per_room(fanout)
            new_dests = {r[0] for r in dr_rows} - self._known_destinations
            await tx.destinations.ensure_destinations(new_dests)
            await tx.destinations.upsert_destination_rooms(dr_rows, skip_destinations=True)
            await tx.positions.save(EVENTS_STREAM, self.instance_name, new_position)
            if self.replay_upto is not None and after < self.replay_upto:
                fanout = await self._skip_delivered(tx, fanout, self.replay_upto)
            return _Batch(len(rows), new_position, new_dests, fanout, fan)

        b = await self.storage.run(fn)
        self._remember(b.new_dests)
        self.position = b.new_position
        if self.replay_upto is not None and self.position >= self.replay_upto:
            log.info("Replay window ended at %d: %d (event, destination) pairs already "
                     "delivered were not sent again", self.replay_upto, self.replay_skipped)
            self.replay_upto = None
        n, pdus = self._hand_over(b.fanout, b.fan)
        if self.gate is not None:
            self.gate.handed_over()
        rooms = len({e.room_id for e, _ in b.fanout})
        self.observer.events_processed(b.events, b.new_position, n, pdus=pdus, rooms=rooms,
                                       duration_s=self.clock.monotonic_s() - started)
        return n

    async def _skip_delivered(
        self, tx: Tx, fanout: list[tuple[EventRow, tuple[str, ...]]], upto: int
    ) -> list[tuple[EventRow, tuple[str, ...]]]:
        """The replay window (:attr:`replay_upto`): each destination resumes from its
        own delivered position. A destination whose ``last_successful_stream_ordering``
        is at or past an event has it (or a later event of its room: the position
        never passes a PDU still owed); the others get it. One read per batch of the
        window, none after it."""
        names = {d for e, ds in fanout if e.stream_ordering <= upto for d in ds}
        rows = await tx.destinations.get_destinations(names)
        done = {d: r.last_successful_stream_ordering for d, r in rows.items()
                if r.last_successful_stream_ordering is not None}
        out: list[tuple[EventRow, tuple[str, ...]]] = []
        for e, ds in fanout:
            if e.stream_ordering <= upto:
                kept = tuple(d for d in ds if done.get(d, -1) < e.stream_ordering)
                self.replay_skipped += len(ds) - len(kept)
                ds = kept
            out.append((e, ds))
        return out

    def _hand_over(
        self, fanout: Sequence[tuple[EventRow, tuple[str, ...]]], fan: _Fanout
    ) -> tuple[int, int]:
        """Give each of this shard's destinations its PDUs of the batch, in stream order.

        PDUs are grouped by recipient tuple ("segments"); a destination in one segment
        (the usual case) gets that segment's tuple itself, shared with every other
        destination in it, and one in several gets them merged. Returns the number of
        (PDU, destination) pairs handed over and of PDUs with at least one."""
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
            # One parsed and encoded PDU shared by every destination's queue.
            item = parsed_pdu_item(e, pdu)
            seg = segments.get(id(dests))
            if seg is None:
                segments[id(dests)] = seg = (dests, [])
            seg[1].append(item)
        per_dest: dict[str, list[tuple[PduItem, ...]]] = {}
        n = pdus = 0
        for dests, items in segments.values():
            shared = tuple(items)
            n += len(dests) * len(shared)
            pdus += len(shared)
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
        return n, pdus


async def _max_stream_ordering(tx: Tx) -> int:
    return await tx.events.max_stream_ordering()


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
        dests = fan.everyone(hosts[e.room_id][i])
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
