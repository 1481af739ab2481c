"""``m.typing`` EDUs from the replication ``typing`` stream (see the package docstring).

:class:`TypingState` is the pure part: the typing sets, the diff, the reset and which
typers are due a re-send. :class:`TypingFanout` looks up the room's hosts and queues
the EDUs; its :meth:`TypingFanout.run` (an ``every`` tick of
:mod:`federation_sender.supervisor`, run under the worker's supervisor) does the re-sends.

Synapse's follower (``handlers/typing.py``) checks its timers every 5 s and re-sends
``typing: true`` once the last send to remotes is 40 s old; so does this module. It does
not time typers out by itself: main does, and publishes the room's new set.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from federation_sender.clock import Clock, time_ms
from federation_sender.edus import EduSink, RoomHosts
from federation_sender.ids import server_of
from federation_sender.replication.rows import TypingRow
from federation_sender.supervisor import every

log = logging.getLogger(__name__)

PING_INTERVAL_MS = 40_000
"""Synapse's ``FEDERATION_PING_INTERVAL``: re-send while a user keeps typing."""
CHECK_INTERVAL_S = 5.0
"""How often due re-sends are looked for (Synapse's wheel-timer tick)."""

Member = tuple[str, str]
"""(room_id, user_id)"""


@dataclass(frozen=True, slots=True)
class TypingChange:
    room_id: str
    user_id: str
    typing: bool


class TypingState:
    """The typing sets of every room, as the stream last described them."""

    def __init__(self, server_name: str) -> None:
        self._server_name = server_name
        self.token = 0
        self.rooms: dict[str, frozenset[str]] = {}
        self.last_sent_ms: dict[Member, int] = {}
        """When each local typer's state last went to remotes."""

    def apply(self, token: int, rows: Iterable[TypingRow]) -> list[TypingChange]:
        """Take a batch of the stream; returns the local users whose state changed."""
        if token < self.token:
            # Main restarted (its typing stream lives in memory): the old sets are void.
            log.info("typing stream went back from %d to %d; resetting", self.token, token)
            self.rooms.clear()
            self.last_sent_ms.clear()
        self.token = token
        changes: list[TypingChange] = []
        for row in rows:
            before = self.rooms.get(row.room_id, frozenset())
            now = frozenset(row.user_ids)
            if now:
                self.rooms[row.room_id] = now
            else:
                self.rooms.pop(row.room_id, None)
            for user in sorted(now - before):
                if self._is_local(user):
                    changes.append(TypingChange(row.room_id, user, True))
            for user in sorted(before - now):
                if self._is_local(user):
                    changes.append(TypingChange(row.room_id, user, False))
                    self.last_sent_ms.pop((row.room_id, user), None)
        return changes

    def _is_local(self, user_id: str) -> bool:
        return server_of(user_id) == self._server_name

    def is_typing(self, room_id: str, user_id: str) -> bool:
        return user_id in self.rooms.get(room_id, frozenset())

    def sent(self, room_id: str, user_id: str, now_ms: int) -> None:
        if self.is_typing(room_id, user_id):
            self.last_sent_ms[(room_id, user_id)] = now_ms

    def due(self, now_ms: int) -> list[Member]:
        """Local typers whose last send is at least :data:`PING_INTERVAL_MS` old."""
        return [
            m
            for m, at in self.last_sent_ms.items()
            if at + PING_INTERVAL_MS <= now_ms and self.is_typing(*m)
        ]


class TypingFanout:
    """Implements the ``typing`` stream's part of the replication handler."""

    def __init__(
        self, server_name: str, hosts: RoomHosts, sink: EduSink, clock: Clock
    ) -> None:
        self._server_name = server_name
        self._hosts = hosts
        self._sink = sink
        self._clock = clock
        self.state = TypingState(server_name)

    async def on_rows(self, token: int, rows: Iterable[TypingRow]) -> None:
        for change in self.state.apply(token, rows):
            await self._push(change.room_id, change.user_id, change.typing)

    async def resend_due(self) -> int:
        """Re-send ``typing: true`` for every typer that is due; returns how many."""
        due = self.state.due(time_ms(self._clock))
        for room_id, user_id in due:
            await self._push(room_id, user_id, True)
        return len(due)

    async def run(self) -> None:
        """The re-send loop, every :data:`CHECK_INTERVAL_S`; runs until cancelled (a
        failed tick is logged, the next one tries again)."""
        await every("typing re-send", CHECK_INTERVAL_S, self.resend_due, clock=self._clock,
                    logger=log)

    async def _push(self, room_id: str, user_id: str, typing: bool) -> None:
        self.state.sent(room_id, user_id, time_ms(self._clock))
        content = {"room_id": room_id, "user_id": user_id, "typing": typing}
        for host in await self._hosts.current_hosts(room_id):
            if host != self._server_name:
                self._sink.enqueue_edu(host, "m.typing", content, key=(room_id, user_id))
