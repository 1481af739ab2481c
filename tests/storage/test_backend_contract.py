"""What ANY storage backend must do, stated once through the Protocols of
``storage/protocols.py`` and run against every backend we have (``subject`` in
``conftest.py``: native on SQLite and PostgreSQL, Synapse on a schema Synapse made).

These tests need no main-process rows beyond bare events (``Subject.events_exist``);
the ones that do are in ``test_backend_contract_main_rows.py``. Nothing here reads a
table but the batch jobs' driver (``storage/batch_reads.py``), whose reads are plain
DB-API.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from contract_support import Subject

from federation_sender.model import (
    EVENTS_STREAM,
    FEDERATION_STREAM,
    DestinationOrder,
    Direction,
    TxnLogRow,
)
from federation_sender.storage import batch_reads
from federation_sender.storage.batch_apply import BatchCounts, StagedChange
from federation_sender.storage.protocols import Tx


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

    async def page(after: int, room: str | None, limit: int,
                   skip: tuple[str, ...] = ()) -> list[tuple[str, int]]:
        async def fn(tx: Tx) -> list[tuple[str, int]]:
            return await tx.catchup.catchup_rows("d.test", after, limit, room, skip)

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
    # A read beside rooms whose pages wait (issue #44): none of their rows.
    assert await page(-1, None, 100, ("!a:l", "!e:l")) == [
        e for e in expected if e[0] not in ("!a:l", "!e:l")]
    assert await page(3, "!a:l", 2, ("!b:l",)) == [("!c:l", 3), ("!f:l", 5)]


async def test_destination_retry_timings_round_trip_and_only_lengthen(subject: Subject) -> None:
    async def writes(tx: Tx) -> None:
        await tx.destinations.set_retry_timings("a.test", 100, 200, 600_000)
        # A stale writer (an older attempt) cannot shorten the backoff.
        await tx.destinations.set_retry_timings("a.test", 100, 150, 300_000)
        await tx.destinations.set_retry_timings("a.test", 100, 250, 1_200_000)  # longer: kept
        # Another attempt at the capped interval: retry_last_ts moves (as Synapse's).
        await tx.destinations.set_retry_timings("a.test", 100, 300, 1_200_000)
        await tx.destinations.set_retry_timings("b.test", None, 50, 5)

    await subject.run(writes)

    async def get(tx: Tx) -> tuple[Any, ...]:
        a = await tx.destinations.get_destination("a.test")
        b = await tx.destinations.get_destination("b.test")
        return a, b, await tx.destinations.get_destination("nowhere.test")

    a, b, none = await subject.run(get)
    assert (a.retry_last_ts, a.retry_interval, a.failure_ts) == (300, 1_200_000, 100)
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


async def test_a_position_moves_forwards_only_over_the_value_its_queue_knows(
        subject: Subject) -> None:
    """The group commit's positions, ``(destination, position, before)``, are written only
    where the stored position is ``before`` (-1: none, and then a missing row is made):
    one a batch repair lowered meanwhile stays lowered (the queue reads it again at the
    next wake-up sweep) rather than being raised past the events the repair found lost."""
    async def writes(tx: Tx) -> None:
        await tx.destinations.set_last_successful_many([("a.test", 10, -1), ("b.test", 20, -1)])
        await tx.destinations.ensure_destinations(["c.test"])
        # Two writes of one queue in one group commit chain; a stale one is refused.
        await tx.destinations.set_last_successful_many([
            ("a.test", 12, 10), ("a.test", 15, 12), ("c.test", 3, -1), ("b.test", 18, 10)])
        # A repair lowers b from 20 to 8; b's queue, which knows 20, then writes 25.
        await tx.destinations.apply_batch([("b.test", None, 8, "position")], 100)
        await tx.destinations.set_last_successful_many([("b.test", 25, 20), ("gone", 4, 7)])

    await subject.run(writes)

    async def reads(tx: Tx) -> dict[str, int | None]:
        rows = await tx.destinations.get_destinations(["a.test", "b.test", "c.test", "gone"])
        return {d: r.last_successful_stream_ordering for d, r in rows.items()}

    assert await subject.run(reads) == {"a.test": 15, "b.test": 8, "c.test": 3}

    async def after_the_read(tx: Tx) -> None:  # the queue read 8: its writes apply again
        await tx.destinations.set_last_successful_many([("b.test", 9, 8), ("a.test", 14, 15)])

    await subject.run(after_the_read)
    rows = await subject.run(reads)
    assert (rows["b.test"], rows["a.test"]) == (9, 15)


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


BATCH_CHANGES: list[StagedChange] = [
    ("d1", "!a", 8, "upsert"),  # stored 5 <= 10: replaced
    ("d1", "!b", 9, "upsert"),  # stored 20 > 10: the worker's newer row stays
    ("d2", "!c", None, "delete"),  # stored 3 <= 10: deleted
    ("d1", "!b", None, "delete"),  # stored 20 > 10: stays
    ("d1", None, 7, "position"),  # 10 lowered to 7
    ("d3", None, 6, "position"),  # 4 is lower already: kept
    ("d2", None, 1, "position"),  # no position stored: set
    ("d4", None, 2, "position"),  # no row: created
]


async def _batch_case(
    subject: Subject, apply: Callable[[], Awaitable[BatchCounts]]
) -> None:
    """The batch rule, whichever way the changes (``BATCH_CHANGES``, high-water mark 10)
    arrive: rows are upserted or deleted only while their stored stream ordering is at
    most the job's high-water mark; positions are only lowered, or set where none is
    stored."""
    await subject.events_exist([("!a", 5), ("!a", 8), ("!b", 20), ("!c", 3)])

    async def setup(tx: Tx) -> None:
        await tx.destinations.upsert_destination_rooms(
            [("d1", "!a", 5), ("d1", "!b", 20), ("d2", "!c", 3)]
        )
        await tx.destinations.set_last_successful_many([("d1", 10, -1), ("d3", 4, -1)])

    await subject.run(setup)
    assert tuple(await apply()) == (1, 1, 3)

    async def reads(tx: Tx) -> tuple[Any, ...]:
        rows = await tx.destinations.get_destinations(["d1", "d2", "d3", "d4"])
        return (
            await tx.catchup.catchup_rows("d1", -1, 10),
            await tx.catchup.catchup_rows("d2", -1, 10),
            {d: r.last_successful_stream_ordering for d, r in rows.items()},
        )

    assert await subject.run(reads) == (
        [("!a", 8), ("!b", 20)], [], {"d1": 7, "d2": 1, "d3": 4, "d4": 2},
    )


async def test_batch_apply_stops_at_the_high_water_mark_and_only_lowers_positions(
    subject: Subject,
) -> None:
    """The embedded database's path of ``batch/io.py``: the collected rows through
    ``apply_batch`` (staged in a temporary table of the transaction)."""
    await _batch_case(
        subject, lambda: subject.run(lambda tx: tx.destinations.apply_batch(BATCH_CHANGES, 10))
    )


@pytest.mark.parametrize(
    "subject", ["native-postgresql", "synapse-postgresql"], indirect=True
)
async def test_batch_staged_apply_reads_the_executors_staging_table(
    subject: Subject,
) -> None:
    """PostgreSQL's path of ``batch/io.py``: the driver makes the UNLOGGED staging table
    (``storage/batch_reads.py``), the executors append to it over JDBC (plain INSERTs
    here), ``apply_staged_batch`` applies it under the same rule, and the driver drops
    it."""
    name = "batch_staging_contract"
    with psycopg.connect(subject.url.replace("+psycopg", ""), autocommit=True) as conn:
        batch_reads.create_staging_table(conn, name)
        with conn.cursor() as cur:
            cur.executemany(
                f"INSERT INTO {name} (destination, room_id, stream_ordering, action)"
                " VALUES (%s, %s, %s, %s)", BATCH_CHANGES,
            )
        await _batch_case(
            subject,
            lambda: subject.run(lambda tx: tx.destinations.apply_staged_batch(name, 10)),
        )
        assert batch_reads.column_bounds(conn, "destination_rooms", "stream_ordering") == (
            8, 20,
        )
        batch_reads.drop_staging_table(conn, name)
        assert conn.execute("SELECT to_regclass(%s)", (name,)).fetchone() == (None,)
