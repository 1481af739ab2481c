"""The log of transaction attempts (``federation_transaction_log``).

Every attempt is one row, whatever its outcome. ``pdu_event_ids`` (a JSON list),
``max_stream_ordering`` and ``catchup`` are always filled: an offline audit job joins
them against ``events`` to prove delivery.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import insert, select
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


async def log_transactions(conn: AsyncConnection, rows: Sequence[TxnLogRow]) -> None:
    if not rows:
        return
    await conn.execute(
        insert(tl),
        [
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
                "pdu_event_ids": json.dumps(list(r.pdu_event_ids)),
                "error": r.error,
            }
            for r in rows
        ],
    )


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
