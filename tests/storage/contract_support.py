"""The storage contract's subjects (``test_backend_contract*.py``; the fixtures are in
``conftest.py``): a backend, and a writer of the main process's rows where the backend
has one. A new backend joins by adding a case to :func:`open_subject`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.storage.protocols import Backend, Tx
from federation_sender.storage.synapse.backend import SynapseBackend
from federation_sender.storage.synapse.database import create_synapse_engine, upgrade_own_schema
from federation_sender.synapse.config import SynapseConfig
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.queue_writer import HomeserverWriter, WrittenEvent

T = TypeVar("T")
ME = "local.test"


class MainWriter(Protocol):
    """The main process's writes the contract needs (``HomeserverWriter`` natively)."""

    async def membership(
        self, room_id: str, user_id: str, membership: str, sender: str | None = None
    ) -> WrittenEvent: ...

    async def message(self, room_id: str, sender: str) -> WrittenEvent: ...

    async def set_extremities(self, room_id: str, event_ids: Sequence[str]) -> None: ...

    async def mark_partial_state(self, room_id: str) -> None: ...

    async def to_device(self, destination: str, content: dict[str, Any]) -> int: ...

    async def device_list(self, destination: str, user_id: str, device_id: str) -> int: ...


async def _nothing(_events: Sequence[tuple[str, int]]) -> None:
    return None


@dataclass
class Subject:
    backend: Backend
    main: MainWriter | None
    events_exist: Callable[[Sequence[tuple[str, int]]], Awaitable[None]] = _nothing
    """Make (room_id, stream_ordering) events and their rooms exist, as the main process
    does before the fan-out records them in ``destination_rooms``: Synapse's
    ``destination_rooms`` refers to ``rooms`` and its catch-up reads join ``events``.
    Nothing to do natively."""
    url: str = ""
    """The database's URL (the batch jobs' driver reads it with plain DB-API)."""

    async def run(self, fn: Callable[[Tx], Awaitable[T]]) -> T:
        return await self.backend.run(fn)


@dataclass
class Seeded(Subject):
    main: MainWriter


def _synapse_config(instance: str) -> SynapseConfig:
    return SynapseConfig(
        server_name=ME, database_url="", redis_url="", signing_key_path="",
        worker_name=instance, federation_sender_instances=(instance,),
        federation_domain_whitelist=None, ip_range_blacklist=(), ip_range_whitelist=(),
        verify_tls=True, extra_ca_file=None, min_retry_interval_ms=600_000,
        retry_multiplier=2.0, max_retry_interval_ms=7 * 86_400_000,
    )


@asynccontextmanager
async def open_subject(kind: str, url: str) -> AsyncIterator[Subject]:
    """``native-sqlite``/``native-postgresql`` (with ``HomeserverWriter``), or
    ``synapse-postgresql`` on a database holding Synapse's own schema."""
    if kind.startswith("native-"):
        engine = create_engine(url)
        await upgrade(engine)
        try:
            yield Seeded(NativeBackend(engine), await HomeserverWriter(engine, ME).init(),
                         url=url)
        finally:
            await engine.dispose()
        return
    engine = create_synapse_engine(url)
    await upgrade_own_schema(engine)

    backend = SynapseBackend(engine, _synapse_config("fed1"), "fed1", FakeClock())
    try:
        yield Subject(backend, None, lambda evs: _synapse_events(engine, evs), url=url)
    finally:
        await engine.dispose()


async def _synapse_events(engine: AsyncEngine, events: Sequence[tuple[str, int]]) -> None:
    """Bare rooms and message events in Synapse's tables (one event per stream
    ordering: the first room given with it)."""
    first: dict[int, str] = {}
    for room_id, so in events:
        first.setdefault(so, room_id)
    async with engine.begin() as conn:
        for room_id in dict.fromkeys(r for r, _ in events):
            await conn.execute(text(
                "INSERT INTO rooms (room_id, is_public, creator, room_version)"
                " SELECT :r, false, :c, '10' WHERE NOT EXISTS"
                " (SELECT 1 FROM rooms WHERE room_id = :r)"), {"r": room_id, "c": f"@c:{ME}"})
        for so, room_id in first.items():
            event_id = f"$contract{so}"
            await conn.execute(text(
                "INSERT INTO events (topological_ordering, event_id, type, room_id, processed,"
                " outlier, depth, origin_server_ts, received_ts, sender, instance_name,"
                " stream_ordering) VALUES (:so, :e, 'm.room.message', :r, true, false, :so,"
                " :so, :so, :c, 'master', :so)"), {"so": so, "e": event_id, "r": room_id,
                                                   "c": f"@c:{ME}"})
            pdu = {"event_id": event_id, "room_id": room_id, "type": "m.room.message",
                   "sender": f"@c:{ME}", "depth": so, "content": {}}
            await conn.execute(text(
                "INSERT INTO event_json (event_id, room_id, internal_metadata, json,"
                " format_version) VALUES (:e, :r, '{}', :j, 3)"),
                {"e": event_id, "r": room_id, "j": json.dumps(pdu)})
