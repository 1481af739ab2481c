"""What ANY storage backend must do, stated once through the Protocols of
``storage/protocols.py`` and run against every backend we have.

Each test only uses ``Backend.run`` and, where the main process's rows are needed, a
writer standing in for it (the ``MainWriter`` below: events, memberships, extremities,
outbox rows); nothing here reads a table. Backends:

* ``native-sqlite``, ``native-postgresql``: every test (``HomeserverWriter`` writes the
  main process's rows);
* ``synapse-postgresql``: the Synapse backend on a schema Synapse made itself, for the
  tests that need no main-process rows (``subject``); the others (``seeded``) wait for a
  writer into Synapse's tables (Synapse's own events are covered by ``tests/synapse``).

A new backend joins by adding a case to :func:`_open`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.model import (
    EVENTS_STREAM,
    FEDERATION_STREAM,
    DestinationOrder,
    Direction,
    TxnLogRow,
)
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.storage.native import NativeBackend
from federation_sender.storage.protocols import Backend, Tx
from federation_sender.synapse.backend import SynapseBackend
from federation_sender.synapse.config import SynapseConfig
from federation_sender.synapse.database import create_synapse_engine, upgrade_own_schema
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.queue_writer import HomeserverWriter, WrittenEvent
from tests.synapse.backend_support import (  # noqa: F401 (fixtures)
    synapse_db_url_fixture,
    synapse_template_fixture,
)

T = TypeVar("T")
ME = "local.test"


class MainWriter(Protocol):
    """The main process's writes the contract needs (``HomeserverWriter`` natively)."""

    async def membership(
        self, room_id: str, user_id: str, membership: str, sender: str | None = None
    ) -> WrittenEvent: ...

    async def message(self, room_id: str, sender: str) -> WrittenEvent: ...

    async def set_extremities(self, room_id: str, event_ids: Sequence[str]) -> None: ...

    async def mark_partial_state(self, room_id: str) -> None: ...

    async def to_device(self, destination: str, content: dict[str, Any]) -> int: ...

    async def device_list(self, destination: str, user_id: str, device_id: str) -> int: ...


async def _nothing(_events: Sequence[tuple[str, int]]) -> None:
    return None


@dataclass
class Subject:
    backend: Backend
    main: MainWriter | None
    events_exist: Callable[[Sequence[tuple[str, int]]], Awaitable[None]] = _nothing
    """Make (room_id, stream_ordering) events and their rooms exist, as the main process
    does before the fan-out records them in ``destination_rooms``: Synapse's
    ``destination_rooms`` refers to ``rooms`` and its catch-up reads join ``events``.
    Nothing to do natively."""

    async def run(self, fn: Callable[[Tx], Awaitable[T]]) -> T:
        return await self.backend.run(fn)


@dataclass
class Seeded(Subject):
    main: MainWriter


def _synapse_config(instance: str) -> SynapseConfig:
    return SynapseConfig(
        server_name=ME, database_url="", redis_url="", signing_key_path="",
        worker_name=instance, federation_sender_instances=(instance,),
        federation_domain_whitelist=None, ip_range_blacklist=(), ip_range_whitelist=(),
        verify_tls=True, extra_ca_file=None, min_retry_interval_ms=600_000,
        retry_multiplier=2.0, max_retry_interval_ms=7 * 86_400_000,
    )


@asynccontextmanager
async def _open(kind: str, request: pytest.FixtureRequest) -> AsyncIterator[Subject]:
    if kind.startswith("native-"):
        url = request.getfixturevalue("sqlite_url" if kind.endswith("sqlite") else "pg_url")
        engine = create_engine(str(url))
        await upgrade(engine)
        try:
            yield Seeded(NativeBackend(engine), await HomeserverWriter(engine, ME).init())
        finally:
            await engine.dispose()
        return
    engine = create_synapse_engine(str(request.getfixturevalue("synapse_db_url")))
    await upgrade_own_schema(engine)

    backend = SynapseBackend(engine, _synapse_config("fed1"), "fed1", FakeClock())
    try:
        yield Subject(backend, None, lambda evs: _synapse_events(engine, evs))
    finally:
        await engine.dispose()


async def _synapse_events(engine: AsyncEngine, events: Sequence[tuple[str, int]]) -> None:
    """Bare rooms and message events in Synapse's tables (one event per stream
    ordering: the first room given with it)."""
    first: dict[int, str] = {}
    for room_id, so in events:
        first.setdefault(so, room_id)
    async with engine.begin() as conn:
        for room_id in dict.fromkeys(r for r, _ in events):
            await conn.execute(text(
                "INSERT INTO rooms (room_id, is_public, creator, room_version)"
                " SELECT :r, false, :c, '10' WHERE NOT EXISTS"
                " (SELECT 1 FROM rooms WHERE room_id = :r)"), {"r": room_id, "c": f"@c:{ME}"})
        for so, room_id in first.items():
            event_id = f"$contract{so}"
            await conn.execute(text(
                "INSERT INTO events (topological_ordering, event_id, type, room_id, processed,"
                " outlier, depth, origin_server_ts, received_ts, sender, instance_name,"
                " stream_ordering) VALUES (:so, :e, 'm.room.message', :r, true, false, :so,"
                " :so, :so, :c, 'master', :so)"), {"so": so, "e": event_id, "r": room_id,
                                                   "c": f"@c:{ME}"})
            pdu = {"event_id": event_id, "room_id": room_id, "type": "m.room.message",
                   "sender": f"@c:{ME}", "depth": so, "content": {}}
            await conn.execute(text(
                "INSERT INTO event_json (event_id, room_id, internal_metadata, json,"
                " format_version) VALUES (:e, :r, '{}', :j, 3)"),
                {"e": event_id, "r": room_id, "j": json.dumps(pdu)})


@pytest.fixture(params=["native-sqlite", "native-postgresql", "synapse-postgresql"])
async def subject(request: pytest.FixtureRequest) -> AsyncIterator[Subject]:
    """Any backend (the test needs no main-process rows)."""
    async with _open(request.param, request) as s:
        yield s


@pytest.fixture(params=["native-sqlite", "native-postgresql"])
async def seeded(request: pytest.FixtureRequest) -> AsyncIterator[Seeded]:
    """A backend with a writer of the main process's rows."""
    async with _open(request.param, request) as s:
        assert isinstance(s, Seeded)
        yield s


async def test_positions_are_keyed_by_stream_and_instance_and_never_move_back(
    subject: Subject,
) -> None:
    async def writes(tx: Tx) -> None:
        assert await tx.positions.load(EVENTS_STREAM, "w1") is None
        await tx.positions.save(EVENTS_STREAM, "w1", 5)
        await tx.positions.save(EVENTS_STREAM, "w1", 3)  # a late writer
        await tx.positions.save(FEDERATION_STREAM, "w1", 2)
        await tx.positions.save(EVENTS_STREAM, "w2", 1)

    await subject.run(writes)

    async def reads(tx: Tx) -> list[int | None]:
        return [
            await tx.positions.load(EVENTS_STREAM, "w1"),
            await tx.positions.load(FEDERATION_STREAM, "w1"),
            await tx.positions.load(EVENTS_STREAM, "w2"),
            await tx.positions.load(FEDERATION_STREAM, "w2"),
        ]

    assert await subject.run(reads) == [5, 2, 1, None]

    async def forward(tx: Tx) -> int | None:
        await tx.positions.save(EVENTS_STREAM, "w1", 9)
        return await tx.positions.load(EVENTS_STREAM, "w1")

    assert await subject.run(forward) == 9


async def test_replication_positions_per_reader_writer_and_stream(subject: Subject) -> None:
    async def writes(tx: Tx) -> None:
        await tx.positions.save_replication("fed1", "events", "master", 10)
        await tx.positions.save_replication("fed1", "events", "master", 7)  # stale
        await tx.positions.save_replication("fed1", "events", "persister2", 4)
        await tx.positions.save_replication("fed1", "to_device", "master", 3)
        await tx.positions.save_replication("fed2", "events", "master", 99)

    await subject.run(writes)

    async def reads(tx: Tx) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
        return (
            await tx.positions.load_replication("fed1"),
            await tx.positions.load_replication("nobody"),
        )

    fed1, nobody = await subject.run(reads)
    assert fed1 == {("events", "master"): 10, ("events", "persister2"): 4,
                    ("to_device", "master"): 3}
    assert nobody == {}


async def test_a_failed_transaction_writes_nothing(subject: Subject) -> None:
    """Invariant 1 rests on this: destination_rooms and the position commit together."""

    class Boom(Exception):
        pass

    async def half(tx: Tx) -> None:
        await tx.destinations.upsert_destination_rooms([("a.test", "!r:l", 5)])
        await tx.positions.save(EVENTS_STREAM, "w1", 5)
        raise Boom

    await subject.events_exist([("!r:l", 5)])
    with pytest.raises(Boom):
        await subject.run(half)

    async def reads(tx: Tx) -> tuple[int | None, list[tuple[str, int]], list[str]]:
        return (
            await tx.positions.load(EVENTS_STREAM, "w1"),
            await tx.catchup.catchup_rows("a.test", -1, 10),
            await tx.destinations.destinations_behind(),
        )

    assert await subject.run(reads) == (None, [], [])


async def test_destination_rooms_upsert_keeps_the_highest_and_prunes_exactly(
    subject: Subject,
) -> None:
    await subject.events_exist([("!r:l", 2), ("!r:l", 3), ("!r:l", 4), ("!r:l", 5),
                                ("!s:l", 9)])

    async def writes(tx: Tx) -> None:
        await tx.destinations.upsert_destination_rooms(
            [("a.test", "!r:l", 5), ("a.test", "!r:l", 3), ("b.test", "!r:l", 4)]
        )
        await tx.destinations.upsert_destination_rooms(
            [("a.test", "!r:l", 2), ("a.test", "!s:l", 9)]
        )

    await subject.run(writes)

    async def rows(tx: Tx) -> dict[str, list[tuple[str, int]]]:
        return {d: await tx.catchup.catchup_rows(d, -1, 10) for d in ("a.test", "b.test")}

    assert await subject.run(rows) == {
        "a.test": [("!r:l", 5), ("!s:l", 9)],
        "b.test": [("!r:l", 4)],
    }

    async def created(tx: Tx) -> set[str]:
        return set(await tx.destinations.get_destinations(["a.test", "b.test", "c.test"]))

    assert await subject.run(created) == {"a.test", "b.test"}

    async def prune(tx: Tx) -> None:
        # The (!r, 4) row is stale for a.test (it is at 5 now): kept; (!s, 9) goes.
        await tx.destinations.delete_destination_rooms("a.test", [("!r:l", 4), ("!s:l", 9)])

    await subject.run(prune)
    assert (await subject.run(rows))["a.test"] == [("!r:l", 5)]


async def test_catchup_rows_page_by_keyset_strictly_past_the_cursor(subject: Subject) -> None:
    # Ties on stream ordering (one event fans out to several rooms is impossible, but
    # rows of different rooms can carry equal orderings after pruning and re-upserts).
    entries = [("!b:l", 3), ("!a:l", 3), ("!c:l", 3), ("!d:l", 1), ("!e:l", 7), ("!f:l", 5)]
    await subject.events_exist(entries)

    async def writes(tx: Tx) -> None:
        await tx.destinations.upsert_destination_rooms([("d.test", r, so) for r, so in entries])

    await subject.run(writes)
    expected = sorted(entries, key=lambda e: (e[1], e[0]))

    async def page(after: int, room: str | None, limit: int) -> list[tuple[str, int]]:
        async def fn(tx: Tx) -> list[tuple[str, int]]:
            return await tx.catchup.catchup_rows("d.test", after, limit, room)

        return await subject.run(fn)

    assert await page(-1, None, 100) == expected
    assert await page(3, None, 100) == [("!f:l", 5), ("!e:l", 7)]
    assert await page(3, "!a:l", 100) == [("!b:l", 3), ("!c:l", 3), ("!f:l", 5), ("!e:l", 7)]
    walked: list[tuple[str, int]] = []
    cursor: tuple[int, str | None] = (-1, None)
    while got := await page(cursor[0], cursor[1], 2):
        assert len(got) <= 2
        walked.extend(got)
        cursor = (got[-1][1], got[-1][0])
    assert walked == expected


async def test_destination_retry_timings_round_trip_and_only_lengthen(subject: Subject) -> None:
    async def writes(tx: Tx) -> None:
        await tx.destinations.set_retry_timings("a.test", 100, 200, 600_000)
        # A stale writer (an older attempt) cannot shorten the backoff.
        await tx.destinations.set_retry_timings("a.test", 100, 150, 300_000)
        await tx.destinations.set_retry_timings("a.test", 100, 250, 1_200_000)  # longer: kept
        await tx.destinations.set_retry_timings("b.test", None, 50, 5)

    await subject.run(writes)

    async def get(tx: Tx) -> tuple[Any, ...]:
        a = await tx.destinations.get_destination("a.test")
        b = await tx.destinations.get_destination("b.test")
        return a, b, await tx.destinations.get_destination("nowhere.test")

    a, b, none = await subject.run(get)
    assert (a.retry_last_ts, a.retry_interval, a.failure_ts) == (250, 1_200_000, 100)
    assert (b.retry_last_ts, b.retry_interval, b.failure_ts) == (50, 5, None)
    assert none is None

    async def reset(tx: Tx) -> tuple[bool, bool, Any]:
        first = await tx.destinations.clear_retry("a.test")
        second = await tx.destinations.clear_retry("a.test")
        return first, second, await tx.destinations.get_destination("a.test")

    first, second, a = await subject.run(reset)
    assert (first, second) == (True, False)
    assert not a.backing_off and a.retry_interval == 0

    async def explicit_reset(tx: Tx) -> Any:
        await tx.destinations.set_retry_timings("b.test", None, 60, 0)
        return await tx.destinations.get_destination("b.test")

    assert (await subject.run(explicit_reset)).retry_interval == 0

    async def reset_many(tx: Tx) -> list[Any]:
        await tx.destinations.set_retry_timings("a.test", 100, 400, 600_000)
        await tx.destinations.set_retry_timings("b.test", 100, 400, 600_000)
        await tx.destinations.clear_retry_many({"a.test", "nowhere.test"})
        await tx.destinations.clear_retry_many(set())
        return [await tx.destinations.get_destination(d) for d in ("a.test", "b.test")]

    a, b = await subject.run(reset_many)
    assert a.retry_interval == 0 and a.failure_ts is None
    assert b.retry_interval == 600_000  # only the destinations named


async def test_last_successful_only_moves_forwards(subject: Subject) -> None:
    async def writes(tx: Tx) -> None:
        await tx.destinations.set_last_successful_many([("a.test", 10), ("b.test", 4)])
        await tx.destinations.set_last_successful_many([("a.test", 7), ("a.test", 12),
                                                        ("b.test", 3)])

    await subject.run(writes)

    async def reads(tx: Tx) -> dict[str, int | None]:
        rows = await tx.destinations.get_destinations(["a.test", "b.test"])
        return {d: r.last_successful_stream_ordering for d, r in rows.items()}

    assert await subject.run(reads) == {"a.test": 12, "b.test": 4}


async def test_wakeup_sweep_and_behind(seeded: Seeded) -> None:
    now = 10_000_000
    await seeded.main.to_device("outbox.test", {"m": 1})

    async def writes(tx: Tx) -> None:
        await tx.destinations.ensure_destinations(["outbox.test", "idle.test"])
        await tx.destinations.upsert_destination_rooms([
            ("behind.test", "!r:l", 5), ("caught-up.test", "!r:l", 5),
            ("backing-off.test", "!r:l", 5), ("expired.test", "!r:l", 5),
        ])
        await tx.destinations.set_last_successful_many([("caught-up.test", 5)])
        await tx.destinations.set_retry_timings("backing-off.test", 0, now - 10, 600_000)
        await tx.destinations.set_retry_timings("expired.test", 0, now - 10, 5)

    await seeded.run(writes)

    async def sweep(tx: Tx) -> tuple[list[str], list[str], list[str]]:
        return (
            await tx.destinations.destinations_with_outstanding_work(None, 2, now),
            await tx.destinations.destinations_with_outstanding_work("expired.test", 2, now),
            sorted(await tx.destinations.destinations_behind()),
        )

    page1, page2, behind = await seeded.run(sweep)
    assert page1 + page2 == ["behind.test", "expired.test", "outbox.test"]
    assert behind == ["backing-off.test", "behind.test", "expired.test"]


async def test_outbox_reads_past_a_stream_id_until_acknowledged(seeded: Seeded) -> None:
    td = [await seeded.main.to_device("a.test", {"n": i}) for i in range(3)]
    dl = [await seeded.main.device_list("a.test", "@u:local.test", f"D{i}") for i in range(2)]
    await seeded.main.device_list("b.test", "@v:local.test", "DV")

    async def unsent(after_td: int, after_dl: int, limit: int = 10) -> tuple[Any, Any]:
        async def fn(tx: Tx) -> tuple[Any, Any]:
            return await tx.outbox.unsent_outbox("a.test", after_td, after_dl, limit)

        return await seeded.run(fn)

    t, d = await unsent(-1, -1)
    assert [r.stream_id for r in t] == td and [r.stream_id for r in d] == dl
    assert [(r.user_id, r.device_id) for r in d] == [("@u:local.test", "D0"),
                                                    ("@u:local.test", "D1")]
    t, d = await unsent(td[0], dl[0])
    assert [r.stream_id for r in t] == td[1:] and [r.stream_id for r in d] == dl[1:]
    t, d = await unsent(-1, -1, limit=1)
    assert [r.stream_id for r in t] == td[:1] and [r.stream_id for r in d] == dl[:1]

    async def dests(tx: Tx) -> list[str]:
        return sorted(await tx.outbox.device_list_destinations(["@u:local.test", "@v:local.test"]))

    assert await seeded.run(dests) == ["a.test", "b.test"]

    async def ack(tx: Tx) -> None:
        await tx.outbox.ack_to_device("a.test", td[:2], 1)
        await tx.outbox.ack_device_lists("a.test", [(dl[0], "@u:local.test", "D0")])

    await seeded.run(ack)
    t, d = await unsent(-1, -1)
    assert [r.stream_id for r in t] == td[2:] and [r.stream_id for r in d] == dl[1:]

    async def ack_rest(tx: Tx) -> list[str]:
        await tx.outbox.ack_device_lists("a.test", [(dl[1], "@u:local.test", "D1")])
        return await tx.outbox.device_list_destinations(["@u:local.test", "@v:local.test"])

    assert await seeded.run(ack_rest) == ["b.test"]


async def test_events_reads(seeded: Seeded) -> None:
    async def top(tx: Tx) -> int:
        return await tx.events.max_stream_ordering()

    assert await seeded.run(top) == 0
    m = seeded.main
    await m.membership("!r:l", "@a:local.test", "join")
    msgs = [await m.message("!r:l", "@a:local.test") for _ in range(4)]
    other = await m.message("!s:l", "@a:local.test")
    await m.set_extremities("!r:l", [msgs[1].event_id, msgs[3].event_id])
    await m.mark_partial_state("!s:l")

    async def reads(tx: Tx) -> tuple[Any, ...]:
        return (
            await tx.events.max_stream_ordering(),
            await tx.events.events_after(msgs[0].stream_ordering, other.stream_ordering, 2),
            await tx.events.events_at([msgs[2].stream_ordering, 10_000]),
            await tx.events.room_events_between(
                ["!r:l", "!s:l", "!none:l"], msgs[0].stream_ordering, other.stream_ordering, 2
            ),
            await tx.events.forward_extremities(["!r:l"]),
            await tx.events.partial_state(["!r:l", "!s:l"]),
            await tx.events.sender_and_received_ts("!r:l", msgs[0].event_id),
            await tx.events.sender_and_received_ts("!r:l", other.event_id),
        )

    top_so, after, at, between, extremities, partial, meta, wrong_room = await seeded.run(reads)
    assert top_so == other.stream_ordering
    assert [e.event_id for e in after] == [msgs[1].event_id, msgs[2].event_id]
    assert list(at) == [msgs[2].stream_ordering]
    assert at[msgs[2].stream_ordering].room_id == "!r:l"
    assert at[msgs[2].stream_ordering].sender == "@a:local.test"
    assert {r: [e.event_id for e in evs] for r, evs in between.items()} == {
        "!r:l": [msgs[1].event_id, msgs[2].event_id], "!s:l": [other.event_id],
    }
    assert [e.event_id for e in extremities["!r:l"]] == [msgs[1].event_id, msgs[3].event_id]
    assert partial == {"!s:l"}
    assert meta is not None and meta[0] == "@a:local.test"
    assert wrong_room is None


async def test_hosts_of_an_event_and_now(seeded: Seeded) -> None:
    m = seeded.main
    await m.membership("!r:l", "@a:local.test", "join")
    await m.membership("!r:l", "@b:one.test", "join")
    await m.membership("!r:l", "@c:two.test", "join")
    await m.membership("!r:l", "@c:two.test", "leave")
    first = await m.message("!r:l", "@a:local.test")
    await m.membership("!r:l", "@d:three.test", "join")
    second = await m.message("!r:l", "@a:local.test")
    kick = await m.membership("!r:l", "@d:three.test", "leave", sender="@a:local.test")
    sos = [first.stream_ordering, second.stream_ordering, kick.stream_ordering]

    async def reads(tx: Tx) -> tuple[Any, Any]:
        rows = await tx.events.events_at(sos)
        return (await tx.hosts.hosts_for_events({"!r:l": [rows[so] for so in sos]}),
                await tx.hosts.current_hosts(["!r:l"]))

    at_events, now = await seeded.run(reads)
    one, two, kicked = at_events["!r:l"]
    assert "one.test" in one and "two.test" not in one and "three.test" not in one
    assert {"one.test", "three.test"} <= two and "two.test" not in two
    # A server whose last member is kicked receives its own kick.
    assert {"one.test", "three.test"} <= kicked
    assert "one.test" in now["!r:l"] and not {"two.test", "three.test"} & now["!r:l"]


async def test_server_membership_history_is_per_server_and_ascending(seeded: Seeded) -> None:
    m = seeded.main
    j = await m.membership("!r:l", "@b:one.test", "join")
    await m.membership("!r:l", "@x:other.test", "join")
    lv = await m.membership("!r:l", "@b:one.test", "leave")

    async def reads(tx: Tx) -> Any:
        return await tx.catchup.server_membership_history("one.test", ["!r:l", "!empty:l"])

    hist = await seeded.run(reads)
    assert hist["!empty:l"] == []
    assert [(r.stream_ordering, r.user_id, r.membership) for r in hist["!r:l"]] == [
        (j.stream_ordering, "@b:one.test", "join"), (lv.stream_ordering, "@b:one.test", "leave"),
    ]


def _log(txn: str, dest: str, ts: int, status: str = "success") -> TxnLogRow:
    return TxnLogRow(txn, dest, "w1", 2, 1, 300, status, 200 if status == "success" else None,
                     ts, 12, ts % 2 == 0, ts, (f"$a{ts}", f"$b{ts}"), None)


async def test_transaction_log_and_admin_reads(subject: Subject) -> None:
    rows = [_log("t1", "a.test", 1000), _log("t2", "a.test", 1001, "transient"),
            _log("t3", "b.test", 1002)]
    await subject.events_exist([("!r:l", 3)])

    async def writes(tx: Tx) -> None:
        await tx.txlog.log_transactions(rows)
        await tx.destinations.set_retry_timings("a.test", 5, 6, 600_000)
        await tx.destinations.ensure_destinations(["b.test", "c.test"])
        await tx.destinations.upsert_destination_rooms([("a.test", "!r:l", 3)])

    await subject.run(writes)

    async def reads(tx: Tx) -> tuple[Any, ...]:
        a = tx.admin
        return (
            await tx.txlog.recent_transactions("a.test"),
            await a.list_transactions("a.test", start=0, limit=10, status="transient"),
            await a.find_destination("c.test"),
            await a.find_destination("unknown.test"),
            await a.list_destinations(start=0, limit=2,
                                      order_by=DestinationOrder.RETRY_INTERVAL,
                                      direction=Direction.BACKWARDS),
            await a.list_destinations(start=0, limit=10, search="B.TE"),
            await a.list_destination_rooms("a.test", start=0, limit=10),
            await a.count_destinations_backing_off(),
        )

    recent, (transient, n_transient), never_failed, unknown, (by_interval, total), \
        (searched, n_searched), (dest_rooms, n_rooms), backing_off = await subject.run(reads)
    assert recent == [rows[1], rows[0]]  # newest first, every field round-tripped
    assert transient == [rows[1]] and n_transient == 1
    assert never_failed is not None and not never_failed.backing_off
    assert unknown is None
    assert [r.destination for r in by_interval] == ["a.test", "b.test"] and total == 3
    assert [r.destination for r in searched] == ["b.test"] and n_searched == 1
    assert dest_rooms == [("!r:l", 3)] and n_rooms == 1
    assert backing_off == 1
