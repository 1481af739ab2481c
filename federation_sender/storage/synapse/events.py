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
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func

from federation_sender.model import EventRow
from federation_sender.storage.events import EventQueries, EventSource
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


QUERIES = EventQueries(EventSource(
    events=events,
    extremities=event_forward_extremities,
    partial_state=partial_state_rooms,
    cols=_COLS,
    from_=_FROM,
    to_row=to_event_row,
    received_ts=func.coalesce(events.c.received_ts, events.c.origin_server_ts),
))

max_stream_ordering = QUERIES.max_stream_ordering
stream_orderings_after = QUERIES.stream_orderings_after
events_after = QUERIES.events_after
events_at = QUERIES.events_at
room_events_between = QUERIES.room_events_between
forward_extremities = QUERIES.forward_extremities
partial_state = QUERIES.partial_state
sender_and_received_ts = QUERIES.sender_and_received_ts
