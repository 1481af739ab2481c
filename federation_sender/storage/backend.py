"""The native backend: the storage Protocols over the project's own schema
(``storage/schema.py``), on PostgreSQL or SQLite; the pair of
:mod:`federation_sender.storage.synapse.backend`.

This module holds no SQL of its own: it wires (the outbox's one-trip read unions the two
outbox tables' reads). :class:`NativeTx` hands out one object per aggregate, each bound
to the transaction's connection: most are the table groups' own classes, shared with the
Synapse backend where the tables are the same (:class:`~.events.EventReads`,
:class:`~.destinations.DestinationsTable`, :class:`~.catchup.CatchUpReads`,
:class:`~.txlog.TxnLogTable`, :class:`~.admin_queries.AdminQueries`); the three below
(hosts, outbox, positions) are native-only adapters, mostly methods that forward to the
functions of :mod:`.hosts`, :mod:`.to_device`, :mod:`.device_lists` and
:mod:`.positions`, where the SQL is. State that outlives a transaction (the
room-membership cache the fan-out rolls forward) belongs to the :class:`NativeBackend`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import Select, select, union, union_all
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from federation_sender.model import (
    DeviceListRow,
    EventRow,
    ToDeviceRow,
)
from federation_sender.storage import admin_queries as aq
from federation_sender.storage import destinations as dst
from federation_sender.storage import device_lists as dl
from federation_sender.storage import events as ev
from federation_sender.storage import hosts as hs
from federation_sender.storage import positions as pos
from federation_sender.storage import to_device as td
from federation_sender.storage import txlog
from federation_sender.storage.capabilities import Capabilities
from federation_sender.storage.catchup import CATCHUP, CatchUpReads
from federation_sender.storage.engine import run_in_transaction
from federation_sender.storage.membership_history import server_membership_history
from federation_sender.storage.protocols import (
    NOTHING_CHANGED,
    CatchUpVisibility,
    SendTimeFacts,
    Tx,
)
from federation_sender.storage.stream_fetchers import common_fetchers, native_gap_notes

T = TypeVar("T")

LATEST = 2**62
"""A stream position past any event: "now"."""


class NativeBackend:
    """Implements :class:`federation_sender.storage.protocols.Backend`."""

    name = "native"

    def __init__(self, engine: AsyncEngine, hosts_cache: hs.RoomHostsCache | None = None) -> None:
        self.engine = engine
        self.hosts_cache = hosts_cache or hs.RoomHostsCache()

    def capabilities(self) -> Capabilities:
        """The outbox streams' gap fetchers; nothing Synapse-only."""
        return Capabilities(fetchers=common_fetchers(self.engine), gap_notes=native_gap_notes())

    async def run(self, fn: Callable[[Tx], Awaitable[T]]) -> T:
        async def in_tx(conn: AsyncConnection) -> T:
            return await fn(NativeTx(conn, self.hosts_cache))

        return await run_in_transaction(self.engine, in_tx)

    async def send_time_facts(
        self, event_ids: Collection[str], senders: Collection[str]
    ) -> SendTimeFacts:
        """Nothing, without a query: the native schema (the simulator's) has no table of
        erased users and no redactions, so nothing queued can have been erased or
        redacted since."""
        return NOTHING_CHANGED


class NativeTx:
    """Implements :class:`federation_sender.storage.protocols.Tx`."""

    __slots__ = (
        "admin", "catchup", "destinations", "events", "hosts", "outbox", "positions", "txlog",
        "visibility",
    )

    def __init__(self, conn: AsyncConnection, hosts_cache: hs.RoomHostsCache) -> None:
        self.events = ev.EventReads(conn, ev.QUERIES)
        self.hosts = _Hosts(conn, hosts_cache)
        self.destinations = dst.DestinationsTable(conn)
        self.catchup = CatchUpReads(conn, CATCHUP, server_membership_history)
        # The native schema has no erasure and no history visibility: the simulator's
        # events are all shareable, so catch-up withholds nothing on that ground.
        self.visibility: CatchUpVisibility | None = None
        self.outbox = _Outbox(conn)
        self.positions = _Positions(conn)
        self.txlog = txlog.TxnLogTable(conn)
        self.admin = aq.AdminQueries(conn)


class _Hosts:
    """Servers joined after each event (rolled forward by the cache), plus the target's
    server of a leave or ban: a kicked or leaving server receives its own kick or
    leave."""

    __slots__ = ("_c", "_cache")

    def __init__(self, conn: AsyncConnection, cache: hs.RoomHostsCache) -> None:
        self._c = conn
        self._cache = cache

    async def hosts_for_events(
        self, events: Mapping[str, Sequence[EventRow]]
    ) -> dict[str, list[frozenset[str]]]:
        positions = {room: [e.stream_ordering for e in evs] for room, evs in events.items()}
        joined = await self._cache.hosts_for_events(self._c, positions)
        out: dict[str, list[frozenset[str]]] = {}
        for room, evs in events.items():
            answers = joined[room]
            for i, e in enumerate(evs):
                extra = hs.leaving_server(e)
                if extra is not None and extra not in answers[i]:
                    answers[i] = answers[i] | {extra}
            out[room] = answers
        return out

    async def current_hosts(self, room_ids: Collection[str]) -> dict[str, frozenset[str]]:
        return {room: await hs.joined_servers_at(self._c, room, LATEST) for room in room_ids}


def _unsent_outbox() -> Select[Any]:
    """Both outboxes of a destination in one round trip: the union of each table's read."""
    u = union_all(
        select(td.unsent_select().subquery()), select(dl.unsent_select().subquery())
    ).subquery()
    return select(u).order_by(u.c.kind, u.c.stream_id, u.c.user_id, u.c.device_id)


_UNSENT_OUTBOX = _unsent_outbox()


class _Outbox:
    """The two outbox tables (:mod:`.to_device`, :mod:`.device_lists`), read together."""

    __slots__ = ("_c",)

    def __init__(self, conn: AsyncConnection) -> None:
        self._c = conn

    async def unsent_outbox(
        self, destination: str, to_device_after: int, device_lists_after: int, limit: int
    ) -> tuple[list[ToDeviceRow], list[DeviceListRow]]:
        """Both outboxes in one round trip (``UNION ALL``); most destinations have none."""
        res = await self._c.execute(
            _UNSENT_OUTBOX,
            {"dest": destination, "td_after": to_device_after,
             "dl_after": device_lists_after, "limit": limit},
        )
        to_device: list[ToDeviceRow] = []
        device_lists: list[DeviceListRow] = []
        for kind, sid, user, device, body in res:
            if kind == 0:
                to_device.append(ToDeviceRow(int(sid), str(body)))
            else:
                device_lists.append(DeviceListRow(int(sid), str(user), str(device), str(body)))
        return to_device, device_lists

    async def ack_to_device(
        self, destination: str, stream_ids: Collection[int], now_ms: int
    ) -> None:
        await td.mark_sent(self._c, destination, stream_ids, now_ms)

    async def ack_device_lists(
        self, destination: str, keys: Collection[tuple[int, str, str]]
    ) -> None:
        await dl.mark_sent(self._c, destination, keys)

    async def device_list_destinations(self, user_ids: Collection[str]) -> list[str]:
        return await dl.destinations_for_users(self._c, user_ids)

    async def destinations_with_unsent(self, destinations: Collection[str]) -> set[str]:
        """Those of ``destinations`` with an unsent row in either outbox (one statement)."""
        if not destinations:
            return set()
        both = union(td.destinations_with_rows(destinations),
                     dl.destinations_with_pokes(destinations))
        return {str(r) for r in (await self._c.execute(both)).scalars()}


class _Positions:
    """Own progress as ``federation_sender.<stream>``; replication tokens as
    ``replication:<reader>:<stream>`` (per writer instance), both in
    ``stream_positions``."""

    __slots__ = ("_c",)

    def __init__(self, conn: AsyncConnection) -> None:
        self._c = conn

    async def load(self, stream: str, instance: str) -> int | None:
        return await pos.load_position(self._c, pos.stored_name(stream), instance)

    async def save(self, stream: str, instance: str, stream_id: int) -> None:
        await pos.save_position(self._c, pos.stored_name(stream), instance, stream_id)

    async def replay_upto(self, _stream: str, _instance: str) -> int | None:
        # Native positions are per instance and never reset to another's.
        return None

    async def load_replication(self, reader: str) -> dict[tuple[str, str], int]:
        return await pos.load_prefixed(self._c, pos.replication_prefix(reader))

    async def save_replication(self, reader: str, stream: str, writer: str, token: int) -> None:
        await pos.save_position(self._c, pos.replication_prefix(reader) + stream, writer, token)
