"""The log of transaction attempts (``federation_transaction_log``).

Every attempt is one row, whatever its outcome. ``pdu_event_ids`` (a JSON list),
``max_stream_ordering`` and ``catchup`` are always filled: an offline audit job joins
them against ``events`` to prove delivery.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import orjson
from sqlalchemy import insert, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.model import TxnLogRow, event_ids_from_json
from federation_sender.storage.schema import federation_transaction_log as tl

_COLUMNS = (
    "txn_id", "destination", "instance_name", "pdu_count", "edu_count", "request_bytes",
    "status", "http_status", "started_ts", "duration_ms", "catchup", "max_stream_ordering",
    "error", "pdu_event_ids",
)
_PG_CASTS = (
    "", "", "", "::integer", "::integer", "::integer", "", "::integer", "::bigint",
    "::integer", "::boolean", "::bigint", "",
)
# One statement, one JSON parameter (an array of rows, each an array in ``_COLUMNS``
# order) expanded server-side: text arrays would be escaped element by element on the
# client, and objects would repeat every key in every row. ``jsonb`` because each row is
# then parsed once: ``->>`` on a ``json`` value parses the whole row again per column,
# which made this statement 4 times slower (150 against 37 ms per 1,000 rows of 40 event
# ids, on PostgreSQL 15). ``pdu_event_ids`` is stored as jsonb's text of the array.
_PG_INSERT = text(
    f"INSERT INTO federation_transaction_log ({', '.join(_COLUMNS)})"
    f" SELECT {', '.join(f'(r->>{i}){c}' for i, c in enumerate(_PG_CASTS))},"
    f" (r->{len(_PG_CASTS)})::text"
    f" FROM jsonb_array_elements(CAST(:rows AS jsonb)) AS x(r)"
)
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def event_ids_json(ids: Sequence[str]) -> str:
    return _COMPACT.encode(list(ids))


async def log_transactions(conn: AsyncConnection, rows: Sequence[TxnLogRow]) -> None:
    if not rows:
        return
    if conn.dialect.name == "postgresql":
        # A row is a tuple in column order but for the ids, which go last: one call of
        # the C encoder for the whole batch.
        batch = [(*r[:12], r.error, r.pdu_event_ids) for r in rows]
        try:
            # orjson: about 4 times faster than the C encoder of json; jsonb stores the
            # values, not this text, so its escaping (UTF-8 kept as is) changes nothing.
            param = orjson.dumps(batch).decode()
        except TypeError:  # a string orjson refuses (a lone surrogate): json escapes it
            param = _COMPACT.encode(batch)
        await conn.execute(_PG_INSERT, {"rows": param})
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
