"""Gap fetchers: the rows of a replication stream read back from the database.

When a ``POSITION`` shows the reader missed rows (``cur < prev``: a reconnect, a worker
restart while main went on), the replication client asks the stream's fetcher for the
rows in ``(cur, new]`` (:mod:`federation_sender.replication.positions`). Without one it
could only skip them. What each consumed stream needs:

* ``to_device``: the destinations with messages in the gap, from
  ``device_federation_outbox`` (both backends: the columns are the same);
* ``device_lists``: the users whose devices changed, from
  ``device_lists_outbound_pokes``, as rows with ``hosts_calculated`` so that their
  destinations are woken (both backends);
* ``receipts``: ``receipts_linearized``, Synapse's receipts stream table (the native
  schema keeps no receipts);
* ``events``: none needed, the intake reads events past its own persisted position;
* ``presence``: ``presence_stream`` (Synapse keeps the latest row per user, which is
  what Synapse's own fetch returns too);
* ``typing``: none possible, main keeps typing in memory; the next change or the 40 s
  re-send repairs a lost one;
* ``presence_federation``: none possible, main keeps that queue in memory;
* ``federation``: none, Synapse never writes this stream.

Which fetchers a deployment has is the backend's capability
(:mod:`federation_sender.storage.capabilities`); the Synapse-only ones are in
:mod:`federation_sender.storage.synapse.stream_fetchers`. What a gap without a fetcher
skips is the stream's own note in the stream table
(:mod:`federation_sender.intake.streams`), unless the backend's gap notes say otherwise
(natively: no receipts, no presence; beside Synapse: nothing is missed in
``federation``): the replication client logs nothing above DEBUG for ``events``
(nothing is missed) and one line naming what is skipped for the others (INFO for what
is volatile anyway, WARNING for rows lost). The stream names here are checked against
the table (``tests/intake/test_streams.py``): the storage layer is below the intake.

Rows sharing a stream id are never split between two fetches: a fetch that fills its
limit stops before the last stream id it saw, unless that id alone fills it, in which
case all of its rows are returned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.replication.client import GapNote
from federation_sender.replication.positions import StreamFetcher
from federation_sender.replication.rows import (
    DeviceListsRow,
    Row,
    ToDeviceStreamRow,
)

RowMaker = Callable[[Sequence[Any]], Row]

_TO_DEVICE = (
    "SELECT DISTINCT stream_id, destination FROM device_federation_outbox"
    " WHERE :from_id < stream_id AND stream_id <= :upto {extra} ORDER BY stream_id"
)
_DEVICE_LISTS = (
    "SELECT DISTINCT stream_id, user_id FROM device_lists_outbound_pokes"
    " WHERE :from_id < stream_id AND stream_id <= :upto {extra} ORDER BY stream_id"
)
class SqlStreamFetcher:
    """Implements :class:`StreamFetcher` with one query whose first column is the
    stream id (``{extra}`` in the query is where the per-fetch bound goes)."""

    def __init__(self, engine: AsyncEngine, query: str, make_row: RowMaker) -> None:
        self._engine = engine
        self._limited = text(query.format(extra="") + " LIMIT :limit")
        self._one_id: TextClause = text(
            query.format(extra="AND stream_id = :only")
        )
        self._make_row = make_row

    async def fetch(
        self, instance: str, from_token: int, upto_token: int, limit: int
    ) -> tuple[list[tuple[int, Row]], int, bool]:
        params = {"from_id": from_token, "upto": upto_token, "limit": limit}
        async with self._engine.connect() as conn:
            rows = (await conn.execute(self._limited, params)).all()
            if len(rows) < limit:
                return [(int(r[0]), self._make_row(r)) for r in rows], upto_token, False
            last = int(rows[-1][0])
            kept = [r for r in rows if int(r[0]) < last]
            if not kept:  # one stream id fills the limit: take all of its rows
                only = {"from_id": from_token, "upto": upto_token, "only": last}
                kept = list((await conn.execute(self._one_id, only)).all())
                return [(last, self._make_row(r)) for r in kept], last, True
        return [(int(r[0]), self._make_row(r)) for r in kept], int(kept[-1][0]), True


def native_gap_notes() -> dict[str, GapNote | None]:
    """What a gap skips on the native backend where the stream table's note
    (:mod:`federation_sender.intake.streams`) does not say it: the streams its schema
    keeps no table for."""
    return {
        "receipts": GapNote(
            logging.WARNING,
            "receipts in that range are not sent (the native schema keeps no receipts)",
        ),
        "presence": GapNote(
            logging.WARNING,
            "presence changes in that range are not sent (the native schema keeps no "
            "presence)",
        ),
    }


def common_fetchers(engine: AsyncEngine) -> dict[str, StreamFetcher]:
    """The fetchers of the outbox streams, whose tables both schemas share."""
    return {
        "to_device": SqlStreamFetcher(engine, _TO_DEVICE, lambda r: ToDeviceStreamRow(str(r[1]))),
        "device_lists": SqlStreamFetcher(
            engine, _DEVICE_LISTS, lambda r: DeviceListsRow(str(r[1]), False, True)
        ),
    }
