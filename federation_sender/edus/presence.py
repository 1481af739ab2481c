"""``m.presence`` EDUs from the replication ``presence`` and ``presence_federation``
streams, as Synapse's federation sender sends them (``handlers/presence.py``).

* ``presence``: full states of users. Each is compared with the last state seen for the
  user (:func:`should_notify`: a status message or state change, ``currently_active``
  flipping while online, or ``last_active_ts`` moving by more than the granularity when
  that matters); a local user's notable change goes to every host of every room the
  user is joined to (rooms in ``exclude_rooms_from_presence`` do not count).
* ``presence_federation``: ``(destination, user)`` pairs main wants sent regardless (a
  newly joined server, federation pings): the user's current state goes to that host.

The states seen start from the backend's non-offline states at start (Synapse:
``presence_stream``), as Synapse's worker starts from ``take_presence_startup_info``.
The queue packs at most 50 states per EDU (:mod:`federation_sender.queue.core.batching`),
one entry per user, the latest winning.

Difference: Synapse computes ``last_active_ago`` when the transaction is built; here it
is computed when the state is queued (the queue keeps EDU content, not states), so it
can be smaller by the time the state waited in the queue.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import Protocol

from federation_sender.clock import Clock, time_ms
from federation_sender.ids import server_of
from federation_sender.queue.core.items import JsonDict
from federation_sender.replication.rows import PresenceFederationRow, PresenceRow, PresenceState
from federation_sender.storage.protocols import PresenceSource

log = logging.getLogger(__name__)

ONLINE = "online"
OFFLINE = "offline"
DEFAULT_LAST_ACTIVE_GRANULARITY_MS = 60_000


class PresenceSink(Protocol):
    def enqueue_presence(self, destination: str, states: Iterable[JsonDict]) -> None: ...


def offline(user_id: str) -> PresenceState:
    """Synapse's ``UserPresenceState.default``."""
    return PresenceState(user_id, OFFLINE, 0, 0, 0, None, False)


def presence_json(state: PresenceState, now_ms: int) -> JsonDict:
    """Synapse's ``format_user_presence_state`` with the user id, as sent to servers."""
    content: JsonDict = {"presence": state.state, "user_id": state.user_id}
    if state.last_active_ts:
        content["last_active_ago"] = now_ms - state.last_active_ts
    if state.status_msg:
        content["status_msg"] = state.status_msg
    if state.state == ONLINE:
        content["currently_active"] = state.currently_active
    return content


def should_notify(old: PresenceState, new: PresenceState, granularity_ms: int) -> bool:
    """Synapse's rule for whether a change is worth telling others about."""
    if old == new:
        return False
    if old.status_msg != new.status_msg or old.state != new.state:
        return True
    bumped = new.last_active_ts - old.last_active_ts > granularity_ms
    if old.state == ONLINE:
        if new.currently_active != old.currently_active:
            return True
        return bumped and not new.currently_active
    return bumped


class PresenceFanout:
    """Implements the presence streams' part of the replication handler."""

    def __init__(
        self,
        server_name: str,
        source: PresenceSource,
        sink: PresenceSink,
        clock: Clock,
        *,
        last_active_granularity_ms: int = DEFAULT_LAST_ACTIVE_GRANULARITY_MS,
        excluded_rooms: Collection[str] = (),
    ) -> None:
        self._server_name = server_name
        self._source = source
        self._sink = sink
        self._clock = clock
        self._granularity_ms = last_active_granularity_ms
        self._excluded = frozenset(excluded_rooms)
        self.states: dict[str, PresenceState] = {}
        self._loaded = False

    async def load(self) -> None:
        """The states seen so far: the stored non-offline ones. Call it before
        replication starts: loaded only when the first rows arrive (the fallback), the
        change those rows carry is already stored and would look like no change."""
        self.states = {s.user_id: s for s in await self._source.startup_states()}
        self._loaded = True

    async def on_presence(self, rows: Iterable[PresenceRow]) -> None:
        if not self._loaded:
            await self.load()
        notify: list[PresenceState] = []
        for row in rows:
            new = row.state
            old = self.states.get(new.user_id)
            self.states[new.user_id] = new
            if old is None or should_notify(old, new, self._granularity_ms):
                notify.append(new)
        now = time_ms(self._clock)
        for state in notify:
            if server_of(state.user_id) != self._server_name:
                continue
            hosts: set[str] = set()
            for room_id in await self._source.rooms_for_user(state.user_id):
                if room_id not in self._excluded:
                    hosts.update(await self._source.current_hosts(room_id))
            entry = presence_json(state, now)
            for host in sorted(hosts - {self._server_name}):
                self._sink.enqueue_presence(host, [entry])

    async def on_presence_federation(self, rows: Iterable[PresenceFederationRow]) -> None:
        if not self._loaded:
            await self.load()
        by_host: dict[str, set[str]] = {}
        for row in rows:
            by_host.setdefault(row.destination, set()).add(row.user_id)
        now = time_ms(self._clock)
        for host, users in sorted(by_host.items()):
            states = await self._current(users)
            self._sink.enqueue_presence(host, [presence_json(s, now) for s in states])

    async def _current(self, users: Collection[str]) -> list[PresenceState]:
        """Synapse's ``current_state_for_users``: memory, else the database, else
        offline (remembered)."""
        missing = sorted(u for u in users if u not in self.states)
        if missing:
            stored = await self._source.states_for_users(missing)
            for user_id in missing:
                self.states[user_id] = stored.get(user_id) or offline(user_id)
        return [self.states[u] for u in sorted(users)]
