"""The log of transaction attempts (``federation_transaction_log``).

Every attempt is one row, whatever its outcome. ``pdu_event_ids`` (a JSON list),
``max_stream_ordering`` and ``catchup`` are always filled: an offline audit job joins
them against ``events`` to prove delivery. The table is ours on both backends (beside
Synapse, in schema ``federation_sender``): :class:`TxnLogTable` is the ``tx.txlog`` of
both.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import orjson
from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.model import TxnLogRow, event_ids_from_json
from federation_sender.storage.schema import federation_transaction_log as tl

_COLUMNS = (
    "txn_id", "destination", "instance_name", "pdu_count", "edu_count", "request_bytes",
    "status", "http_status", "started_ts", "duration_ms", "catchup", "max_stream_ordering",
    "error", "pdu_event_ids",
)
# PostgreSQL: COPY, the group commit's rows streamed in the text format (psycopg
# formats each row in C). It replaced one INSERT of a jsonb array of rows expanded
# server-side, which had replaced an executemany: the server parsed every row's 50 event
# ids as JSON and wrote them out again, and COPY takes a third less of the server's CPU
# for the log (8 against 12 ms per 300 rows of 50 ids, bench/txlog_insert.py), which the
# receivers and Synapse share the machine with. ``pdu_event_ids`` is stored as compact
# JSON text, as on SQLite.
PG_COPY = f"COPY federation_transaction_log ({', '.join(_COLUMNS)}) FROM STDIN"
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def event_ids_json(ids: Sequence[str]) -> str:
    """``pdu_event_ids``' text: compact JSON."""
    try:
        # orjson: several times faster than json's C encoder, the same compact text
        # but for non-ASCII, which it writes as UTF-8 (json escapes it): both read back
        # as the same ids.
        return orjson.dumps(tuple(ids)).decode()
    except TypeError:  # a string orjson refuses (a lone surrogate): json escapes it
        return _COMPACT.encode(list(ids))


async def log_transactions(conn: AsyncConnection, rows: Sequence[TxnLogRow]) -> None:
    if not rows:
        return
    if conn.dialect.name == "postgresql":
        # The COPY runs on the connection's own driver connection, inside its
        # transaction: the log commits with the positions it proves.
        raw = await conn.get_raw_connection()
        driver = raw.driver_connection
        if driver is None:
            raise RuntimeError("the database connection is closed")
        async with driver.cursor() as cur, cur.copy(PG_COPY) as copy:
            for r in rows:
                # A row is a tuple in column order but for the ids, which go last.
                await copy.write_row((*r[:12], r.error, event_ids_json(r.pdu_event_ids)))
        return
    await conn.execute(insert(tl), [
        {
            "txn_id": r.txn_id,
            "destination": r.destination,
            "instance_name": r.instance_name,
            "pdu_count": r.pdu_count,
            "edu_count": r.edu_count,
            "request_bytes": r.request_bytes,
            "status": r.status,
            "http_status": r.http_status,
            "started_ts": r.started_ts,
            "duration_ms": r.duration_ms,
            "catchup": r.catchup,
            "max_stream_ordering": r.max_stream_ordering,
            "pdu_event_ids": event_ids_json(r.pdu_event_ids),
            "error": r.error,
        }
        for r in rows
    ])


async def recent_transactions(
    conn: AsyncConnection, destination: str, limit: int = 100
) -> list[TxnLogRow]:
    """Newest first."""
    res = await conn.execute(
        select(tl)
        .where(tl.c.destination == destination)
        .order_by(tl.c.started_ts.desc(), tl.c.id.desc())
        .limit(limit)
    )
    return [
        TxnLogRow(
            txn_id=r.txn_id,
            destination=r.destination,
            instance_name=r.instance_name,
            pdu_count=r.pdu_count,
            edu_count=r.edu_count,
            request_bytes=r.request_bytes,
            status=r.status,
            http_status=r.http_status,
            started_ts=r.started_ts,
            duration_ms=r.duration_ms,
            catchup=bool(r.catchup),
            max_stream_ordering=r.max_stream_ordering,
            pdu_event_ids=event_ids_from_json(r.pdu_event_ids),
            error=r.error,
        )
        for r in res
    ]


class TxnLogTable:
    """Implements :class:`federation_sender.storage.protocols.TxnLog` (both backends: on
    Synapse's database the table is ours, in schema ``federation_sender``)."""

    __slots__ = ("_c",)

    def __init__(self, conn: AsyncConnection) -> None:
        self._c = conn

    async def log_transactions(self, rows: Sequence[TxnLogRow]) -> None:
        await log_transactions(self._c, rows)

    async def recent_transactions(self, destination: str, limit: int = 100) -> list[TxnLogRow]:
        return await recent_transactions(self._c, destination, limit)
