"""Persisting simulator batches through the real schema, as the main process would.

:meth:`SimStore.persist` reserves stream ids for a :class:`~.model.Batch`, writes every
row in one transaction with bulk inserts, then completes the ids through the
:class:`~.publish.Publisher` so readers hear of them only once they are committed. If
the transaction fails, the ids are completed with no rows (the stream must not stall)
and the error propagates; the world model has then moved ahead of the database, so a
caller should treat the run as failed rather than continue. An event id that is already
stored, or twice in the batch, is a bug in the world (a real main process never makes
the same event twice): it fails as :class:`DuplicateEventError`, one line naming the
id, rather than as the database's unique violation with every row of the batch.

Rows written:

* ``events``: one per event, ``json`` the PDU, stream ordering in batch order;
* ``room_memberships``: one per membership event (outliers too: a partial join's
  state says who is in the room);
* ``event_forward_extremities``: for each room with new non-outlier events, the room's
  extremities after the last of them replace the old ones;
* ``partial_state_rooms``: rooms added/removed;
* ``device_federation_outbox``: one per to-device message, one ``to_device`` id each;
* ``device_lists_outbound_pokes``: one per destination of a device change, one
  ``device_lists`` id per change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from federation_sender.clock import Clock, time_ms
from federation_sender.sim.model import Batch, DeviceListChange, SimEvent, ToDeviceMessage
from federation_sender.sim.publish import DEVICE_LISTS, EVENTS, TO_DEVICE, JsonRow, Publisher
from federation_sender.storage import schema
from federation_sender.storage.engine import run_in_transaction
from federation_sender.testing import main_writes as w


class DuplicateEventError(Exception):
    """The simulator tried to persist an event it had already made (a bug in the world)."""

    def __init__(self, event_id: str) -> None:
        super().__init__(
            f"simulator made event {event_id} twice (duplicate event id): a bug in "
            "federation_sender.sim.world, not in the worker"
        )
        self.event_id = event_id


@dataclass(frozen=True, slots=True)
class PersistedEvent:
    stream_ordering: int
    event: SimEvent


@dataclass(frozen=True, slots=True)
class PersistedToDevice:
    stream_id: int
    message: ToDeviceMessage


@dataclass(frozen=True, slots=True)
class PersistedDeviceChange:
    stream_id: int
    change: DeviceListChange


@dataclass(slots=True)
class PersistedBatch:
    events: list[PersistedEvent] = field(default_factory=list)
    to_device: list[PersistedToDevice] = field(default_factory=list)
    device_changes: list[PersistedDeviceChange] = field(default_factory=list)


def event_row(e: SimEvent) -> JsonRow:
    """The ``events`` stream RDATA row (Synapse's ``EventsStreamEventRow``)."""
    return [
        "ev",
        [e.event_id, e.room_id, e.type, e.state_key, None, None, e.membership, False, e.outlier],
    ]


class SimStore:
    """Writes batches for the instance ``instance_name`` (the events' writer)."""

    def __init__(
        self,
        engine: AsyncEngine,
        publisher: Publisher,
        clock: Clock,
        *,
        instance_name: str = "master",
    ) -> None:
        self.engine = engine
        self.publisher = publisher
        self.clock = clock
        self.instance_name = instance_name

    async def persist(self, batch: Batch) -> PersistedBatch:
        ev_ids = await self.publisher.reserve(EVENTS, len(batch.events)) if batch.events else []
        td_ids = (
            await self.publisher.reserve(TO_DEVICE, len(batch.to_device)) if batch.to_device else []
        )
        dl_ids = (
            await self.publisher.reserve(DEVICE_LISTS, len(batch.device_changes))
            if batch.device_changes
            else []
        )
        out = PersistedBatch(
            [PersistedEvent(i, e) for i, e in zip(ev_ids, batch.events, strict=True)],
            [PersistedToDevice(i, m) for i, m in zip(td_ids, batch.to_device, strict=True)],
            [
                PersistedDeviceChange(i, c)
                for i, c in zip(dl_ids, batch.device_changes, strict=True)
            ],
        )
        try:
            await run_in_transaction(self.engine, lambda conn: self._write(conn, batch, out))
        except BaseException as e:
            await self._complete(ev_ids, td_ids, dl_ids, None)
            if isinstance(e, IntegrityError) and (duplicate := await self._duplicate_event(batch)):
                raise DuplicateEventError(duplicate) from None
            raise
        await self._complete(ev_ids, td_ids, dl_ids, out)
        return out

    async def _duplicate_event(self, batch: Batch) -> str | None:
        """After a unique violation: the first of the batch's event ids that is in it
        twice or was already stored (``None`` if none is, or if the lookup fails)."""
        seen: set[str] = set()
        for e in batch.events:
            if e.event_id in seen:
                return e.event_id
            seen.add(e.event_id)
        ids = [e.event_id for e in batch.events]
        events = schema.events
        try:
            async with self.engine.connect() as conn:
                stored: set[str] = set()
                for chunk in w.chunks(ids):
                    query = select(events.c.event_id).where(events.c.event_id.in_(chunk))
                    stored.update((await conn.execute(query)).scalars())
        except Exception:
            return None  # the original error says more than a failed lookup
        return next((i for i in ids if i in stored), None)

    async def _complete(
        self,
        ev_ids: list[int],
        td_ids: list[int],
        dl_ids: list[int],
        out: PersistedBatch | None,
    ) -> None:
        if ev_ids:
            rows = {p.stream_ordering: [event_row(p.event)] for p in out.events} if out else {}
            await self.publisher.complete(EVENTS, {i: rows.get(i, []) for i in ev_ids})
        if td_ids:
            td = {p.stream_id: [[p.message.destination]] for p in out.to_device} if out else {}
            await self.publisher.complete(TO_DEVICE, {i: td.get(i, []) for i in td_ids})
        if dl_ids:
            dl = (
                {p.stream_id: [[p.change.user_id, False, True]] for p in out.device_changes}
                if out
                else {}
            )
            await self.publisher.complete(DEVICE_LISTS, {i: dl.get(i, []) for i in dl_ids})

    async def _write(self, conn: AsyncConnection, batch: Batch, out: PersistedBatch) -> None:
        extremities: dict[str, tuple[str, ...]] = {}
        for p in out.events:
            if not p.event.outlier:
                extremities[p.event.room_id] = p.event.extremities_after
        now_ms = time_ms(self.clock)
        await w.write_main_rows(
            conn,
            events=self._event_rows(out),
            memberships=_member_rows(out),
            extremities=extremities,
            to_device=_outbox_rows(out, now_ms),
            pokes=_poke_rows(out, now_ms),
        )
        await self._partial_state(conn, batch)

    def _event_rows(self, out: PersistedBatch) -> list[dict[str, Any]]:
        return [
            w.event_row(
                p.stream_ordering,
                p.event.event_id,
                p.event.pdu,
                outlier=p.event.outlier,
                instance_name=self.instance_name,
            )
            for p in out.events
        ]

    @staticmethod
    async def _partial_state(conn: AsyncConnection, batch: Batch) -> None:
        ps = schema.partial_state_rooms
        if batch.partial_state_added:
            await conn.execute(insert(ps), [{"room_id": r} for r in batch.partial_state_added])
        for chunk in w.chunks(batch.partial_state_removed):
            await conn.execute(delete(ps).where(ps.c.room_id.in_(chunk)))


def _member_rows(out: PersistedBatch) -> list[dict[str, Any]]:
    return [
        w.membership_row(
            p.event.event_id,
            p.stream_ordering,
            p.event.room_id,
            p.event.state_key,
            p.event.sender,
            p.event.membership,
        )
        for p in out.events
        if p.event.membership is not None and p.event.state_key is not None
    ]


def _outbox_rows(out: PersistedBatch, now_ms: int) -> list[dict[str, Any]]:
    return [
        w.outbox_row(p.message.destination, p.stream_id, now_ms, p.message.content)
        for p in out.to_device
    ]


def _poke_rows(out: PersistedBatch, now_ms: int) -> list[dict[str, Any]]:
    return [
        w.poke_row(
            dest, p.stream_id, p.change.user_id, p.change.device_id, now_ms, p.change.content
        )
        for p in out.device_changes
        for dest in sorted(p.change.destinations)
    ]
