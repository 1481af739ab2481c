"""The log of transaction attempts (``federation_transaction_log``).

Every attempt is one row, whatever its outcome. ``pdu_event_ids`` (a JSON list),
``max_stream_ordering`` and ``catchup`` are always filled: an offline audit job joins
them against ``events`` to prove delivery.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import insert, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.storage.schema import federation_transaction_log as tl


class TxnLogRow(NamedTuple):
    """One attempt (a tuple: one is built per transaction sent, on the hot path)."""

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


_COLUMNS = (
    "txn_id", "destination", "instance_name", "pdu_count", "edu_count", "request_bytes",
    "status", "http_status", "started_ts", "duration_ms", "catchup", "max_stream_ordering",
    "error", "pdu_event_ids",
)
_PG_CASTS = (
    "", "", "", "::integer", "::integer", "::integer", "", "::integer", "::bigint",
    "::integer", "::boolean", "::bigint", "",
)
# One statement, one JSON parameter (a JSON array of rows, each a JSON array) expanded
# server-side: text arrays would be escaped element by element on the client. The last
# element of a row is its ``pdu_event_ids`` array, stored as the text PostgreSQL received
# (a ``json`` value keeps its input text), so the ids are encoded once, not encoded and
# then escaped again as a string.
_PG_INSERT = text(
    f"INSERT INTO federation_transaction_log ({', '.join(_COLUMNS)})"
    f" SELECT {', '.join(f'(r->>{i}){c}' for i, c in enumerate(_PG_CASTS))},"
    f" (r->{len(_PG_CASTS)})::text"
    f" FROM json_array_elements(CAST(:rows AS json)) AS x(r)"
)
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def event_ids_json(ids: Sequence[str]) -> str:
    """``ids`` as a JSON array. Event ids are printable ASCII without quotes or
    backslashes in every room version, which needs no escaping: joined as they are
    (much cheaper than encoding, for the thousands of ids a second of a busy fan-out);
    anything else goes through the JSON encoder."""
    if not ids:
        return "[]"
    flat = "".join(ids)
    if flat.isascii() and flat.isprintable() and '"' not in flat and "\\" not in flat:
        return '["' + '","'.join(ids) + '"]'
    return _COMPACT.encode(list(ids))


def _pg_row(r: TxnLogRow) -> str:
    head = _COMPACT.encode([
        r.txn_id, r.destination, r.instance_name, r.pdu_count, r.edu_count,
        r.request_bytes, r.status, r.http_status, r.started_ts, r.duration_ms, r.catchup,
        r.max_stream_ordering, r.error,
    ])
    return f"{head[:-1]},{event_ids_json(r.pdu_event_ids)}]"


async def log_transactions(conn: AsyncConnection, rows: Sequence[TxnLogRow]) -> None:
    if not rows:
        return
    if conn.dialect.name == "postgresql":
        await conn.execute(_PG_INSERT, {"rows": "[" + ",".join(map(_pg_row, rows)) + "]"})
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
            pdu_event_ids=tuple(json.loads(r.pdu_event_ids)),
            error=r.error,
        )
        for r in res
    ]
