"""Building signed PDUs (room versions 3-10 event format) for interop tests.

The sender never creates events -- the main process persists them already signed --
so this lives with the tests: content hash, redaction for signing, and the
reference-hash event id, per the server-server specification.
"""

from __future__ import annotations

import hashlib
from typing import Any

from canonicaljson import encode_canonical_json
from unpaddedbase64 import encode_base64

from federation_sender.transport.signing import SigningKey

_KEPT_TOP_LEVEL = {
    "event_id", "type", "room_id", "sender", "state_key", "content", "hashes",
    "signatures", "depth", "prev_events", "auth_events", "origin_server_ts",
}  # fmt: skip


def _redact_message(event: dict[str, Any]) -> dict[str, Any]:
    """Redaction algorithm for a non-state message event: content is emptied."""
    redacted = {k: v for k, v in event.items() if k in _KEPT_TOP_LEVEL}
    redacted["content"] = {}
    return redacted


def make_message_pdu(
    key: SigningKey,
    origin: str,
    *,
    room_id: str,
    sender: str,
    body: str,
    ts_ms: int,
    sign_with: SigningKey | None = None,
) -> tuple[str, dict[str, Any]]:
    """``(event_id, pdu)``; ``sign_with`` forges the signature with another key."""
    event: dict[str, Any] = {
        "type": "m.room.message",
        "room_id": room_id,
        "sender": sender,
        "content": {"msgtype": "m.text", "body": body},
        "depth": 5,
        "prev_events": [],
        "auth_events": [],
        "origin_server_ts": ts_ms,
    }
    content_hash = hashlib.sha256(encode_canonical_json(event)).digest()
    event["hashes"] = {"sha256": encode_base64(content_hash)}
    redacted = _redact_message(event)
    signer = sign_with or key
    signed = signer.sign_json(redacted, origin)
    event["signatures"] = {origin: {key.key_id: signed["signatures"][origin][signer.key_id]}}
    reference = hashlib.sha256(encode_canonical_json(redacted)).digest()
    return "$" + encode_base64(reference, urlsafe=True), event
