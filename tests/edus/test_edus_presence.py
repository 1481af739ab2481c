"""Presence from the ``presence`` and ``presence_federation`` streams: Synapse's
notify rule, its format, and who receives what."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from federation_sender.clock import time_ms
from federation_sender.edus.presence import PresenceFanout, presence_json, should_notify
from federation_sender.replication.rows import (
    PresenceDestinationsRow,
    PresenceFederationRow,
    PresenceRow,
    PresenceState,
)
from federation_sender.storage.backend import NativeBackend
from federation_sender.testing import queue_harness as harness
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.intake import native_intake

ME = "me.test"
ALICE = f"@alice:{ME}"
BOB = f"@bob:{ME}"


def st(user: str, state: str = "online", active: int = 1_000, msg: str | None = None,
       current: bool = True) -> PresenceState:
    return PresenceState(user, state, active, 0, 0, msg, current)


def test_should_notify_is_synapses_rule() -> None:
    g = 60_000
    base = st(ALICE)
    assert not should_notify(base, base, g)
    assert should_notify(base, st(ALICE, msg="lunch"), g)
    assert should_notify(base, st(ALICE, "unavailable"), g)
    assert should_notify(base, st(ALICE, current=False), g)
    # Online and active: last-active bumps are not news; once inactive they are.
    assert not should_notify(base, st(ALICE, active=base.last_active_ts + g + 1), g)
    assert should_notify(st(ALICE, current=False),
                         st(ALICE, active=base.last_active_ts + g + 1, current=False), g)
    away = st(ALICE, "unavailable", current=False)
    assert not should_notify(away, away._replace(last_active_ts=away.last_active_ts + g), g)
    assert should_notify(away, away._replace(last_active_ts=away.last_active_ts + g + 1), g)


def test_format_is_synapses() -> None:
    assert presence_json(st(ALICE, msg="hi"), 5_000) == {
        "presence": "online", "user_id": ALICE, "last_active_ago": 4_000,
        "status_msg": "hi", "currently_active": True}
    assert presence_json(PresenceState(ALICE, "offline", 0, 0, 0, "", True), 5_000) == {
        "presence": "offline", "user_id": ALICE}
    # currently_active only while online; no status without one; the age as it is.
    assert presence_json(st(ALICE, "unavailable", 4_000, None, True), 5_000) == {
        "presence": "unavailable", "user_id": ALICE, "last_active_ago": 1_000}
    assert presence_json(st(ALICE, current=False), 5_000) == {
        "presence": "online", "user_id": ALICE, "last_active_ago": 4_000,
        "currently_active": False}


class Source:
    def __init__(self) -> None:
        self.rooms = {ALICE: ["!a", "!quiet"], BOB: []}
        self.hosts = {"!a": {ME, "r1.test", "r2.test"}, "!quiet": {ME, "r3.test"}}
        self.stored = {BOB: st(BOB, "unavailable", current=False)}
        self.startup = [st(ALICE)]

    async def startup_states(self) -> list[PresenceState]:
        return self.startup

    async def states_for_users(self, user_ids: Collection[str]) -> dict[str, PresenceState]:
        return {u: self.stored[u] for u in user_ids if u in self.stored}

    async def rooms_for_user(self, user_id: str) -> Collection[str]:
        return self.rooms.get(user_id, [])

    async def current_hosts(self, room_id: str) -> Collection[str]:
        return self.hosts[room_id]


class Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[str, list[dict[str, Any]]]] = []

    def enqueue_presence(self, destination: str, states: Iterable[dict[str, Any]]) -> None:
        self.sent.append((destination, list(states)))


async def test_local_changes_go_to_the_hosts_of_the_users_rooms() -> None:
    sink = Sink()
    fan = PresenceFanout(ME, Source(), sink, FakeClock(), excluded_rooms=["!quiet"])
    await fan.on_presence([PresenceRow(st(ALICE))])  # the startup state: no change
    assert sink.sent == []
    await fan.on_presence([PresenceRow(st(ALICE, msg="lunch")),
                           PresenceRow(st("@carol:r1.test", "offline"))])  # not ours
    assert [(d, [e["status_msg"] for e in s]) for d, s in sink.sent] == [
        ("r1.test", ["lunch"]), ("r2.test", ["lunch"])]  # not r3: its room is excluded


async def test_presence_federation_sends_the_current_state() -> None:
    sink = Sink()
    clock = FakeClock()
    fan = PresenceFanout(ME, Source(), sink, clock)
    await fan.on_presence_federation([
        PresenceFederationRow("r9.test", ALICE), PresenceFederationRow("r9.test", BOB),
        PresenceFederationRow("r8.test", "@nobody:me.test")])
    assert [(d, [(e["user_id"], e["presence"]) for e in s]) for d, s in sink.sent] == [
        ("r8.test", [("@nobody:me.test", "offline")]),
        ("r9.test", [(ALICE, "online"), (BOB, "unavailable")]),
    ]


async def test_presence_main_queues_for_servers_is_formatted_as_synapse_does(
    h: harness.Harness,
) -> None:
    """The ``federation`` stream's ``pd`` rows (presence main sends to given servers) go
    out in the one presence format, Synapse's: offline without a last-active time carries
    neither ``last_active_ago`` nor ``currently_active``, an empty status is left out."""
    me = harness.ME
    gone = PresenceState(f"@gone:{me}", "offline", 0, 0, 0, "", False)
    here = PresenceState(f"@here:{me}", "online", 1_000, 0, 0, "lunch", True)
    intake = native_intake(await h.start(), NativeBackend(h.engine), me, h.clock)
    now = time_ms(h.clock)
    await intake.on_rows("federation", "master", 1, [
        PresenceDestinationsRow(gone, ("r1.test",)),
        PresenceDestinationsRow(here, ("r1.test",)),
    ])
    await h.settle()
    pushed = [entry for e in h.fake.received_edus("r1.test") if e["edu_type"] == "m.presence"
              for entry in e["content"]["push"]]
    assert sorted(pushed, key=lambda e: str(e["user_id"])) == [
        {"presence": "offline", "user_id": gone.user_id},
        {"presence": "online", "user_id": here.user_id, "last_active_ago": now - 1_000,
         "status_msg": "lunch", "currently_active": True},
    ]
