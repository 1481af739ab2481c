"""Synapse's client-server API for scripting traffic in tests (blocking, stdlib only).

Users are registered with the shared secret (``/_synapse/admin/v1/register``), so no
registration flow is needed. Every call raises :class:`ClientApiError` on an HTTP
error, with the status and Matrix errcode in one line.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

REQUEST_TIMEOUT_S = 30.0


class ClientApiError(RuntimeError):
    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status} {body[:300]}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class User:
    user_id: str
    access_token: str
    device_id: str


_txn_ids = itertools.count()


class SynapseClient:
    def __init__(self, base_url: str, shared_secret: str) -> None:
        self.base_url = base_url
        self._shared_secret = shared_secret

    def call(
        self, method: str, path: str, body: Any = None, token: str | None = None
    ) -> dict[str, Any]:
        """One request; returns the JSON body."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                result: dict[str, Any] = json.loads(response.read())
                return result
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            raise ClientApiError(method, path, e.code, text) from None

    def register(
        self, localpart: str, password: str = "test password", admin: bool = False
    ) -> User:
        """Shared-secret registration (the admin API)."""
        nonce = self.call("GET", "/_synapse/admin/v1/register")["nonce"]
        mac = hmac.new(self._shared_secret.encode(), digestmod=hashlib.sha1)
        role = "admin" if admin else "notadmin"
        mac.update(f"{nonce}\x00{localpart}\x00{password}\x00{role}".encode())
        r = self.call(
            "POST",
            "/_synapse/admin/v1/register",
            {
                "nonce": nonce,
                "username": localpart,
                "password": password,
                "admin": admin,
                "mac": mac.hexdigest(),
            },
        )
        return User(r["user_id"], r["access_token"], r["device_id"])

    def exempt_from_ratelimits(self, admin: User, user: User) -> None:
        """Lift every rate limit off ``user`` (the admin API's per-user override).

        For test scenes that create rooms until a condition holds: Synapse's default
        ``rc_room_creation`` allows a burst of 10, and a loop that depends on how room
        IDs hash would otherwise fail by chance.
        """
        path = (
            "/_synapse/admin/v1/users/"
            + urllib.parse.quote(user.user_id, safe="")
            + "/override_ratelimit"
        )
        self.call("POST", path, {"messages_per_second": 0, "burst_count": 0}, admin.access_token)

    def create_room(
        self, user: User, *, room_version: str | None = None, preset: str = "public_chat"
    ) -> str:
        body: dict[str, Any] = {"preset": preset}
        if room_version:
            body["room_version"] = room_version
        room_id: str = self.call("POST", "/_matrix/client/v3/createRoom", body, user.access_token)[
            "room_id"
        ]
        return room_id

    def join(self, user: User, room_id_or_alias: str, via: list[str] | None = None) -> str:
        path = "/_matrix/client/v3/join/" + urllib.parse.quote(room_id_or_alias, safe="")
        if via:
            path += "?" + urllib.parse.urlencode([("server_name", s) for s in via])
        room_id: str = self.call("POST", path, {}, user.access_token)["room_id"]
        return room_id

    def send_message(self, user: User, room_id: str, body: str) -> str:
        """Send an ``m.text`` message; returns its event id."""
        txn = f"t{next(_txn_ids)}-{hashlib.sha1(body.encode()).hexdigest()[:8]}"
        path = (
            f"/_matrix/client/v3/rooms/{urllib.parse.quote(room_id, safe='')}"
            f"/send/m.room.message/{txn}"
        )
        event_id: str = self.call(
            "PUT", path, {"msgtype": "m.text", "body": body}, user.access_token
        )["event_id"]
        return event_id

    def send_state(
        self,
        user: User,
        room_id: str,
        event_type: str,
        content: dict[str, Any],
        state_key: str = "",
    ) -> str:
        """Set a state event; returns its event id."""
        path = (
            f"/_matrix/client/v3/rooms/{urllib.parse.quote(room_id, safe='')}/state/"
            f"{urllib.parse.quote(event_type, safe='')}/{urllib.parse.quote(state_key, safe='')}"
        )
        event_id: str = self.call("PUT", path, content, user.access_token)["event_id"]
        return event_id

    def leave(self, user: User, room_id: str) -> None:
        """Leave the room, or reject an invite to it."""
        path = f"/_matrix/client/v3/rooms/{urllib.parse.quote(room_id, safe='')}/leave"
        self.call("POST", path, {}, user.access_token)

    def kick(self, user: User, room_id: str, target: str, reason: str = "") -> None:
        path = f"/_matrix/client/v3/rooms/{urllib.parse.quote(room_id, safe='')}/kick"
        self.call("POST", path, {"user_id": target, "reason": reason}, user.access_token)

    def joined_members(self, user: User, room_id: str) -> list[str]:
        path = f"/_matrix/client/v3/rooms/{urllib.parse.quote(room_id, safe='')}/joined_members"
        return sorted(self.call("GET", path, None, user.access_token)["joined"])

    def sync(self, user: User, since: str | None = None, timeout_ms: int = 0) -> dict[str, Any]:
        query = {"timeout": str(timeout_ms)}
        if since:
            query["since"] = since
        return self.call(
            "GET",
            "/_matrix/client/v3/sync?" + urllib.parse.urlencode(query),
            None,
            user.access_token,
        )
