"""Events as Synapse's federation sender sees them: ``events`` joined with ``event_json``.

Which events are sent (Synapse's ``_process_event_queue_loop``): those whose sender is
local, or whose ``internal_metadata.send_on_behalf_of`` names the server a join was
made through (a relayed join). Never sent: out-of-band memberships, events flagged
``proactively_send: false``, rejected events, and PDUs whose depth canonical JSON cannot
carry. The row's ``outlier`` and ``rejected`` flags carry these rules to the queue, so
callers need not know Synapse's internal metadata.

The PDU JSON is what Synapse's sender puts on the wire (measured against Synapse
1.163's ``Event.get_pdu_json()``): the stored event as is, except that ``unsigned`` keeps
only the keys Synapse's event class carries (``age_ts``, ``replaces_state``,
``invite_room_state``, ``knock_room_state``, ``prev_content``, ``prev_sender``) and is
always present. Synapse sends ``unsigned.age_ts`` untouched rather than an ``age``: its
transaction code converts a top-level ``age_ts`` that no longer exists (its own FIXME,
synapse#8429), and we send the same bytes a receiver would get from Synapse.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Sequence
from typing import Any

from sqlalchemy import Select, bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.model import EventRow
from federation_sender.storage.synapse.schema import (
    event_forward_extremities,
    event_json,
    events,
    partial_state_rooms,
)

log = logging.getLogger(__name__)

WIRE_UNSIGNED_KEYS = frozenset(
    {
        "age_ts",
        "replaces_state",
        "invite_room_state",
        "knock_room_state",
        "prev_content",
        "prev_sender",
    }
)
CANONICALJSON_MAX_INT = 2**53 - 1
CANONICALJSON_MIN_INT = -CANONICALJSON_MAX_INT

_COLS = (
    events.c.stream_ordering,
    events.c.event_id,
    events.c.room_id,
    events.c.type,
    events.c.state_key,
    events.c.sender,
    events.c.outlier,
    events.c.rejection_reason,
    event_json.c.internal_metadata,
    event_json.c.json,
)
_FROM = events.outerjoin(event_json, event_json.c.event_id == events.c.event_id)


def _load_object(text: object) -> dict[str, Any] | None:
    if not isinstance(text, str):
        return None
    try:
        v = json.loads(text)
    except ValueError:
        return None
    return v if isinstance(v, dict) else None


def wire_pdu(stored: dict[str, Any]) -> dict[str, Any]:
    """The PDU Synapse's sender sends for a stored event (see the module docstring)."""
    pdu = dict(stored)
    unsigned = pdu.get("unsigned")
    kept = (
        {k: v for k, v in unsigned.items() if k in WIRE_UNSIGNED_KEYS}
        if isinstance(unsigned, dict)
        else {}
    )
    pdu["unsigned"] = kept
    return pdu


def _valid_depth(pdu: dict[str, Any]) -> bool:
    depth = pdu.get("depth")
    return (
        isinstance(depth, int)
        and not isinstance(depth, bool)
        and CANONICALJSON_MIN_INT <= depth <= CANONICALJSON_MAX_INT
    )


def to_event_row(r: Sequence[Any]) -> EventRow:
    """One row of ``_COLS`` as a neutral event row with Synapse's rules applied."""
    stream_ordering, event_id, room_id, type_, state_key, sender = r[:6]
    outlier, rejection_reason, internal_text, json_text = r[6:10]
    meta = _load_object(internal_text) or {}
    stored = _load_object(json_text)
    on_behalf = meta.get("send_on_behalf_of")
    not_proactive = (
        bool(meta.get("out_of_band_membership")) or meta.get("proactively_send", True) is False
    )
    if stored is None:
        if json_text is not None:
            log.warning("event %s has unparseable JSON; it is not sent", event_id)
        return EventRow(
            int(stream_ordering), str(event_id), str(room_id), str(type_), state_key,
            str(sender), True, True, "{}",
        )
    return EventRow(
        stream_ordering=int(stream_ordering),
        event_id=str(event_id),
        room_id=str(room_id),
        type=str(type_),
        state_key=None if state_key is None else str(state_key),
        sender=str(sender),
        outlier=bool(outlier) or not_proactive,
        rejected=rejection_reason is not None or not _valid_depth(stored),
        json=json.dumps(wire_pdu(stored), ensure_ascii=False, separators=(",", ":")),
        send_on_behalf_of=on_behalf if isinstance(on_behalf, str) and on_behalf else None,
    )


async def max_stream_ordering(conn: AsyncConnection) -> int:
    v = (await conn.execute(select(func.max(events.c.stream_ordering)))).scalar()
    return int(v) if v is not None else 0


async def stream_orderings_after(conn: AsyncConnection, after: int, limit: int) -> list[int]:
    """Stream orderings of committed events above ``after``, lowest first."""
    so = events.c.stream_ordering
    res = await conn.execute(select(so).where(so > after).order_by(so).limit(limit))
    return [int(v) for v in res.scalars()]


async def events_after(
    conn: AsyncConnection, after: int, upto: int, limit: int
) -> list[EventRow]:
    """Synapse's ``get_all_new_event_ids_stream``: ``after < so <= upto``, oldest first."""
    res = await conn.execute(
        select(*_COLS)
        .select_from(_FROM)
        .where(events.c.stream_ordering > after, events.c.stream_ordering <= upto)
        .order_by(events.c.stream_ordering)
        .limit(limit)
    )
    return [to_event_row(r) for r in res]


_EVENTS_AT = (
    select(*_COLS)
    .select_from(_FROM)
    .where(events.c.stream_ordering.in_(bindparam("sos", expanding=True)))
)


async def events_at(
    conn: AsyncConnection, stream_orderings: Collection[int]
) -> dict[int, EventRow]:
    if not stream_orderings:
        return {}
    res = await conn.execute(_EVENTS_AT, {"sos": list(stream_orderings)})
    return {e.stream_ordering: e for e in map(to_event_row, res)}


def _build_room_events_between() -> Select[Any]:
    rn = (
        func.row_number()
        .over(partition_by=events.c.room_id, order_by=events.c.stream_ordering)
        .label("rn")
    )
    inner = (
        select(*_COLS, rn)
        .select_from(_FROM)
        .where(
            events.c.room_id.in_(bindparam("rooms", expanding=True)),
            events.c.stream_ordering > bindparam("after"),
            events.c.stream_ordering <= bindparam("upto"),
        )
        .subquery()
    )
    return (
        select(*[inner.c[c.name] for c in _COLS])
        .where(inner.c.rn <= bindparam("per_room"))
        .order_by(inner.c.room_id, inner.c.stream_ordering)
    )


_ROOM_EVENTS_BETWEEN = _build_room_events_between()


async def room_events_between(
    conn: AsyncConnection, room_ids: Collection[str], after: int, upto: int, per_room_limit: int
) -> dict[str, list[EventRow]]:
    if not room_ids:
        return {}
    res = await conn.execute(
        _ROOM_EVENTS_BETWEEN,
        {"rooms": list(room_ids), "after": after, "upto": upto, "per_room": per_room_limit},
    )
    out: dict[str, list[EventRow]] = {}
    for r in res:
        e = to_event_row(r)
        out.setdefault(e.room_id, []).append(e)
    return out


async def forward_extremities(
    conn: AsyncConnection, room_ids: Collection[str]
) -> dict[str, list[EventRow]]:
    if not room_ids:
        return {}
    res = await conn.execute(
        select(*_COLS)
        .select_from(
            _FROM.join(
                event_forward_extremities,
                event_forward_extremities.c.event_id == events.c.event_id,
            )
        )
        .where(event_forward_extremities.c.room_id.in_(list(room_ids)))
        .order_by(events.c.stream_ordering)
    )
    out: dict[str, list[EventRow]] = {}
    for r in res:
        e = to_event_row(r)
        out.setdefault(e.room_id, []).append(e)
    return out


async def partial_state(conn: AsyncConnection, room_ids: Collection[str]) -> set[str]:
    if not room_ids:
        return set()
    res = await conn.execute(
        select(partial_state_rooms.c.room_id).where(
            partial_state_rooms.c.room_id.in_(list(room_ids))
        )
    )
    return {str(r[0]) for r in res}


async def sender_and_received_ts(
    conn: AsyncConnection, room_id: str, event_id: str
) -> tuple[str, int] | None:
    row = (
        await conn.execute(
            select(
                events.c.sender,
                func.coalesce(events.c.received_ts, events.c.origin_server_ts),
            ).where(events.c.event_id == event_id, events.c.room_id == room_id)
        )
    ).first()
    if row is None or row[1] is None:
        return None
    return str(row[0]), int(row[1])
