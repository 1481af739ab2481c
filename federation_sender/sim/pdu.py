"""Building PDUs the way a homeserver stores them, and naming them by reference hash.

Event ids are room-version-4+ style: ``$`` + unpadded URL-safe base64 of the SHA-256
of the canonical JSON of the *redacted* event without ``signatures`` and ``unsigned``.
The simulator computes the id when it builds an event; the fake remotes recompute it
from what they receive. So a PDU that the worker alters in any field that survives
redaction arrives under a different id, and the delivery check reports it as missing:
the id is a checksum of the parts that matter. ``unsigned`` (where a sender puts
``age``) does not count, as in Matrix.

Content hashes are real (SHA-256 over the event without ``unsigned``, ``signatures`` and
``hashes``); signatures are placeholders, since nothing in the worker verifies PDUs.
"""

from __future__ import annotations

import hashlib
from base64 import b64encode, urlsafe_b64encode
from collections.abc import Mapping
from typing import Any

from canonicaljson import encode_canonical_json

ROOM_VERSION = "10"

# Redaction rules of room versions 6-10.
_KEPT_TOP_LEVEL = frozenset(
    {
        "event_id",
        "type",
        "room_id",
        "sender",
        "state_key",
        "content",
        "hashes",
        "signatures",
        "depth",
        "prev_events",
        "auth_events",
        "origin",
        "origin_server_ts",
        "membership",
        "prev_state",
    }
)
_KEPT_CONTENT: Mapping[str, frozenset[str]] = {
    "m.room.member": frozenset({"membership", "join_authorised_via_users_server"}),
    "m.room.create": frozenset({"creator"}),
    "m.room.join_rules": frozenset({"join_rule", "allow"}),
    "m.room.power_levels": frozenset(
        {
            "ban",
            "events",
            "events_default",
            "kick",
            "redact",
            "state_default",
            "users",
            "users_default",
        }
    ),
    "m.room.history_visibility": frozenset({"history_visibility"}),
}


def redact(pdu: Mapping[str, Any]) -> dict[str, Any]:
    """The redacted form of ``pdu`` (room versions 6-10)."""
    out = {k: v for k, v in pdu.items() if k in _KEPT_TOP_LEVEL}
    kept = _KEPT_CONTENT.get(str(pdu.get("type")), frozenset())
    content = pdu.get("content")
    out["content"] = (
        {k: v for k, v in content.items() if k in kept} if isinstance(content, Mapping) else {}
    )
    return out


def content_hash(pdu: Mapping[str, Any]) -> str:
    body = {k: v for k, v in pdu.items() if k not in ("unsigned", "signatures", "hashes")}
    return b64encode(hashlib.sha256(encode_canonical_json(body)).digest()).decode().rstrip("=")


def reference_event_id(pdu: Mapping[str, Any]) -> str:
    """The event id of ``pdu`` (room version 4+): the hash of its redacted form."""
    body = redact(pdu)
    body.pop("signatures", None)
    body.pop("unsigned", None)
    body.pop("event_id", None)
    digest = hashlib.sha256(encode_canonical_json(body)).digest()
    return "$" + urlsafe_b64encode(digest).decode().rstrip("=")


def build_pdu(
    *,
    room_id: str,
    sender: str,
    origin: str,
    event_type: str,
    content: dict[str, Any],
    state_key: str | None,
    prev_events: list[str],
    auth_events: list[str],
    depth: int,
    origin_server_ts: int,
) -> tuple[str, dict[str, Any]]:
    """Return ``(event_id, pdu)`` for a new event, hashed and (placeholder-)signed."""
    pdu: dict[str, Any] = {
        "auth_events": auth_events,
        "content": content,
        "depth": depth,
        "origin": origin,
        "origin_server_ts": origin_server_ts,
        "prev_events": prev_events,
        "room_id": room_id,
        "sender": sender,
        "type": event_type,
    }
    if state_key is not None:
        pdu["state_key"] = state_key
    pdu["hashes"] = {"sha256": content_hash(pdu)}
    # Not a real signature: no part of the sender verifies PDU signatures.
    pdu["signatures"] = {origin: {"ed25519:sim": "c2lt" + pdu["hashes"]["sha256"][:40]}}
    return reference_event_id(pdu), pdu
