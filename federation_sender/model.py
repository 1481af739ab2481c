"""The neutral row types that cross the storage boundary, declared once.

Every storage backend (``storage/backend.py`` over the project's own schema; a Synapse
backend over Synapse's tables) returns these and nothing else: the queue engine, the
admin API and the intake never see a table, a column or a connection. They are plain
values (frozen dataclasses or named tuples, for speed on the hot path) with no I/O.

Stream positions are keyed by a logical stream name (:data:`EVENTS_STREAM`,
:data:`FEDERATION_STREAM`) and an instance name; how a backend stores them is its own
business (the native backend prefixes the name in ``stream_positions``; Synapse keeps
them in ``federation_stream_position`` under exactly these two names).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

EVENTS_STREAM = "events"
"""The position of the events this instance has fanned out (persisted with
``destination_rooms`` in one transaction)."""
FEDERATION_STREAM = "federation"
"""The federation-stream token this instance has queued and acknowledged."""




@dataclass(frozen=True, slots=True)
class EventRow:
    """One persisted event. ``json`` is the PDU as the remote must receive it (text,
    parsed once by the caller and shared between destinations)."""

    stream_ordering: int
    event_id: str
    room_id: str
    type: str
    state_key: str | None
    sender: str
    outlier: bool
    """Out-of-band (never sent as a new PDU)."""
    rejected: bool
    json: str
    send_on_behalf_of: str | None = None
    """A join made through us by another server (Synapse's internal metadata): sent
    although its sender is remote, to everyone but that server."""


@dataclass(frozen=True, slots=True)
class MembershipRow:
    """One membership change of one user, at ``stream_ordering``."""

    stream_ordering: int
    user_id: str
    server_name: str
    membership: str


@dataclass(frozen=True, slots=True)
class DestinationRow:
    """A destination's persisted backoff and catch-up position (Synapse's columns)."""

    destination: str
    retry_last_ts: int | None
    retry_interval: int | None
    failure_ts: int | None
    last_successful_stream_ordering: int | None

    @classmethod
    def from_columns(cls, r: Sequence[object]) -> DestinationRow:
        """From ``destinations``' five columns in declaration order (either backend)."""

        def opt(v: object) -> int | None:
            return None if v is None else int(v)  # type: ignore[call-overload]

        return cls(str(r[0]), opt(r[1]), opt(r[2]), opt(r[3]), opt(r[4]))

    @property
    def backing_off(self) -> bool:
        """Synapse's test for "needs a reset": a retry is scheduled."""
        return bool(self.retry_last_ts)

    def to_json(self) -> dict[str, Any]:
        """Synapse's admin representation: retry fields default to 0, the others to
        null."""
        return {
            "destination": self.destination,
            "retry_last_ts": self.retry_last_ts or 0,
            "retry_interval": self.retry_interval or 0,
            "failure_ts": self.failure_ts,
            "last_successful_stream_ordering": self.last_successful_stream_ordering,
        }


class TxnLogRow(NamedTuple):
    """One transaction attempt, whatever its outcome (a tuple: one is built per
    transaction sent, on the hot path)."""

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

    def to_json(self) -> dict[str, Any]:
        """The admin API's representation (the destination is in the URL)."""
        return {
            "txn_id": self.txn_id,
            "instance_name": self.instance_name,
            "pdu_count": self.pdu_count,
            "edu_count": self.edu_count,
            "request_bytes": self.request_bytes,
            "status": self.status,
            "http_status": self.http_status,
            "started_ts": self.started_ts,
            "duration_ms": self.duration_ms,
            "catchup": self.catchup,
            "max_stream_ordering": self.max_stream_ordering,
            "pdu_event_ids": list(self.pdu_event_ids),
            "error": self.error,
        }


def event_ids_from_json(raw: str | None) -> tuple[str, ...]:
    """A stored JSON list of event ids; anything else reads as none (a log row is
    informational: a damaged one must not break a listing)."""
    if raw is None:
        return ()
    try:
        loaded = json.loads(raw)
    except ValueError:
        return ()
    return tuple(str(e) for e in loaded) if isinstance(loaded, list) else ()


@dataclass(frozen=True, slots=True)
class ToDeviceRow:
    """One ``m.direct_to_device`` EDU for a destination; ``messages_json`` is its
    content."""

    stream_id: int
    messages_json: str


DEVICE_LIST_UPDATE = "m.device_list_update"


@dataclass(frozen=True, slots=True)
class DeviceListRow:
    """One device-list EDU for a destination, acknowledged by ``(stream_id, user_id,
    device_id)``. For an ``m.device_list_update`` the queue adds ``user_id``,
    ``device_id`` and ``stream_id`` to ``content_json`` where missing; other types
    (Synapse's ``m.signing_key_update`` and its ``org.matrix.`` twin, whose "device" is
    a cross-signing key) go as stored."""

    stream_id: int
    user_id: str
    device_id: str
    content_json: str
    edu_type: str = DEVICE_LIST_UPDATE


class DestinationOrder(StrEnum):
    """``order_by`` values of Synapse's destinations list."""

    DESTINATION = "destination"
    RETRY_LAST_TS = "retry_last_ts"
    RETRY_INTERVAL = "retry_interval"
    FAILURE_TS = "failure_ts"
    LAST_SUCCESSFUL_STREAM_ORDERING = "last_successful_stream_ordering"


class Direction(StrEnum):
    FORWARDS = "f"
    BACKWARDS = "b"
