"""The replication gap fetchers only Synapse's schema has tables for.

``receipts`` from ``receipts_linearized`` and ``presence`` from ``presence_stream``
(Synapse keeps the latest row per user, which is what Synapse's own fetch returns too);
``federation`` needs none, Synapse never writes that stream. The shared
machinery and the outbox fetchers are in :mod:`federation_sender.storage.stream_fetchers`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.replication.client import GapNote
from federation_sender.replication.positions import StreamFetcher
from federation_sender.replication.rows import PresenceRow, PresenceState, ReceiptsRow, Row
from federation_sender.storage.stream_fetchers import SqlStreamFetcher, common_fetchers

_PRESENCE = (
    "SELECT stream_id, user_id, state, last_active_ts, last_federation_update_ts,"
    " last_user_sync_ts, status_msg, currently_active FROM presence_stream"
    " WHERE :from_id < stream_id AND stream_id <= :upto {extra} ORDER BY stream_id"
)
_RECEIPTS = (
    "SELECT stream_id, room_id, receipt_type, user_id, event_id, thread_id, data"
    " FROM receipts_linearized"
    " WHERE :from_id < stream_id AND stream_id <= :upto {extra} ORDER BY stream_id"
)


def _presence(r: Sequence[Any]) -> Row:
    return PresenceRow(PresenceState(
        str(r[1]), str(r[2]), int(r[3] or 0), int(r[4] or 0), int(r[5] or 0),
        None if r[6] is None else str(r[6]), bool(r[7]),
    ))


def _receipt(r: Sequence[Any]) -> Row:
    data = json.loads(r[6]) if r[6] else {}
    return ReceiptsRow(
        str(r[1]), str(r[2]), str(r[3]), str(r[4]),
        None if r[5] is None else str(r[5]),
        data if isinstance(data, dict) else {},
    )


def synapse_fetchers(engine: AsyncEngine) -> dict[str, StreamFetcher]:
    return {
        **common_fetchers(engine),
        "receipts": SqlStreamFetcher(engine, _RECEIPTS, _receipt),
        "presence": SqlStreamFetcher(engine, _PRESENCE, _presence),
    }


def synapse_gap_notes() -> dict[str, GapNote | None]:
    """What a gap skips beside Synapse where the stream table's note does not say it
    (:mod:`federation_sender.intake.streams`)."""
    return {"federation": None}  # Synapse never writes it
