"""The log of transaction attempts (``federation_transaction_log``).

Every attempt is one row, whatever its outcome. ``pdu_event_ids`` (a JSON list),
``max_stream_ordering`` and ``catchup`` are always filled: an offline audit job joins
them against ``events`` to prove delivery.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import TextClause, insert, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.storage.schema import federation_transaction_log as tl


@dataclass(frozen=True, slots=True)
class TxnLogRow:
    txn_id: str
    destination: str
    instance_name: str
    pdu_count: int
    edu_count: int
    request_bytes: int
    status: str
    http_status: int | None
    started_ts: int
    duration_ms: int
    catchup: bool
    max_stream_ordering: int | None
    pdu_event_ids: tuple[str, ...]
    error: str | None


_PG_TYPES = {
    "txn_id": "text",
    "destination": "text",
    "instance_name": "text",
    "pdu_count": "integer",
    "edu_count": "integer",
    "request_bytes": "integer",
    "status": "text",
    "http_status": "integer",
    "started_ts": "bigint",
    "duration_ms": "integer",
    "catchup": "boolean",
    "max_stream_ordering": "bigint",
    "pdu_event_ids": "json",  # stored as text, see _pg_insert
    "error": "text",
}


def _pg_insert() -> TextClause:
    # One statement, one JSON parameter, expanded server-side (text arrays would be
    # escaped element by element on the client). ``pdu_event_ids`` travels as a JSON
    # array inside that parameter and is stored as the text PostgreSQL received (a
    # ``json`` value keeps its input text): the same text as ``json.dumps(list(ids))``,
    # without encoding each list and then escaping it again as a string.
    cols = list(_PG_TYPES)
    return text(
        f"INSERT INTO federation_transaction_log ({', '.join(cols)})"
        f" SELECT {', '.join(c + '::text' if _PG_TYPES[c] == 'json' else c for c in cols)}"
        f" FROM json_to_recordset(CAST(:rows AS json))"
        f" AS x({', '.join(f'{c} {_PG_TYPES[c]}' for c in cols)})"
    )


_PG_INSERT = _pg_insert()


async def log_transactions(conn: AsyncConnection, rows: Sequence[TxnLogRow]) -> None:
    if not rows:
        return
    pg = conn.dialect.name == "postgresql"
    values = [
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
            # A tuple encodes as a JSON list.
            "pdu_event_ids": r.pdu_event_ids if pg else json.dumps(r.pdu_event_ids),
            "error": r.error,
        }
        for r in rows
    ]
    if pg:
        await conn.execute(_PG_INSERT, {"rows": json.dumps(values)})
        return
    await conn.execute(insert(tl), values)


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
            pdu_event_ids=tuple(json.loads(r.pdu_event_ids)),
            error=r.error,
        )
        for r in res
    ]
