"""Glue between subsystems that were built against narrow interfaces.

* :class:`WorkerReplicationHandler`: replication rows -> queue engine calls (typing and
  receipts through :mod:`federation_sender.edus`).
* :class:`StorageRoomHosts`: current hosts and event metadata from the storage backend.
* :class:`DbPositionStore`: the replication client's per-(stream, writer) positions,
  through the storage backend, namespaced by our instance name so several workers can
  share one database.
* :class:`AdminQueueControl`: the admin API's view of the queue engine.
* :func:`queue_snapshot`: whole-queue figures for the metrics gauges.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any

from federation_sender.admin.protocols import LiveState
from federation_sender.clock import Clock, time_ms
from federation_sender.edus import EventMeta, RoomHosts
from federation_sender.edus.presence import PresenceFanout
from federation_sender.edus.receipts import DEFAULT_MAX_DELAY_S, ReceiptFanout
from federation_sender.edus.typing_edus import TypingFanout
from federation_sender.queue import DestinationState, DestinationStatus, FederationEdu, QueueManager
from federation_sender.replication.frontier import WritersFrontier
from federation_sender.replication.positions import PositionStore
from federation_sender.replication.rows import (
    CachesRow,
    DeviceListsRow,
    EduRow,
    KeyedEduRow,
    PresenceDestinationsRow,
    PresenceFederationRow,
    PresenceRow,
    PresenceState,
    ReceiptsRow,
    Row,
    ToDeviceRow,
    TypingRow,
)
from federation_sender.storage.protocols import Backend, Tx
from federation_sender.telemetry.metrics import Metrics, QueueSnapshot
from federation_sender.telemetry.tracing import Tracing

log = logging.getLogger(__name__)

RETRY_TIMINGS_CACHE = "get_destination_retry_timings"
PREFILL_LIMIT = 10_000
"""Committed stream orderings read at start for the events read position (at most)."""

def presence_edu_content(state: PresenceState, now_ms: int) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "user_id": state.user_id,
        "presence": state.state,
        "currently_active": state.currently_active,
        "last_active_ago": max(0, now_ms - state.last_active_ts),
    }
    if state.status_msg is not None:
        entry["status_msg"] = state.status_msg
    return entry


class WorkerReplicationHandler:
    """Implements :class:`federation_sender.replication.client.ReplicationHandler`."""

    def __init__(
        self,
        manager: QueueManager,
        storage: Backend,
        server_name: str,
        clock: Clock,
        metrics: Metrics | None = None,
        on_events_token: Callable[[int], None] | None = None,
        room_hosts: RoomHosts | None = None,
        presence: PresenceFanout | None = None,
        tracing: Tracing | None = None,
        receipt_max_delay_s: float = DEFAULT_MAX_DELAY_S,
        event_writers: Collection[str] | None = None,
        stored_positions: PositionStore | None = None,
    ) -> None:
        self._m = manager
        self._event_writers = None if event_writers is None else tuple(event_writers)
        self._stored_positions = stored_positions
        self.events = WritersFrontier(self._event_writers, manager.events_position)
        """How far the intake may read: below it every events writer has finished
        (``stream_writers.events``; None: whoever writes, one writer)."""
        self._tracing = tracing or Tracing(None)
        self._on_events_token = on_events_token
        self._storage = storage
        self._server_name = server_name
        self._clock = clock
        self._metrics = metrics
        self.rows_seen = 0
        hosts = room_hosts or StorageRoomHosts(storage)
        self.typing = TypingFanout(server_name, hosts, manager, clock)
        self.receipts = ReceiptFanout(server_name, hosts, manager, clock, receipt_max_delay_s)
        self.presence = presence
        """Presence streams are consumed when the backend has presence (Synapse)."""
        self.tokens: dict[str, int] = {}
        """The latest token of each stream whose rows were handled: everything of that
        stream at or below it is committed (Synapse bounds its outbox reads by these)."""

    async def prepare(self) -> None:
        """Before the first rows: the presence states so far (Synapse's worker loads them
        at start; loaded once rows arrive, the first change would already be in them).
        The events frontier starts at the intake's stored position, each configured
        writer at least at its stored replication position, and with several writers
        it runs through the stream orderings committed above that."""
        self.events = WritersFrontier(self._event_writers, self._m.events_position)
        if self._stored_positions is not None and self._event_writers is not None:
            for (stream, writer), token in (await self._stored_positions.load()).items():
                if stream == "events":
                    self.events.seed(writer, token)
        if self._event_writers is not None and len(self._event_writers) > 1:
            after = self.events.frontier

            async def committed(tx: Tx) -> list[int]:
                return await tx.events.stream_orderings_after(after, PREFILL_LIMIT)

            self.events.committed(await self._storage.run(committed))
        if self.presence is not None:
            await self.presence.load()

    def background(self) -> dict[str, Callable[[], Awaitable[None]]]:
        """Loops to run beside the replication client (typing re-sends, receipt
        wake-ups), by name."""
        return {"typing-resend": self.typing.run, "receipt-wakeups": self.receipts.wakeups.run}

    async def on_rows(
        self, stream_name: str, instance_name: str, token: int, rows: Sequence[Row]
    ) -> None:
        with self._tracing.replication_batch(stream_name, instance_name, token, len(rows)):
            await self._on_rows(stream_name, instance_name, token, rows)

    async def _on_rows(
        self, stream_name: str, instance_name: str, token: int, rows: Sequence[Row]
    ) -> None:
        self.rows_seen += len(rows)
        first = stream_name not in self.tokens
        self.tokens[stream_name] = token
        if first and stream_name in ("to_device", "device_lists"):
            # Outbox reads are bounded by this token (Synapse backend): queues that read
            # before it was known found nothing and must look again.
            self._m.notify_all_outboxes()
        if self._metrics is not None:
            self._metrics.replication_batch(stream_name, len(rows))
            # Rows of the other streams are handled before this call returns; the events
            # stream is fanned out by the intake, which may still be behind the token.
            lag = max(0, token - self._m.events_position) if stream_name == "events" else 0
            self._metrics.replication_position(stream_name, instance_name, token, lag)
        if stream_name == "events":
            # Not ``token``: with several writers, a lower stream ordering may still be
            # in flight at another writer (see replication/frontier.py).
            upto = self.events.advance(instance_name, token)
            if self._on_events_token is not None:
                self._on_events_token(upto)
            self._m.notify_new_events(upto)
        elif stream_name == "federation":
            await self._federation(token, rows)
        elif stream_name == "to_device":
            for r in rows:
                if isinstance(r, ToDeviceRow) and not r.entity.startswith("@"):
                    self._m.notify_outbox(r.entity)
        elif stream_name == "device_lists":
            users = [r.user_id for r in rows if isinstance(r, DeviceListsRow)]
            if users:
                for dest in await self._device_list_destinations(users):
                    self._m.notify_outbox(dest)
        elif stream_name == "receipts":
            await self.receipts.on_rows(r for r in rows if isinstance(r, ReceiptsRow))
        elif stream_name == "typing":
            await self.typing.on_rows(token, (r for r in rows if isinstance(r, TypingRow)))
        elif stream_name == "presence" and self.presence is not None:
            await self.presence.on_presence(r for r in rows if isinstance(r, PresenceRow))
        elif stream_name == "presence_federation" and self.presence is not None:
            await self.presence.on_presence_federation(
                r for r in rows if isinstance(r, PresenceFederationRow)
            )
        elif stream_name == "caches":
            await self._caches(rows)

    async def _caches(self, rows: Sequence[Row]) -> None:
        """Another process invalidated a destination's retry timings (Synapse's main
        does when the destination contacts it): a wake-up, which Synapse's own
        federation sender ignores (it waits for its 0.2/s sweep)."""
        for r in rows:
            if isinstance(r, CachesRow) and r.cache_func == RETRY_TIMINGS_CACHE and r.keys:
                for dest in r.keys:
                    if isinstance(dest, str):
                        await self._m.retry_timings_changed(dest)

    async def _federation(self, token: int, rows: Sequence[Row]) -> None:
        edus: list[FederationEdu] = []
        now = time_ms(self._clock)
        for r in rows:
            if isinstance(r, EduRow):
                e = r.edu
                edus.append(FederationEdu(e.destination, e.edu_type, e.content))
            elif isinstance(r, KeyedEduRow):
                e = r.edu
                edus.append(FederationEdu(e.destination, e.edu_type, e.content, r.key))
            elif isinstance(r, PresenceDestinationsRow):
                content = {"push": [presence_edu_content(r.state, now)]}
                for dest in r.destinations:
                    edus.append(FederationEdu(dest, "m.presence", content))
        await self._m.process_federation_batch(token, edus)

    async def _device_list_destinations(self, users: list[str]) -> list[str]:
        async def fn(tx: Tx) -> list[str]:
            return await tx.outbox.device_list_destinations(users)

        return await self._storage.run(fn)

    async def on_remote_server_up(self, server: str) -> None:
        await self._m.remote_server_up(server)


class StorageRoomHosts:
    """Implements :class:`federation_sender.edus.RoomHosts` through the storage backend
    (natively: the membership replay, and the event's ``origin_server_ts`` as its
    reception time, as the native schema keeps no other)."""

    def __init__(self, storage: Backend) -> None:
        self._storage = storage

    async def current_hosts(self, room_id: str) -> frozenset[str]:
        async def fn(tx: Tx) -> frozenset[str]:
            return (await tx.hosts.current_hosts([room_id]))[room_id]

        return await self._storage.run(fn)

    async def receipt_hosts(self, room_id: str) -> frozenset[str]:
        """The current hosts (a partial-state room's servers at join are the Synapse
        backend's: :class:`federation_sender.storage.synapse.rooms.SynapseRooms`)."""
        return await self.current_hosts(room_id)

    async def event_meta(self, room_id: str, event_id: str) -> EventMeta | None:
        async def fn(tx: Tx) -> tuple[str, int] | None:
            return await tx.events.sender_and_received_ts(room_id, event_id)

        found = await self._storage.run(fn)
        return None if found is None else EventMeta(*found)


class DbPositionStore:
    """Implements :class:`federation_sender.replication.positions.PositionStore`."""

    def __init__(self, storage: Backend, instance_name: str) -> None:
        self._storage = storage
        self._reader = instance_name

    async def load(self) -> dict[tuple[str, str], int]:
        async def fn(tx: Tx) -> dict[tuple[str, str], int]:
            return await tx.positions.load_replication(self._reader)

        return await self._storage.run(fn)

    async def save(self, stream: str, instance: str, token: int) -> None:
        async def fn(tx: Tx) -> None:
            await tx.positions.save_replication(self._reader, stream, instance, token)

        await self._storage.run(fn)


_ADMIN_STATE: dict[DestinationState, str] = {
    DestinationState.IDLE: "idle",
    DestinationState.SENDING: "sending",
    DestinationState.BACKING_OFF: "backing_off",
    DestinationState.CATCHING_UP: "catching_up",
    DestinationState.STOPPED: "idle",
}


def live_state(st: DestinationStatus) -> LiveState:
    return {
        "state": _ADMIN_STATE[st.state],  # type: ignore[typeddict-item]
        "pending_pdus": st.pending_pdus,
        "pending_edus": st.pending_edus,
        "in_flight_txn_id": st.in_flight_txn_id,
        "in_flight_age_s": st.in_flight_age_s,
        "last_error": st.last_error,
        "next_retry_ts": st.next_retry_ts_ms,
        "last_success_ts": st.last_success_ts_ms,
        "catching_up": st.catching_up,
    }


class AdminQueueControl:
    """Implements :class:`federation_sender.admin.protocols.QueueControl`."""

    def __init__(self, manager: QueueManager) -> None:
        self._m = manager

    def live_state(self, destination: str) -> Mapping[str, Any] | None:
        st = self._m.status(destination)
        return None if st is None else live_state(st)

    def live_states(self) -> Mapping[str, Mapping[str, Any]]:
        return {st.destination: live_state(st) for st in self._m.statuses()}

    async def reset_connection(self, destination: str) -> bool:
        return await self._m.reset_connection(destination)


def queue_snapshot(manager: QueueManager) -> QueueSnapshot:
    pdus = edus = backing = catching = in_flight = 0
    for st in manager.statuses():
        pdus += st.pending_pdus
        edus += st.pending_edus
        if st.in_flight_txn_id:
            in_flight += 1
        if st.state is DestinationState.BACKING_OFF:
            backing += 1
        if st.catching_up:
            catching += 1
    return QueueSnapshot(
        pending_destinations=manager.owed_destinations(),
        pending_pdus=pdus,
        pending_edus=edus,
        backing_off=backing,
        catching_up=catching,
        in_flight_transactions=in_flight,
        oldest_in_flight_age_s=manager.oldest_in_flight_age_s() or 0.0,
    )
