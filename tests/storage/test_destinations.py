from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.storage import catchup as cu
from federation_sender.storage import destinations as dst
from federation_sender.storage import schema as s
from federation_sender.testing.queue_writer import HomeserverWriter


async def test_upsert_destination_rooms_keeps_the_highest(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await dst.upsert_destination_rooms(conn, [("a", "!r", 5), ("a", "!r", 3), ("b", "!r", 4)])
        await dst.upsert_destination_rooms(conn, [("a", "!r", 2), ("a", "!s", 9)])
        rows = (await conn.execute(select(s.destination_rooms).order_by(
            s.destination_rooms.c.destination, s.destination_rooms.c.room_id))).all()
        assert [tuple(r) for r in rows] == [("a", "!r", 5), ("a", "!s", 9), ("b", "!r", 4)]
        names = (await conn.execute(select(s.destinations.c.destination))).scalars().all()
        assert sorted(names) == ["a", "b"]


async def test_retry_interval_never_moves_backwards_except_reset(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await dst.set_retry_timings(conn, "a", 10, 10, 600_000)
        await dst.set_retry_timings(conn, "a", 10, 5, 300_000)  # a stale writer
        row = await dst.get_destination(conn, "a")
        assert row is not None and row.retry_interval == 600_000 and row.retry_last_ts == 10
        await dst.set_retry_timings(conn, "a", 10, 20, 600_000)  # another attempt, capped
        row = await dst.get_destination(conn, "a")
        assert row is not None and row.retry_interval == 600_000 and row.retry_last_ts == 20
        await dst.set_retry_timings(conn, "a", 10, 30, 1_200_000)
        assert (await dst.get_destination(conn, "a")).retry_interval == 1_200_000  # type: ignore[union-attr]
        await dst.set_retry_timings(conn, "a", None, 40, 0)
        row = await dst.get_destination(conn, "a")
        assert row is not None and row.retry_interval == 0 and row.failure_ts is None
        await dst.set_retry_timings(conn, "b", 1, 1, 5)
        assert await dst.clear_retry(conn, "b")
        assert not await dst.clear_retry(conn, "b")


async def test_last_successful_only_moves_forwards(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await dst.set_last_successful_stream_ordering(conn, "a", 10)
        await dst.set_last_successful_stream_ordering(conn, "a", 7)
        row = await dst.get_destination(conn, "a")
        assert row is not None and row.last_successful_stream_ordering == 10
        got = await dst.get_destinations(conn, ["a", "zz"])
        assert list(got) == ["a"]


async def test_catchup_rows_keyset_and_pruning(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await dst.upsert_destination_rooms(
            conn, [("d", "!a", 5), ("d", "!b", 5), ("d", "!c", 3), ("d", "!z", 1), ("e", "!a", 9)])
        assert await cu.catchup_rows(conn, "d", 1, 10) == [("!c", 3), ("!a", 5), ("!b", 5)]
        assert await cu.catchup_rows(conn, "d", 1, 1, "") == [("!z", 1)]
        assert await cu.catchup_rows(conn, "d", 5, 10, "!a") == [("!b", 5)]
        assert await cu.catchup_rows(conn, "d", -1, 2) == [("!z", 1), ("!c", 3)]
        await dst.delete_destination_rooms(conn, "d", [("!a", 5), ("!b", 4)])
        assert await cu.catchup_rows(conn, "d", 1, 10) == [("!c", 3), ("!b", 5)]


async def test_wakeup_page_finds_outstanding_work_without_backoff(engine: AsyncEngine) -> None:
    w = HomeserverWriter(engine)
    async with engine.begin() as conn:
        await dst.upsert_destination_rooms(conn, [("behind", "!r", 5), ("done", "!r", 5),
                                                  ("backoff", "!r", 5), ("expired", "!r", 5)])
        await dst.set_last_successful_stream_ordering(conn, "done", 5)
        await dst.set_last_successful_stream_ordering(conn, "behind", 3)
        await dst.set_retry_timings(conn, "backoff", 0, 1000, 600_000)
        await dst.set_retry_timings(conn, "expired", 0, 1000, 10)
        await dst.ensure_destinations(conn, ["outbox", "nothing"])
    await w.to_device("outbox", {"x": 1})
    async with engine.begin() as conn:
        page = await dst.destinations_with_outstanding_work(conn, None, 10, now_ms=5000)
        assert page == [("behind", 3), ("expired", None), ("outbox", None)]
        assert await dst.destinations_with_outstanding_work(conn, None, 2, 5000) == [
            ("behind", 3), ("expired", None)]
        assert await dst.destinations_with_outstanding_work(conn, "expired", 2, 5000) == [
            ("outbox", None)]
