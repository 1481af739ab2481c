"""To-device messages in Synapse's ``device_federation_outbox``.

Read past a stream id, up to the ``to_device`` stream token main last announced (rows at
or below it are committed), and, once the destination accepted them, deleted, as Synapse
does; we delete exactly the rows sent rather than everything up to an id, so a row is
never deleted unseen.
"""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.model import ToDeviceRow

_TO_DEVICE = text(
    """
    SELECT stream_id, messages_json FROM device_federation_outbox
    WHERE destination = :d AND stream_id > :after
      AND (CAST(:upto AS BIGINT) IS NULL OR stream_id <= CAST(:upto AS BIGINT))
    ORDER BY stream_id
    LIMIT :limit
    """
)

_WITH_ROWS = text(
    "SELECT DISTINCT destination FROM device_federation_outbox WHERE destination = ANY(:ds)"
)

_DELETE_TO_DEVICE = text(
    "DELETE FROM device_federation_outbox WHERE destination = :d "
    "AND stream_id = ANY(CAST(:ids AS BIGINT[]))"
)


async def unsent_to_device(
    conn: AsyncConnection, destination: str, after: int, limit: int, upto: int | None = None
) -> list[ToDeviceRow]:
    """Rows past ``after``, up to ``upto`` (the ``to_device`` stream token: every row at
    or below it is committed, as Synapse bounds its reads) when known."""
    res = await conn.execute(
        _TO_DEVICE, {"d": destination, "after": after, "upto": upto, "limit": limit}
    )
    return [ToDeviceRow(int(sid), str(msg)) for sid, msg in res]


async def destinations_with_rows(
    conn: AsyncConnection, destinations: Collection[str]
) -> set[str]:
    """Those of ``destinations`` with a to-device row (rows are deleted once
    delivered), one statement."""
    if not destinations:
        return set()
    res = await conn.execute(_WITH_ROWS, {"ds": sorted(destinations)})
    return {str(r) for r in res.scalars()}


async def delete_to_device(
    conn: AsyncConnection, destination: str, stream_ids: Collection[int]
) -> None:
    if stream_ids:
        await conn.execute(_DELETE_TO_DEVICE, {"d": destination, "ids": list(stream_ids)})
