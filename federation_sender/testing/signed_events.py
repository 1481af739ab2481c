"""Event ids, content hashes and signatures of PDUs in room versions 4 to 12.

A fake remote homeserver needs two things from the specification: the id of each PDU
it receives (v4+ PDUs carry no ``event_id``; it is the reference hash of the *redacted*
event) and a hashed, signed join event of its own. Redaction keeps different keys per
room version: versions up to 10 keep ``origin``, ``membership`` and ``prev_state`` at the
top level, 11 and 12 drop them and keep more content (the whole ``m.room.create``
content, ``invite`` in power levels, ``redacts``, the signed part of a third-party
invite). An unknown room version raises ``ValueError``; versions 1-3 (event ids chosen
by the sender) are not supported.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from canonicaljson import encode_canonical_json
from unpaddedbase64 import encode_base64

from federation_sender.transport.signing import SigningKey

SUPPORTED_ROOM_VERSIONS = ("4", "5", "6", "7", "8", "9", "10", "11", "12")
_NEW_REDACTION = frozenset({"11", "12"})

_TOP_LEVEL = frozenset(
    {
        "event_id", "type", "room_id", "sender", "state_key", "content", "hashes",
        "signatures", "depth", "prev_events", "auth_events", "origin_server_ts",
    }
)  # fmt: skip
_TOP_LEVEL_OLD = _TOP_LEVEL | {"origin", "membership", "prev_state"}
_POWER_LEVELS = frozenset(
    {"ban", "events", "events_default", "kick", "redact", "state_default", "users",
     "users_default"}
)  # fmt: skip
_CONTENT_OLD: Mapping[str, frozenset[str]] = {
    "m.room.member": frozenset({"membership", "join_authorised_via_users_server"}),
    "m.room.create": frozenset({"creator"}),
    "m.room.join_rules": frozenset({"join_rule", "allow"}),
    "m.room.power_levels": _POWER_LEVELS,
    "m.room.history_visibility": frozenset({"history_visibility"}),
}
_CONTENT_NEW: Mapping[str, frozenset[str]] = {
    **_CONTENT_OLD,
    "m.room.power_levels": _POWER_LEVELS | {"invite"},
    "m.room.redaction": frozenset({"redacts"}),
}


def _check(room_version: str) -> None:
    if room_version not in SUPPORTED_ROOM_VERSIONS:
        raise ValueError(f"unsupported room version {room_version!r}")


def redact(event: Mapping[str, Any], room_version: str) -> dict[str, Any]:
    """The redacted form of ``event`` under ``room_version``'s rules."""
    _check(room_version)
    new = room_version in _NEW_REDACTION
    out = {k: v for k, v in event.items() if k in (_TOP_LEVEL if new else _TOP_LEVEL_OLD)}
    event_type = str(event.get("type"))
    content = event.get("content")
    content = content if isinstance(content, Mapping) else {}
    if new and event_type == "m.room.create":
        out["content"] = dict(content)
        return out
    kept = (_CONTENT_NEW if new else _CONTENT_OLD).get(event_type, frozenset())
    redacted = {k: v for k, v in content.items() if k in kept}
    invite = content.get("third_party_invite")
    member = new and event_type == "m.room.member"
    if member and isinstance(invite, Mapping) and "signed" in invite:
        redacted["third_party_invite"] = {"signed": invite["signed"]}
    out["content"] = redacted
    return out


def content_hash(event: Mapping[str, Any]) -> str:
    body = {k: v for k, v in event.items() if k not in ("unsigned", "signatures", "hashes")}
    return encode_base64(hashlib.sha256(encode_canonical_json(body)).digest())


def event_id(event: Mapping[str, Any], room_version: str) -> str:
    """The reference-hash event id (``$`` + unpadded URL-safe base64)."""
    body = redact(event, room_version)
    for key in ("signatures", "unsigned", "event_id"):
        body.pop(key, None)
    return "$" + encode_base64(hashlib.sha256(encode_canonical_json(body)).digest(), urlsafe=True)


def hash_and_sign(
    event: Mapping[str, Any], key: SigningKey, origin: str, room_version: str
) -> tuple[str, dict[str, Any]]:
    """``(event_id, event)`` with content hash and ``origin``'s signature added."""
    out = {k: v for k, v in event.items() if k not in ("signatures", "unsigned", "event_id")}
    out["hashes"] = {"sha256": content_hash(out)}
    signed = key.sign_json(redact(out, room_version), origin)
    out["signatures"] = {origin: signed["signatures"][origin]}
    return event_id(out, room_version), out
