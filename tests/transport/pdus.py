"""Signed message PDUs (room version 10) for the interop tests.

The sender never creates events (the main process persists them already signed), so
this lives with the tests; hashing, redaction and signing are
:mod:`federation_sender.testing.signed_events`.
"""

from __future__ import annotations

from typing import Any

from federation_sender.testing.signed_events import hash_and_sign
from federation_sender.transport.signing import SigningKey


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
    """``(event_id, pdu)``; ``sign_with`` forges the signature with another key of the
    same key id."""
    signer = sign_with or key
    if signer.key_id != key.key_id:
        raise ValueError("a forged signature must claim the same key id")
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
    return hash_and_sign(event, signer, origin, "10")
