"""A deterministic in-memory model of a homeserver's rooms and the servers in them.

Theory of operation
-------------------
:class:`World` stands in for the main process's view of the federation: our local
users, remote servers with their users, and rooms with a membership map, a DAG tip
(forward extremities) and a depth. Every operation changes the model and returns a
:class:`~federation_sender.sim.model.Batch` of what the main process would persist.
Nothing here touches the database or the network; :mod:`.store` writes batches and
:mod:`.expected` derives what each destination must receive from the same events.

Given the same seed, the same sequence of calls and the same clock readings, a World
produces byte-identical events. All randomness comes from the ``random.Random`` passed
in; timestamps come from the injected clock.

What is modelled, because the worker's rules depend on it:

* local events (sender on our server) that the worker must send, and remote events
  (received over federation) that it must not;
* joins, leaves, kicks and bans of remote users, which change the set of servers
  an event goes to (see :class:`~federation_sender.sim.model.SimEvent` for the rule);
* outliers (never sent), including the state a partial join fetched;
* partial-state rooms: created by a remote server and joined by one of our users,
  listed in ``partial_state_rooms`` until :meth:`World.finish_partial_state`;
* forks: a remote event may be concurrent with our latest event, leaving two forward
  extremities until our next event merges them.

Invariants: a user is in at most one membership state per room; a banned user never
rejoins; our own server is never a destination; every room keeps at least one local
member (our users never leave), so every room stays relevant to the worker.

Every event is new, as on a real homeserver, which never creates the same event twice
(the ``events`` table's unique event id relies on it). An event id is the hash of the
redacted event, which keeps ``origin_server_ts``, ``prev_events``, ``depth`` and the
``hashes`` of the full content, but not ``unsigned`` (so a transaction id or nonce
there would not help). Many events can share a room, a sender and a millisecond, so
the timestamp separates nothing; what does:

* an event that extends the room's DAG cites its newest event (the last of the room's
  extremities), so no event made before that one can be it;
* a fork (citing the extremities before the newest event) or an outlier (which no
  event cites) could match another in every other field, so each carries in its
  content, as a client's action on a real server carries its own text, the world's
  sequence number, which the content hash folds into the id.

A room id is drawn again if it is taken, so create events are new too.
"""

from __future__ import annotations

import itertools
import random
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from federation_sender.clock import Clock, time_ms
from federation_sender.ids import server_of
from federation_sender.sim.model import (
    Batch,
    DeviceListChange,
    SimEvent,
    ToDeviceMessage,
)
from federation_sender.sim.pdu import ROOM_VERSION, build_pdu

MAX_PREV_EVENTS = 10


@dataclass(slots=True)
class Room:
    room_id: str
    partial_state: bool
    members: dict[str, str] = field(default_factory=dict)
    """user id -> current membership (join, leave, ban)."""
    joined_per_server: Counter[str] = field(default_factory=Counter)
    joined_local: list[str] = field(default_factory=list)
    """Our joined users, in join order (picked as senders and moderators)."""
    member_event: dict[str, str] = field(default_factory=dict)
    extremities: list[str] = field(default_factory=list)
    previous_extremities: list[str] = field(default_factory=list)
    depth_of: dict[str, int] = field(default_factory=dict)
    auth_base: list[str] = field(default_factory=list)
    """create and power-levels event ids, the auth events every later event cites."""

    def joined_remote_users(self, our_server: str) -> list[str]:
        return [u for u, m in self.members.items() if m == "join" and server_of(u) != our_server]

    def joined_servers(self) -> frozenset[str]:
        return frozenset(s for s, n in self.joined_per_server.items() if n > 0)


class World:
    """The simulated homeserver ``server_name`` and the federation around it."""

    def __init__(
        self,
        *,
        server_name: str,
        remote_servers: Sequence[str],
        rng: random.Random,
        clock: Clock,
        local_users: int = 10,
        users_per_server: int = 20,
    ) -> None:
        if server_name in remote_servers:
            raise ValueError("our server cannot also be a remote server")
        self.server_name = server_name
        self.remote_servers = list(remote_servers)
        self.rng = rng
        self.clock = clock
        self.local_users = [f"@user{i}:{server_name}" for i in range(local_users)]
        self.remote_users = {
            s: [f"@u{i}:{s}" for i in range(users_per_server)] for s in self.remote_servers
        }
        self.rooms: dict[str, Room] = {}
        self._room_ids: list[str] = []
        self._room_cum_weights: list[float] = []
        self._local_user_rooms: dict[str, set[str]] = {u: set() for u in self.local_users}
        self._seq = itertools.count(1)

    # --- queries ---------------------------------------------------------------

    @property
    def room_ids(self) -> list[str]:
        return list(self._room_ids)

    def joined_remote_servers(self, room_id: str) -> frozenset[str]:
        return self.rooms[room_id].joined_servers() - {self.server_name}

    def is_local(self, user_id: str) -> bool:
        return server_of(user_id) == self.server_name

    def pick_room(self) -> str:
        """A room, busier rooms more often (weights fall off as 1/rank^0.8)."""
        return self.rng.choices(self._room_ids, cum_weights=self._room_cum_weights)[0]

    # --- rooms -----------------------------------------------------------------

    def _new_room_id(self, server: str) -> str:
        while True:
            letters = "".join(self.rng.choices(string.ascii_letters, k=18))
            room_id = f"!{letters}:{server}"
            if room_id not in self.rooms:
                return room_id

    def _add_room(self, room: Room) -> None:
        self.rooms[room.room_id] = room
        self._room_ids.append(room.room_id)
        weight = 1.0 / (len(self._room_ids) ** 0.8)
        prev = self._room_cum_weights[-1] if self._room_cum_weights else 0.0
        self._room_cum_weights.append(prev + weight)

    def create_room(self, creator: str | None = None) -> tuple[str, Batch]:
        """A room created by one of our users: create, join, power levels, join rules."""
        creator = creator or self.rng.choice(self.local_users)
        room = Room(self._new_room_id(self.server_name), partial_state=False)
        self._add_room(room)
        batch = Batch()
        self._initial_state(room, creator, batch, outlier=False)
        return room.room_id, batch

    def create_partial_state_room(self, joiner: str | None = None) -> tuple[str, Batch]:
        """A remote room that one of our users joins with a partial-state (faster) join.

        The remote's initial state arrives as outliers; our join is a normal local event
        sent to the room's server. The room stays in ``partial_state_rooms`` until
        :meth:`finish_partial_state`.
        """
        joiner = joiner or self.rng.choice(self.local_users)
        origin = self.rng.choice(self.remote_servers)
        creator = self.rng.choice(self.remote_users[origin])
        room = Room(self._new_room_id(origin), partial_state=True)
        self._add_room(room)
        batch = Batch(partial_state_added=[room.room_id])
        self._initial_state(room, creator, batch, outlier=True)
        batch.events.append(self._membership(room, joiner, joiner, "join"))
        return room.room_id, batch

    def finish_partial_state(self, room_id: str) -> Batch:
        room = self.rooms[room_id]
        if not room.partial_state:
            return Batch()
        room.partial_state = False
        return Batch(partial_state_removed=[room_id])

    def _initial_state(self, room: Room, creator: str, batch: Batch, *, outlier: bool) -> None:
        ev = self._event(
            room,
            creator,
            "m.room.create",
            {"creator": creator, "room_version": ROOM_VERSION},
            state_key="",
            outlier=outlier,
        )
        room.auth_base = [ev.event_id]
        batch.events.append(ev)
        batch.events.append(self._membership(room, creator, creator, "join", outlier=outlier))
        pl = self._event(
            room,
            creator,
            "m.room.power_levels",
            {"users": {creator: 100}, "users_default": 0, "kick": 50, "ban": 50},
            state_key="",
            outlier=outlier,
        )
        room.auth_base.append(pl.event_id)
        batch.events.append(pl)
        batch.events.append(
            self._event(
                room,
                creator,
                "m.room.join_rules",
                {"join_rule": "public"},
                state_key="",
                outlier=outlier,
            )
        )

    # --- membership ------------------------------------------------------------

    def join(self, room_id: str, user_id: str) -> Batch:
        """``user_id`` joins: a local event for our users, a received one for others."""
        room = self.rooms[room_id]
        if room.members.get(user_id) in ("join", "ban"):
            raise ValueError(f"{user_id} cannot join {room_id}: {room.members[user_id]}")
        return Batch(events=[self._membership(room, user_id, user_id, "join")])

    def leave(self, room_id: str, user_id: str) -> Batch:
        """A remote user leaves (received from its server)."""
        room = self.rooms[room_id]
        self._check_remote_member(room, user_id)
        return Batch(events=[self._membership(room, user_id, user_id, "leave")])

    def kick(self, room_id: str, user_id: str, *, ban: bool = False) -> Batch:
        """One of our users kicks (or bans) a joined remote user: a local event."""
        room = self.rooms[room_id]
        self._check_remote_member(room, user_id)
        moderator = self._local_member(room)
        membership = "ban" if ban else "leave"
        return Batch(events=[self._membership(room, moderator, user_id, membership)])

    def _check_remote_member(self, room: Room, user_id: str) -> None:
        if self.is_local(user_id):
            raise ValueError("local users stay in their rooms in this model")
        if room.members.get(user_id) != "join":
            raise ValueError(f"{user_id} is not joined to {room.room_id}")

    def _local_member(self, room: Room) -> str:
        return self.rng.choice(room.joined_local)

    def _membership(
        self, room: Room, sender: str, target: str, membership: str, *, outlier: bool = False
    ) -> SimEvent:
        ev = self._event(
            room,
            sender,
            "m.room.member",
            {"membership": membership, "displayname": target.split(":", 1)[0][1:]},
            state_key=target,
            outlier=outlier,
            membership=membership,
        )
        before = room.members.get(target)
        room.members[target] = membership
        room.member_event[target] = ev.event_id
        server = server_of(target)
        if before == "join" and membership != "join":
            room.joined_per_server[server] -= 1
        elif before != "join" and membership == "join":
            room.joined_per_server[server] += 1
        if self.is_local(target):
            if membership == "join":
                self._local_user_rooms[target].add(room.room_id)
                if before != "join":
                    room.joined_local.append(target)
            else:
                self._local_user_rooms[target].discard(room.room_id)
                if before == "join":
                    room.joined_local.remove(target)
        return ev

    # --- messages --------------------------------------------------------------

    def send_message(self, room_id: str, sender: str | None = None, body_bytes: int = 0) -> Batch:
        """A message from one of our users; ``body_bytes`` pads the body (large events)."""
        room = self.rooms[room_id]
        sender = sender or self._local_member(room)
        n = next(self._seq)
        body = f"message {n}" + ("." * body_bytes if body_bytes else "")
        ev = self._event(room, sender, "m.room.message", {"msgtype": "m.text", "body": body})
        return Batch(events=[ev])

    def receive_message(self, room_id: str, *, fork: bool = False) -> Batch:
        """A message from a remote member; with ``fork``, concurrent with our last event."""
        room = self.rooms[room_id]
        senders = room.joined_remote_users(self.server_name)
        if not senders:
            return Batch()
        sender = self.rng.choice(senders)
        n = next(self._seq)
        ev = self._event(
            room,
            sender,
            "m.room.message",
            {"msgtype": "m.text", "body": f"remote message {n}"},
            fork=fork,
        )
        return Batch(events=[ev])

    def local_outlier(self, room_id: str) -> Batch:
        """A local event stored as an outlier (e.g. an out-of-band membership): never sent.

        An outlier does not move the room's tip, so two of them in the same room, from
        the same sender in the same millisecond, share prev_events, depth and
        timestamp: only their content tells them apart (see "Every event is new").
        """
        room = self.rooms[room_id]
        sender = self._local_member(room)
        n = next(self._seq)
        content = {"msgtype": "m.notice", "body": f"outlier {n}"}
        ev = self._event(room, sender, "m.room.message", content, outlier=True)
        return Batch(events=[ev])

    # --- EDU outboxes ----------------------------------------------------------

    def send_to_device(self, recipient: str | None = None) -> Batch:
        """A to-device message from one of our users to a remote user's device."""
        if recipient is None:
            server = self.rng.choice(self.remote_servers)
            recipient = self.rng.choice(self.remote_users[server])
        sender = self.rng.choice(self.local_users)
        message_id = f"m{next(self._seq)}"
        content = {
            "sender": sender,
            "type": "m.room_key_request",
            "message_id": message_id,
            "messages": {recipient: {"DEVICE": {"request_id": message_id}}},
        }
        msg = ToDeviceMessage(server_of(recipient), message_id, content)
        return Batch(to_device=[msg])

    def change_device(self, user_id: str | None = None) -> Batch:
        """A local user's device changed; every server sharing a room must hear of it."""
        user_id = user_id or self.rng.choice(self.local_users)
        destinations: set[str] = set()
        for room_id in self._local_user_rooms[user_id]:
            destinations |= self.joined_remote_servers(room_id)
        if not destinations:
            return Batch()
        device_id = f"DEV{self.rng.randrange(3)}"
        change = DeviceListChange(
            user_id,
            device_id,
            frozenset(destinations),
            {"device_display_name": f"sim {next(self._seq)}"},
        )
        return Batch(device_changes=[change])

    # --- event construction ----------------------------------------------------

    def _event(
        self,
        room: Room,
        sender: str,
        event_type: str,
        content: dict[str, Any],
        *,
        state_key: str | None = None,
        outlier: bool = False,
        membership: str | None = None,
        fork: bool = False,
    ) -> SimEvent:
        local = self.is_local(sender)
        if fork and room.previous_extremities:
            prev = list(room.previous_extremities)
        else:
            prev = list(room.extremities[-MAX_PREV_EVENTS:])
        depth = 1 + max((room.depth_of.get(e, 0) for e in prev), default=0)
        auth = list(room.auth_base)
        if sender in room.member_event:
            auth.append(room.member_event[sender])
        event_id, pdu = build_pdu(
            room_id=room.room_id,
            sender=sender,
            origin=server_of(sender),
            event_type=event_type,
            content=content,
            state_key=state_key,
            prev_events=prev,
            auth_events=auth,
            depth=depth,
            origin_server_ts=time_ms(self.clock),
        )
        before = room.joined_servers()
        hosts: frozenset[str] = frozenset()
        if local and not outlier:
            after = set(before)
            if membership == "join" and state_key is not None:
                after.add(server_of(state_key))
            hosts = frozenset(after) - {self.server_name}
        # A partial join's outliers are still the DAG our join event points at.
        if not outlier or (room.partial_state and not local):
            self._advance_tip(room, event_id, depth, prev, forked=fork)
        return SimEvent(
            event_id=event_id,
            room_id=room.room_id,
            type=event_type,
            state_key=state_key,
            sender=sender,
            origin_server_ts=pdu["origin_server_ts"],
            pdu=pdu,
            membership=membership,
            local=local,
            outlier=outlier,
            hosts=hosts,
            extremities_after=tuple(room.extremities),
        )

    def _advance_tip(
        self, room: Room, event_id: str, depth: int, prev: list[str], *, forked: bool
    ) -> None:
        if forked and prev == room.previous_extremities:
            # Concurrent with the latest event: both are now extremities.
            room.extremities = [*room.extremities, event_id]
        else:
            room.previous_extremities = room.extremities
            room.extremities = [event_id]
        live = set(room.extremities) | set(room.previous_extremities)
        room.depth_of[event_id] = depth
        room.depth_of = {e: d for e, d in room.depth_of.items() if e in live}
