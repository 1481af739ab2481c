"""Stands in for the main process in queue tests and benchmarks: writes events,
memberships, forward extremities, partial-state flags and outbox rows the way the
event writer would, one call at a time, through the rows of ``main_writes.py`` (the
simulator's store writes whole batches through the same rows). Each new event
becomes its room's only forward extremity unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.ids import server_of
from federation_sender.storage import schema as s
from federation_sender.testing import main_writes as w


@dataclass(frozen=True)
class WrittenEvent:
    stream_ordering: int
    event_id: str
    room_id: str




class HomeserverWriter:
    def __init__(self, engine: AsyncEngine, server_name: str = "local.test") -> None:
        self.engine = engine
        self.server_name = server_name
        self.stream_ordering = 0
        self._outbox_stream = 0
        self._depth: dict[str, int] = {}

    async def init(self) -> HomeserverWriter:
        async with self.engine.connect() as conn:
            v = (
                await conn.execute(
                    select(s.events.c.stream_ordering)
                    .order_by(s.events.c.stream_ordering.desc())
                    .limit(1)
                )
            ).scalar()
        self.stream_ordering = int(v or 0)
        return self

    def _rows(
        self,
        room_id: str,
        sender: str,
        etype: str,
        content: dict[str, Any],
        state_key: str | None,
        outlier: bool,
        pad: int,
    ) -> tuple[dict[str, Any], WrittenEvent]:
        self.stream_ordering += 1
        so = self.stream_ordering
        origin = server_of(sender)
        event_id = f"${so}-{room_id.strip('!').split(':')[0]}:{origin}"
        depth = self._depth.get(room_id, 0) + 1
        self._depth[room_id] = depth
        ev: dict[str, Any] = {
            "event_id": event_id,
            "room_id": room_id,
            "type": etype,
            "sender": sender,
            "origin": origin,
            "origin_server_ts": 1_700_000_000_000 + so,
            "depth": depth,
            "content": content if not pad else {**content, "pad": "x" * pad},
            "prev_events": [],
            "auth_events": [],
            "hashes": {"sha256": "x"},
            "signatures": {},
        }
        if state_key is not None:
            ev["state_key"] = state_key
        row = w.event_row(so, event_id, ev, outlier=outlier)
        return row, WrittenEvent(so, event_id, room_id)

    async def _write(
        self,
        rows: Sequence[dict[str, Any]],
        memberships: Sequence[dict[str, Any]],
        set_extremity: bool,
    ) -> None:
        last: dict[str, list[str]] = {}
        if set_extremity:
            for r in rows:
                if not r["outlier"]:
                    last[r["room_id"]] = [r["event_id"]]
        async with self.engine.begin() as conn:
            await w.write_main_rows(conn, events=rows, memberships=memberships, extremities=last)

    async def membership(
        self, room_id: str, user_id: str, membership: str, sender: str | None = None
    ) -> WrittenEvent:
        sender = sender or user_id
        row, ev = self._rows(
            room_id, sender, "m.room.member", {"membership": membership}, user_id, False, 0
        )
        m = w.membership_row(
            ev.event_id, ev.stream_ordering, room_id, user_id, sender, membership
        )
        await self._write([row], [m], True)
        return ev

    async def join(self, room_id: str, user_id: str) -> WrittenEvent:
        return await self.membership(room_id, user_id, "join")

    async def message(
        self,
        room_id: str,
        sender: str,
        *,
        outlier: bool = False,
        pad: int = 0,
        set_extremity: bool = True,
    ) -> WrittenEvent:
        row, ev = self._rows(room_id, sender, "m.room.message", {"body": "hi"}, None, outlier, pad)
        await self._write([row], [], set_extremity and not outlier)
        return ev

    async def messages(
        self, room_id: str, sender: str, n: int, *, pad: int = 0
    ) -> list[WrittenEvent]:
        rows, evs = [], []
        for _ in range(n):
            row, ev = self._rows(
                room_id, sender, "m.room.message", {"body": "hi"}, None, False, pad
            )
            rows.append(row)
            evs.append(ev)
        if rows:
            await self._write(rows, [], True)
        return evs

    async def messages_in_rooms(
        self, pairs: Sequence[tuple[str, str]], *, pad: int = 0
    ) -> list[WrittenEvent]:
        """One message per (room, sender), written in one transaction."""
        rows, evs = [], []
        for room, sender in pairs:
            row, ev = self._rows(room, sender, "m.room.message", {"body": "hi"}, None, False, pad)
            rows.append(row)
            evs.append(ev)
        if rows:
            await self._write(rows, [], True)
        return evs

    async def bulk_joins(self, room_id: str, user_ids: Sequence[str]) -> None:
        rows, ms = [], []
        for u in user_ids:
            row, ev = self._rows(room_id, u, "m.room.member", {"membership": "join"}, u, False, 0)
            rows.append(row)
            ms.append(
                w.membership_row(ev.event_id, ev.stream_ordering, room_id, u, u, "join")
            )
        await self._write(rows, ms, True)

    async def set_extremities(self, room_id: str, event_ids: Sequence[str]) -> None:
        async with self.engine.begin() as conn:
            await w.replace_extremities(conn, {room_id: list(event_ids)})

    async def mark_partial_state(self, room_id: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(insert(s.partial_state_rooms).values(room_id=room_id))

    async def purge_room(self, room_id: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(delete(s.events).where(s.events.c.room_id == room_id))
            await conn.execute(
                delete(s.event_forward_extremities).where(
                    s.event_forward_extremities.c.room_id == room_id
                )
            )

    async def to_device(self, destination: str, content: dict[str, Any]) -> int:
        self._outbox_stream += 1
        row = w.outbox_row(destination, self._outbox_stream, 0, content)
        async with self.engine.begin() as conn:
            await w.write_main_rows(conn, to_device=[row])
        return self._outbox_stream

    async def device_list(self, destination: str, user_id: str, device_id: str) -> int:
        self._outbox_stream += 1
        content = {"deleted": False}
        row = w.poke_row(destination, self._outbox_stream, user_id, device_id, 0, content)
        async with self.engine.begin() as conn:
            await w.write_main_rows(conn, pokes=[row])
        return self._outbox_stream
