"""Stands in for the main process in queue tests and benchmarks: writes events,
memberships, forward extremities, partial-state flags and outbox rows the way the
event writer would. Each new event becomes its room's only forward extremity unless
told otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.ids import server_of
from federation_sender.storage import schema as s


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

    def _event_json(self, ev: dict[str, Any]) -> str:
        return json.dumps(ev, separators=(",", ":"))

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
        row = {
            "stream_ordering": so,
            "event_id": event_id,
            "room_id": room_id,
            "type": etype,
            "state_key": state_key,
            "sender": sender,
            "origin_server_ts": ev["origin_server_ts"],
            "outlier": outlier,
            "rejected": False,
            "json": self._event_json(ev),
        }
        return row, WrittenEvent(so, event_id, room_id)

    async def _write(
        self,
        rows: Sequence[dict[str, Any]],
        memberships: Sequence[dict[str, Any]],
        set_extremity: bool,
    ) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(insert(s.events), list(rows))
            if memberships:
                await conn.execute(insert(s.room_memberships), list(memberships))
            if set_extremity:
                last: dict[str, str] = {}
                for r in rows:
                    if not r["outlier"]:
                        last[r["room_id"]] = r["event_id"]
                for room, eid in last.items():
                    await conn.execute(
                        delete(s.event_forward_extremities).where(
                            s.event_forward_extremities.c.room_id == room
                        )
                    )
                    await conn.execute(
                        insert(s.event_forward_extremities).values(room_id=room, event_id=eid)
                    )

    async def membership(
        self, room_id: str, user_id: str, membership: str, sender: str | None = None
    ) -> WrittenEvent:
        sender = sender or user_id
        row, ev = self._rows(
            room_id, sender, "m.room.member", {"membership": membership}, user_id, False, 0
        )
        m = {
            "event_id": ev.event_id,
            "event_stream_ordering": ev.stream_ordering,
            "room_id": room_id,
            "user_id": user_id,
            "server_name": server_of(user_id),
            "sender": sender,
            "membership": membership,
        }
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
                {
                    "event_id": ev.event_id,
                    "event_stream_ordering": ev.stream_ordering,
                    "room_id": room_id,
                    "user_id": u,
                    "server_name": server_of(u),
                    "sender": u,
                    "membership": "join",
                }
            )
        await self._write(rows, ms, True)

    async def set_extremities(self, room_id: str, event_ids: Sequence[str]) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                delete(s.event_forward_extremities).where(
                    s.event_forward_extremities.c.room_id == room_id
                )
            )
            for e in event_ids:
                await conn.execute(
                    insert(s.event_forward_extremities).values(room_id=room_id, event_id=e)
                )

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
        async with self.engine.begin() as conn:
            await conn.execute(
                insert(s.device_federation_outbox).values(
                    destination=destination,
                    stream_id=self._outbox_stream,
                    queued_ts=0,
                    messages_json=json.dumps(content),
                )
            )
        return self._outbox_stream

    async def device_list(self, destination: str, user_id: str, device_id: str) -> int:
        self._outbox_stream += 1
        async with self.engine.begin() as conn:
            await conn.execute(
                insert(s.device_lists_outbound_pokes).values(
                    destination=destination,
                    stream_id=self._outbox_stream,
                    user_id=user_id,
                    device_id=device_id,
                    ts=0,
                    content_json=json.dumps({"deleted": False}),
                )
            )
        return self._outbox_stream
