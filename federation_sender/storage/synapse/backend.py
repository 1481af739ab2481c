"""The Synapse backend: the storage Protocols over a Synapse database.

:class:`SynapseBackend` owns what outlives a transaction: the engine (its connections
see our schema first, :mod:`.database`), the state-group hosts cache, Synapse's Redis
external cache, and the signals for other processes. Each :meth:`SynapseBackend.run`
gives the function a :class:`SynapseTx`; cache invalidations and "server came back"
signals it records are handed to the backend's :class:`.signals.ReplicationSignals`
only after the commit (a rolled-back or retried transaction emits nothing). What only
this backend offers (those signals, the Synapse-only gap fetchers, the EDUs' rooms and
presence, outbox reads bounded by stream tokens) is in
:meth:`SynapseBackend.capabilities`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Protocol, TypeVar

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from federation_sender.clock import Clock, time_ms
from federation_sender.model import (
    DeviceListRow,
    ToDeviceRow,
)
from federation_sender.storage.admin_queries import AdminQueries
from federation_sender.storage.capabilities import Capabilities
from federation_sender.storage.catchup import CatchUpReads
from federation_sender.storage.engine import run_in_transaction
from federation_sender.storage.events import EventReads
from federation_sender.storage.protocols import Backend, SendTimeFacts, Tx
from federation_sender.storage.synapse import destinations as wr
from federation_sender.storage.synapse import device_lists as dl
from federation_sender.storage.synapse import events as ev
from federation_sender.storage.synapse import membership_history
from federation_sender.storage.synapse import positions as pos
from federation_sender.storage.synapse import to_device as td
from federation_sender.storage.synapse.destinations import SynapseDestinations
from federation_sender.storage.synapse.edu_rooms import EduRoomReads, SynapseEduRooms
from federation_sender.storage.synapse.hosts import (
    ExternalCache,
    StateGroupHostsCache,
    SynapseHostsReader,
)
from federation_sender.storage.synapse.schema import cache_invalidation_stream_by_instance
from federation_sender.storage.synapse.send_time import SynapseSendTime
from federation_sender.storage.synapse.signals import PendingSignals, ReplicationSignals
from federation_sender.storage.synapse.stream_fetchers import synapse_fetchers, synapse_gap_notes
from federation_sender.storage.synapse.visibility import SynapseVisibility
from federation_sender.storage.txlog import TxnLogTable

log = logging.getLogger(__name__)

T = TypeVar("T")


class SynapseSettings(Protocol):
    """What the backend reads of Synapse's configuration
    (:class:`federation_sender.synapse.config.SynapseConfig` has it; storage does not
    import the configuration package above it)."""

    @property
    def federation_sender_instances(self) -> Sequence[str]: ...

    @property
    def allow_device_name_lookup_over_federation(self) -> bool: ...

    def domain_allowed(self, destination: str) -> bool: ...


class SynapseBackend:
    """Implements :class:`federation_sender.storage.protocols.Backend`."""

    name = "synapse"

    def __init__(
        self,
        engine: AsyncEngine,
        syn: SynapseSettings,
        instance_name: str,
        clock: Clock,
        external: ExternalCache | None = None,
    ) -> None:
        self.engine = engine
        self.syn = syn
        self.instance_name = instance_name
        self.clock = clock
        self.external = external
        self.groups = StateGroupHostsCache()
        self._send_time = SynapseSendTime(engine)
        self.signals = ReplicationSignals(instance_name)
        self.positions_reset = False
        self.replay_upto: dict[str, int] = {}
        """Our positions before the instance list's reset moved them back
        (:func:`~federation_sender.storage.synapse.positions.reset_federation_positions`)."""
        self.stream_token: Callable[[str], int | None] = lambda _stream: None
        """The latest replication token of a stream (bound through the capabilities to
        the replication handler's), bounding outbox reads as Synapse's stream tokens do."""

    def capabilities(self) -> Capabilities:
        return Capabilities(
            fetchers=synapse_fetchers(self.engine),
            gap_notes=synapse_gap_notes(),
            signals=self.signals,
            edu_rooms=SynapseEduRooms(self),
            bind_stream_tokens=self._bind_stream_tokens,
        )

    def _bind_stream_tokens(self, tokens: Mapping[str, int]) -> None:
        self.stream_token = tokens.get

    async def read_rooms(self, fn: Callable[[EduRoomReads], Awaitable[T]]) -> T:
        """``fn`` on the EDU fan-outs' reads, in one transaction."""
        return await run_in_transaction(self.engine, lambda conn: fn(EduRoomReads(conn)))

    async def load_caches_position(self) -> int:
        t = cache_invalidation_stream_by_instance

        async def fn(conn: AsyncConnection) -> int:
            v = (
                await conn.execute(
                    select(func.max(t.c.stream_id)).where(t.c.instance_name == self.instance_name)
                )
            ).scalar()
            return int(v or 0)

        position = max(self.signals.caches_position, await run_in_transaction(self.engine, fn))
        self.signals.caches_position = position
        return position

    async def send_time_facts(
        self, event_ids: Collection[str], senders: Collection[str]
    ) -> SendTimeFacts:
        """Erasures and valid redactions from Synapse's tables (:mod:`.send_time`)."""
        return await self._send_time.send_time_facts(event_ids, senders)

    async def run(self, fn: Callable[[Tx], Awaitable[T]]) -> T:
        signals: list[PendingSignals] = []

        async def in_tx(conn: AsyncConnection) -> T:
            signals.clear()
            s = PendingSignals()
            signals.append(s)
            return await fn(SynapseTx(conn, self, s))

        result = await run_in_transaction(self.engine, in_tx)
        if signals and (signals[0].invalidations or signals[0].servers_up):
            self.signals.emit(signals[0])
        return result


class SynapseTx:
    """Implements :class:`federation_sender.storage.protocols.Tx`."""

    __slots__ = (
        "admin", "catchup", "destinations", "events", "hosts", "outbox", "positions", "txlog",
        "visibility",
    )

    def __init__(self, conn: AsyncConnection, b: SynapseBackend, s: PendingSignals) -> None:
        self.events = EventReads(conn, ev.QUERIES)
        self.hosts = SynapseHostsReader(conn, b.groups, b.external, b.syn.domain_allowed)
        self.destinations = SynapseDestinations(
            conn, s, b.instance_name, lambda: time_ms(b.clock)
        )
        self.catchup = CatchUpReads(
            conn, wr.CATCHUP, membership_history.server_membership_history
        )
        self.visibility = SynapseVisibility(conn)
        self.outbox = _Outbox(conn, b)
        self.positions = _Positions(conn, b)
        # Our transaction log (in our schema) and the admin reads of ``destinations`` and
        # ``destination_rooms`` (same columns as Synapse's) are the shared table groups'.
        self.txlog = TxnLogTable(conn)
        self.admin = AdminQueries(conn)


class _Outbox:
    """To-device messages and device-list updates as Synapse keeps them (both deleted
    once delivered). Device-list windows stop at the ``device_lists`` stream token main
    last announced (every poke at or below it is committed); before the first one,
    none is read (the wake-up sweep comes back for them)."""

    __slots__ = ("_b", "_c")

    def __init__(self, conn: AsyncConnection, b: SynapseBackend) -> None:
        self._c = conn
        self._b = b

    async def unsent_outbox(
        self, destination: str, to_device_after: int, device_lists_after: int, limit: int
    ) -> tuple[list[ToDeviceRow], list[DeviceListRow]]:
        to_device = await td.unsent_to_device(
            self._c, destination, to_device_after, limit, self._b.stream_token("to_device")
        )
        token = self._b.stream_token("device_lists")
        if token is None:
            return to_device, []
        device_lists = await dl.device_list_rows(
            self._c,
            destination,
            device_lists_after,
            token,
            limit,
            allow_device_names=self._b.syn.allow_device_name_lookup_over_federation,
        )
        return to_device, device_lists

    async def ack_to_device(
        self, destination: str, stream_ids: Collection[int], now_ms: int
    ) -> None:
        await td.delete_to_device(self._c, destination, stream_ids)

    async def ack_device_lists(
        self, destination: str, keys: Collection[tuple[int, str, str]]
    ) -> None:
        await dl.ack_device_list_rows(self._c, destination, keys)

    async def device_list_destinations(self, user_ids: Collection[str]) -> list[str]:
        return await dl.destinations_for_users(self._c, user_ids)

    async def destinations_with_unsent(self, destinations: Collection[str]) -> set[str]:
        # Any row at all: a superset (rows past the stream tokens are left to the
        # per-destination read, which bounds them).
        return (await td.destinations_with_rows(self._c, destinations)
                | await dl.destinations_with_pokes(self._c, destinations))


class _Positions:
    """``events``/``federation`` in Synapse's ``federation_stream_position``; the
    replication client's tokens in our own schema."""

    __slots__ = ("_b", "_c")

    def __init__(self, conn: AsyncConnection, b: SynapseBackend) -> None:
        self._c = conn
        self._b = b

    async def _reset_once(self) -> None:
        if not self._b.positions_reset:
            self._b.replay_upto = await pos.reset_federation_positions(
                self._c, self._b.instance_name, self._b.syn.federation_sender_instances
            )
            self._b.positions_reset = True

    async def replay_upto(self, stream: str, instance: str) -> int | None:
        await self._reset_once()
        return self._b.replay_upto.get(stream) if instance == self._b.instance_name else None

    async def load(self, stream: str, instance: str) -> int | None:
        await self._reset_once()
        return await pos.load_position(self._c, stream, instance)

    async def save(self, stream: str, instance: str, stream_id: int) -> None:
        await self._reset_once()
        await pos.save_position(self._c, stream, instance, stream_id)

    async def load_replication(self, reader: str) -> dict[tuple[str, str], int]:
        return await pos.load_replication(self._c, reader)

    async def save_replication(self, reader: str, stream: str, writer: str, token: int) -> None:
        await pos.save_replication(self._c, reader, stream, writer, token)



def _implements(b: SynapseBackend, tx: SynapseTx) -> tuple[Backend, Tx]:
    """Never called: mypy checks here that the classes meet the Protocols."""
    return b, tx
