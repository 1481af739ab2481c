"""To-device messages in Synapse's own ``device_federation_outbox``: read up to the
announced token, and deleted exactly as sent."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.model import ToDeviceRow
from federation_sender.storage.synapse.to_device import delete_to_device, unsent_to_device
from tests.synapse.backend_support import (  # noqa: F401
    synapse_db_url_fixture,
    synapse_engine_fixture,
    synapse_template_fixture,
)

pytestmark = pytest.mark.postgres


async def test_rows_are_read_up_to_the_token_and_deleted_as_sent(
    synapse_engine: AsyncEngine,
) -> None:
    async with synapse_engine.begin() as conn:
        for dest, sid in [("d.test", 1), ("d.test", 2), ("d.test", 3), ("e.test", 2)]:
            await conn.execute(text(
                "INSERT INTO device_federation_outbox"
                " (destination, stream_id, queued_ts, messages_json)"
                " VALUES (:d, :s, 0, :m)"), {"d": dest, "s": sid, "m": f'{{"n": {sid}}}'})
    async with synapse_engine.begin() as conn:
        assert await unsent_to_device(conn, "d.test", 0, 10, upto=2) == [
            ToDeviceRow(1, '{"n": 1}'), ToDeviceRow(2, '{"n": 2}'),
        ]
        assert [r.stream_id for r in await unsent_to_device(conn, "d.test", 1, 1)] == [2]
        await delete_to_device(conn, "d.test", [1, 3])
        assert [r.stream_id for r in await unsent_to_device(conn, "d.test", 0, 10)] == [2]
        assert [r.stream_id for r in await unsent_to_device(conn, "e.test", 0, 10)] == [2]
