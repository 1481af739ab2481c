"""The simulator never makes the same event twice, however many share a millisecond.

Issue #42: at ~100 operations per second the demo crashed with the ``events`` table's
unique violation, because two local outliers in the same room, from the same sender in
the same millisecond, hashed to the same reference event id. The world now gives every
event off the DAG tip its own content, and the store names a duplicate in one line.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.sim.model import Batch, SimEvent
from federation_sender.sim.pdu import reference_event_id
from federation_sender.sim.publish import RecordingPublisher
from federation_sender.sim.store import DuplicateEventError, SimStore
from federation_sender.sim.world import World
from federation_sender.testing.clock import FakeClock

US = "us.test"


def _world(*, seed: int = 0, remotes: int = 2, local_users: int = 2, users: int = 3) -> World:
    return World(
        server_name=US,
        remote_servers=[f"r{i}.test" for i in range(remotes)],
        rng=random.Random(seed),
        clock=FakeClock(),  # never advanced: every event is in the same millisecond
        local_users=local_users,
        users_per_server=users,
    )


def test_two_local_outliers_in_one_room_from_one_sender_in_one_millisecond_differ() -> None:
    w = _world()
    room, _ = w.create_room(creator=f"@user0:{US}")  # our only member: the sender
    [first] = w.local_outlier(room).events
    [second] = w.local_outlier(room).events
    assert first.outlier and second.outlier
    assert (first.room_id, first.sender, first.origin_server_ts) == (
        second.room_id,
        second.sender,
        second.origin_server_ts,
    )
    assert first.pdu["prev_events"] == second.pdu["prev_events"]  # outliers move no tip
    assert first.event_id != second.event_id
    assert reference_event_id(second.pdu) == second.event_id


# --- the property: every id unique at any rate -----------------------------------------

OPS = ("message", "remote_message", "fork", "outlier", "join", "leave", "kick", "ban", "tick")


@dataclass(frozen=True, slots=True)
class Shape:
    seed: int
    rooms: int
    partial_rooms: int
    remotes: int
    local_users: int
    users_per_server: int


shapes = st.builds(
    Shape,
    seed=st.integers(0, 2**32 - 1),
    rooms=st.integers(1, 3),
    partial_rooms=st.integers(0, 2),
    remotes=st.integers(1, 3),
    local_users=st.integers(1, 2),
    users_per_server=st.integers(1, 3),
)
# Mostly outliers, forks and messages; "tick" (1 ms passes) is rare, so long runs of
# events share a millisecond.
op_lists = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, 1_000)), min_size=1, max_size=300
)


def _apply(w: World, op: str, pick: int) -> Batch:
    room_id = w.room_ids[pick % len(w.room_ids)]
    room = w.rooms[room_id]
    remote_members = room.joined_remote_users(w.server_name)
    if op == "message":
        return w.send_message(room_id)
    if op in ("remote_message", "fork"):
        return w.receive_message(room_id, fork=op == "fork")
    if op == "outlier":
        return w.local_outlier(room_id)
    if op == "join":
        users = [*w.local_users, *(u for us in w.remote_users.values() for u in us)]
        candidates = [u for u in users if room.members.get(u) not in ("join", "ban")]
        return w.join(room_id, candidates[pick % len(candidates)]) if candidates else Batch()
    if op in ("leave", "kick", "ban") and remote_members:
        target = remote_members[pick % len(remote_members)]
        if op == "leave":
            return w.leave(room_id, target)
        return w.kick(room_id, target, ban=op == "ban")
    return Batch()


def _describe(e: SimEvent) -> str:
    kind = "outlier" if e.outlier else "event"
    return f"{e.type} {kind} {e.event_id} in {e.room_id} by {e.sender} at {e.origin_server_ts}"


@settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(shape=shapes, ops=op_lists)
def test_every_event_id_is_unique_at_any_rate(shape: Shape, ops: list[tuple[str, int]]) -> None:
    w = _world(
        seed=shape.seed,
        remotes=shape.remotes,
        local_users=shape.local_users,
        users=shape.users_per_server,
    )
    note(f"{shape} ops={ops}")  # (this Hypothesis install prints arguments blank)
    clock = w.clock
    assert isinstance(clock, FakeClock)
    events: list[SimEvent] = []
    for _ in range(shape.partial_rooms):
        events += w.create_partial_state_room()[1].events
    for _ in range(shape.rooms):
        events += w.create_room()[1].events
    for op, pick in ops:
        if op == "tick":
            clock.advance(0.001)
        else:
            events += _apply(w, op, pick).events
    seen: dict[str, SimEvent] = {}
    for e in events:
        first = seen.setdefault(e.event_id, e)
        assert first is e, f"made twice: {_describe(first)} and {_describe(e)}"
    assert all(reference_event_id(e.pdu) == e.event_id for e in events)


# --- the store: a duplicate is one clear line, not the database's dump ----------------


async def test_store_names_a_duplicate_event_in_one_line(
    engine: AsyncEngine, clock: FakeClock
) -> None:
    w = _world()
    store = SimStore(engine, RecordingPublisher(), clock)
    room, created = w.create_room()
    await store.persist(created)
    message = w.send_message(room)
    await store.persist(message)
    [event] = message.events

    for duplicate in (message, Batch(events=[*w.send_message(room).events, event])):
        with pytest.raises(DuplicateEventError) as raised:  # already stored
            await store.persist(duplicate)
        assert raised.value.event_id == event.event_id
        assert event.event_id in str(raised.value) and "\n" not in str(raised.value)

    twice = w.send_message(room)
    with pytest.raises(DuplicateEventError) as raised:  # twice in one batch
        await store.persist(Batch(events=twice.events * 2))
    assert raised.value.event_id == twice.events[0].event_id

    # Another unique violation is not called a duplicate event.
    with pytest.raises(IntegrityError):
        await store.persist(Batch(partial_state_added=[room, room]))
    await store.persist(w.send_message(room))  # and the store goes on
