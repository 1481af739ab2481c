"""Rooms hosted by a fake remote server, for Synapse's users to join over federation.

A :class:`HostedRoom` is a room version 10 room created by one peer (create event, the
creator's join, power levels, public join rules, shared history), every event hashed
and signed by the peer as a real server would. It answers ``make_join`` with a
template on the room's latest event, and ``send_join`` with the room's state and auth
chain. With ``omit_members`` (Synapse joins that way by default: "faster joins",
MSC3706) the answer leaves the membership events out of the state, says
``members_omitted`` and names ``servers_in_room``: Synapse then holds the room with
partial state, and sends the room's events to exactly those servers until it has
resynced the full state (which these peers never serve: the room stays partial).
:meth:`HostedRoom.add_member` joins a user of another server, signed by that server;
its membership stays in the partial answer (as a room hero's does) while its server is
not named: a server the room's state says is in but that is not one of those named.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from federation_sender.testing.signed_events import event_id, hash_and_sign
from federation_sender.transport.signing import SigningKey

ROOM_VERSION = "10"
_AUTH_TYPES = ("m.room.create", "m.room.power_levels", "m.room.join_rules")


@dataclass
class HostedRoom:
    room_id: str
    creator: str
    origin: str
    key: SigningKey
    servers_in_room: list[str]
    events: dict[str, dict[str, Any]] = field(default_factory=dict)
    state: dict[tuple[str, str], str] = field(default_factory=dict)
    """(type, state_key) -> event id."""
    latest: str = ""
    depth: int = 0
    kept: set[str] = field(default_factory=set)
    """Membership events kept in a partial (``omit_members``) answer."""

    @classmethod
    def create(
        cls, origin: str, key: SigningKey, now_ms: int, extra_servers: list[str]
    ) -> HostedRoom:
        creator = f"@host:{origin}"
        room = cls(f"!{uuid.uuid4().hex[:12]}:{origin}", creator, origin, key,
                   [origin, *extra_servers])  # fmt: skip
        room._add("m.room.create", "", {"creator": creator, "room_version": ROOM_VERSION}, now_ms)
        room._add("m.room.member", creator, {"membership": "join"}, now_ms)
        room._add(
            "m.room.power_levels", "",
            {"users": {creator: 100}, "users_default": 0, "events_default": 0,
             "state_default": 50, "ban": 50, "kick": 50, "redact": 50, "invite": 0},
            now_ms,
        )  # fmt: skip
        room._add("m.room.join_rules", "", {"join_rule": "public"}, now_ms)
        room._add("m.room.history_visibility", "", {"history_visibility": "shared"}, now_ms)
        return room

    def _auth_events(self, event_type: str, sender: str) -> list[str]:
        if event_type == "m.room.create":
            return []
        keys = [(t, "") for t in _AUTH_TYPES] + [("m.room.member", sender)]
        return [self.state[k] for k in keys if k in self.state]

    def _add(
        self, event_type: str, state_key: str, content: dict[str, Any], now_ms: int,
        sender: tuple[str, SigningKey] | None = None,
    ) -> str:  # fmt: skip
        """An event sent by the creator, or by ``sender`` (user id, its server's key)."""
        user, key = sender or (self.creator, self.key)
        origin = user.split(":", 1)[1]
        self.depth += 1
        template = {
            "type": event_type, "room_id": self.room_id, "sender": user,
            "state_key": state_key, "content": content, "depth": self.depth,
            "prev_events": [self.latest] if self.latest else [],
            "auth_events": self._auth_events(event_type, user),
            "origin": origin, "origin_server_ts": now_ms,
        }  # fmt: skip
        eid, event = hash_and_sign(template, key, origin, ROOM_VERSION)
        self.accept(eid, event)
        return eid

    def add_member(self, user_id: str, key: SigningKey, now_ms: int) -> str:
        """``user_id`` (of the server whose key is ``key``) joins; its membership is
        kept in partial answers, its server is not added to ``servers_in_room``."""
        eid = self._add("m.room.member", user_id, {"membership": "join"}, now_ms,
                        (user_id, key))  # fmt: skip
        self.kept.add(eid)
        return eid

    def accept(self, eid: str, event: dict[str, Any]) -> None:
        """Take an event into the room (ours, or a joiner's from ``send_join``)."""
        self.events[eid] = event
        if "state_key" in event:
            self.state[(event["type"], event["state_key"])] = eid
        self.latest = eid
        self.depth = max(self.depth, int(event.get("depth", 0)))

    def make_join(self, user_id: str, now_ms: int) -> dict[str, Any]:
        event = {
            "type": "m.room.member", "room_id": self.room_id, "sender": user_id,
            "state_key": user_id, "content": {"membership": "join"}, "depth": self.depth + 1,
            "prev_events": [self.latest], "auth_events": self._auth_events("m.room.member", ""),
            "origin": user_id.split(":", 1)[1], "origin_server_ts": now_ms,
        }  # fmt: skip
        return {"room_version": ROOM_VERSION, "event": event}

    def _auth_chain(self, ids: list[str]) -> list[dict[str, Any]]:
        seen: dict[str, dict[str, Any]] = {}
        todo = list(ids)
        while todo:
            eid = todo.pop()
            for auth in self.events[eid]["auth_events"]:
                if auth not in seen:
                    seen[auth] = self.events[auth]
                    todo.append(auth)
        return list(seen.values())

    def send_join(self, event: dict[str, Any], *, omit_members: bool) -> dict[str, Any]:
        eid = event_id(event, ROOM_VERSION)
        state_ids = [
            e
            for (t, _), e in self.state.items()
            if not (omit_members and t == "m.room.member" and e not in self.kept)
        ]
        answer = {
            "event": event,
            "state": [self.events[e] for e in state_ids],
            "auth_chain": self._auth_chain([*state_ids, *event["auth_events"]]),
            "origin": self.origin,
            "members_omitted": omit_members,
            "servers_in_room": list(self.servers_in_room),
        }
        self.events[eid] = event  # now part of the room (it is the newest event)
        self.state[("m.room.member", event["state_key"])] = eid
        self.latest = eid
        self.depth = max(self.depth, int(event["depth"]))
        return answer
