"""The oracle and the delivery check against hand-computed expectations."""

from __future__ import annotations

import itertools
import random

import pytest

from federation_sender.sim.check import check_delivery
from federation_sender.sim.expected import Oracle
from federation_sender.sim.model import Batch, SimEvent
from federation_sender.sim.remotes import RemoteRecord
from federation_sender.sim.store import (
    PersistedBatch,
    PersistedDeviceChange,
    PersistedEvent,
    PersistedToDevice,
)
from federation_sender.sim.world import World
from federation_sender.testing.clock import FakeClock

US = "us.test"
A = "a.test"
B = "b.test"
C = "c.test"


class Harness:
    """A world whose batches get stream orderings without a database."""

    def __init__(self) -> None:
        self.world = World(
            server_name=US,
            remote_servers=[A, B, C],
            rng=random.Random(1),
            clock=FakeClock(),
            local_users=2,
            users_per_server=3,
        )
        self.oracle = Oracle()
        self._ids = itertools.count(1)
        self._edu_ids = itertools.count(1)

    def apply(self, batch: Batch) -> list[SimEvent]:
        persisted = PersistedBatch(
            [PersistedEvent(next(self._ids), e) for e in batch.events],
            [PersistedToDevice(next(self._edu_ids), m) for m in batch.to_device],
            [PersistedDeviceChange(next(self._edu_ids), c) for c in batch.device_changes],
        )
        self.oracle.observe(persisted)
        return batch.events

    def one(self, batch: Batch) -> SimEvent:
        [event] = self.apply(batch)
        return event

    def so(self, event: SimEvent) -> int:
        return self.oracle.events_by_id[event.event_id].stream_ordering


def a(n: int) -> str:
    return f"@u{n}:{A}"


def b(n: int) -> str:
    return f"@u{n}:{B}"


def sent_to(h: Harness, dest: str) -> list[str]:
    return [e.event_id for e in h.oracle.should_receive(dest)]


def test_kick_leave_rejoin_ban() -> None:
    h = Harness()
    w = h.world
    room, created = w.create_room(creator=f"@user0:{US}")
    initial = h.apply(created)
    assert all(e.hosts == frozenset() for e in initial)  # nobody else in the room yet

    join_a = h.one(w.join(room, a(0)))  # received from A: never sent back
    assert not join_a.local and join_a.hosts == frozenset()
    m1 = h.one(w.send_message(room))
    h.one(w.join(room, b(0)))
    h.one(w.join(room, a(1)))  # A now has two users
    m2 = h.one(w.send_message(room))
    kick_a0 = h.one(w.kick(room, a(0)))  # A still has u1: still joined
    m3 = h.one(w.send_message(room))
    kick_a1 = h.one(w.kick(room, a(1)))  # A's last user: A gets its own kick
    m4 = h.one(w.send_message(room))
    h.one(w.join(room, a(0)))  # A rejoins
    m5 = h.one(w.send_message(room))
    h.one(w.leave(room, b(0)))  # B leaves (received)
    m6 = h.one(w.send_message(room))
    ban = h.one(w.kick(room, a(0), ban=True))
    m7 = h.one(w.send_message(room))

    assert [m1.hosts, m2.hosts, kick_a0.hosts, m3.hosts] == [{A}, {A, B}, {A, B}, {A, B}]
    assert [kick_a1.hosts, m4.hosts, m5.hosts, m6.hosts] == [{A, B}, {B}, {A, B}, {A}]
    assert [ban.hosts, m7.hosts] == [{A}, set()]

    assert sent_to(h, A) == [e.event_id for e in (m1, m2, kick_a0, m3, kick_a1, m5, m6, ban)]
    assert sent_to(h, B) == [e.event_id for e in (m2, kick_a0, m3, kick_a1, m4, m5)]
    assert h.oracle.latest(A, room).event_id == ban.event_id  # type: ignore[union-attr]
    assert h.oracle.latest(B, room).event_id == m5.event_id  # type: ignore[union-attr]
    assert h.oracle.latest(C, room) is None
    assert sent_to(h, US) == []

    with pytest.raises(ValueError):
        w.join(room, a(0))  # banned users do not rejoin
    with pytest.raises(ValueError):
        w.leave(room, b(0))  # not joined


def test_local_join_goes_to_joined_servers_and_outliers_go_nowhere() -> None:
    h = Harness()
    w = h.world
    room, created = w.create_room(creator=f"@user0:{US}")
    h.apply(created)
    h.one(w.join(room, a(0)))
    local_join = h.one(w.join(room, f"@user1:{US}"))
    assert local_join.local and local_join.hosts == {A}
    outlier = h.one(w.local_outlier(room))
    assert outlier.outlier and outlier.hosts == frozenset()
    assert sent_to(h, A) == [local_join.event_id]


def test_partial_state_room() -> None:
    h = Harness()
    w = h.world
    room, batch = w.create_partial_state_room(joiner=f"@user0:{US}")
    assert batch.partial_state_added == [room]
    events = h.apply(batch)
    *remote_state, our_join = events
    assert all(e.outlier and not e.local for e in remote_state)
    creator_server = remote_state[0].sender.split(":", 1)[1]
    assert room.endswith(":" + creator_server)
    assert our_join.local and not our_join.outlier
    assert our_join.hosts == {creator_server}
    # Our join points at the remote's state, so the DAG is connected.
    assert our_join.pdu["prev_events"] == [remote_state[-1].event_id]
    assert w.finish_partial_state(room).partial_state_removed == [room]
    assert w.finish_partial_state(room).partial_state_removed == []


def test_forks_leave_two_extremities_until_our_next_event() -> None:
    h = Harness()
    w = h.world
    room, created = w.create_room(creator=f"@user0:{US}")
    h.apply(created)
    h.one(w.join(room, a(0)))
    ours = h.one(w.send_message(room))
    fork = h.one(w.receive_message(room, fork=True))
    assert fork.pdu["prev_events"] == ours.pdu["prev_events"]
    assert set(fork.extremities_after) == {ours.event_id, fork.event_id}
    merge = h.one(w.send_message(room))
    assert set(merge.pdu["prev_events"]) == {ours.event_id, fork.event_id}
    assert merge.extremities_after == (merge.event_id,)
    assert merge.pdu["depth"] == ours.pdu["depth"] + 1


def test_edus_expected() -> None:
    h = Harness()
    w = h.world
    room, created = w.create_room(creator=f"@user0:{US}")
    h.apply(created)
    h.one(w.join(room, a(0)))
    to_device = w.send_to_device(recipient=b(2))
    h.apply(to_device)
    [msg] = to_device.to_device
    assert msg.destination == B
    assert list(msg.content["messages"]) == [b(2)]
    assert h.oracle.destinations[B].to_device_message_ids == {msg.message_id}
    assert A not in h.oracle.destinations  # A's join was not ours to send
    h.apply(w.change_device(user_id=f"@user0:{US}"))
    assert h.apply(w.change_device(user_id=f"@user1:{US}")) == []  # in no room: no pokes
    [(user, _device)] = h.oracle.destinations[A].device_updates
    assert user == f"@user0:{US}"
    assert not h.oracle.destinations[B].device_updates


# --- the delivery check ---------------------------------------------------------


def _scene() -> tuple[Harness, str, list[SimEvent]]:
    h = Harness()
    w = h.world
    room, created = w.create_room(creator=f"@user0:{US}")
    h.apply(created)
    h.one(w.join(room, a(0)))
    h.one(w.join(room, b(0)))
    msgs = [h.one(w.send_message(room)) for _ in range(3)]
    kick_b = h.one(w.kick(room, b(0)))
    msgs.append(h.one(w.send_message(room)))
    return h, room, [*msgs[:3], kick_b, msgs[3]]


def _record(*events: SimEvent, edus: list[dict[str, object]] | None = None) -> RemoteRecord:
    r = RemoteRecord()
    for e in events:
        r.pdu_counts[e.event_id] += 1
    r.edus = list(edus or [])
    return r


def test_check_passes_on_full_live_delivery_and_counts_duplicates() -> None:
    h, _, (m1, m2, m3, kick_b, m4) = _scene()
    report = check_delivery(
        h.oracle,
        {A: _record(m1, m2, m2, m3, kick_b, m4), B: _record(m1, m2, m3, kick_b)},
    )
    assert report.ok, report.summary()
    assert report.destinations[A].duplicates == 1
    assert report.destinations[A].events_received == report.destinations[A].events_expected == 5
    assert "OK" in report.summary()


def test_check_accepts_catch_up_that_sent_only_the_latest() -> None:
    h, _, (_m1, _m2, _m3, kick_b, m4) = _scene()
    report = check_delivery(h.oracle, {A: _record(m4), B: _record(kick_b)})
    assert report.ok, report.summary()
    assert report.destinations[A].events_received == 1


def test_check_reports_missing_latest_leak_and_unknown() -> None:
    h, room, (m1, m2, m3, kick_b, m4) = _scene()
    stranger = RemoteRecord()
    stranger.pdu_counts["$not-an-event-we-wrote"] = 1
    report = check_delivery(
        h.oracle,
        {A: _record(m1, m2, m3), B: _record(m1, kick_b, m4), C: stranger},
    )
    assert not report.ok
    a_rep, b_rep, c_rep = (report.destinations[d] for d in (A, B, C))
    assert [(s.room_id, s.expected.event_id) for s in a_rep.missing_rooms] == [(room, m4.event_id)]
    assert a_rep.missing_rooms[0].got_stream_ordering == h.so(m3)
    assert b_rep.unexpected == [m4.event_id]  # sent after B was kicked
    assert not b_rep.missing_rooms
    assert c_rep.unknown == 1
    assert "FAILED" in report.summary() and A in report.summary()


def test_check_edus() -> None:
    h = Harness()
    w = h.world
    room, created = w.create_room(creator=f"@user0:{US}")
    h.apply(created)
    h.one(w.join(room, a(0)))
    h.apply(w.send_to_device(recipient=a(1)))
    h.apply(w.send_to_device(recipient=a(2)))
    h.apply(w.change_device(user_id=f"@user0:{US}"))
    exp = h.oracle.destinations[A]
    ids = sorted(exp.to_device_message_ids)
    [(user, device)] = exp.device_updates
    stream_id = exp.device_updates[(user, device)]

    def td(mid: str) -> dict[str, object]:
        return {"edu_type": "m.direct_to_device", "content": {"message_id": mid}}

    def dl(sid: int) -> dict[str, object]:
        content = {"user_id": user, "device_id": device, "stream_id": sid}
        return {"edu_type": "m.device_list_update", "content": content}

    good = check_delivery(h.oracle, {A: _record(edus=[td(ids[0]), td(ids[1]), dl(stream_id)])})
    assert good.destinations[A].to_device_missing == []
    assert good.destinations[A].device_updates_missing == []
    bad = check_delivery(h.oracle, {A: _record(edus=[td(ids[0]), td(ids[0]), dl(stream_id - 1)])})
    assert bad.destinations[A].to_device_missing == [ids[1]]
    assert bad.destinations[A].to_device_duplicates == 1
    assert bad.destinations[A].device_updates_missing == [(user, device)]
