"""Shared constants and database seeding for the admin tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.storage.schema import destination_rooms, destinations

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def add_destinations(engine: AsyncEngine, rows: Sequence[dict[str, Any]]) -> None:
    full = [{"retry_last_ts": None, "retry_interval": None, "failure_ts": None,
             "last_successful_stream_ordering": None, **r} for r in rows]
    async with engine.begin() as conn:
        await conn.execute(insert(destinations), full)


async def add_rooms(engine: AsyncEngine, destination: str, rooms: dict[str, int]) -> None:
    async with engine.begin() as conn:
        await conn.execute(insert(destination_rooms), [
            {"destination": destination, "room_id": r, "stream_ordering": so}
            for r, so in rooms.items()])
