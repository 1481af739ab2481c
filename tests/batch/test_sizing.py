"""A run sized from its data (issue #47): partitions and a local driver's memory from the
big tables' row counts, read before Spark starts."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sqlite3
from pathlib import Path

import psycopg
import pytest

from federation_sender.batch import cli
from federation_sender.batch.io import Database
from federation_sender.batch.sizing import (
    DRIVER_BASE_MB,
    MAX_PARTITIONS,
    ROWS_PER_PARTITION,
    available_mb,
    driver_mb_for,
    partitions_for,
    size_run,
)
from federation_sender.storage import batch_reads
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade


def test_partitions_are_two_per_core_and_grow_with_the_rows() -> None:
    assert partitions_for(0, 2) == 4
    assert partitions_for(ROWS_PER_PARTITION * 4, 2) == 4
    assert partitions_for(ROWS_PER_PARTITION * 4 + 1, 2) == 5
    assert partitions_for(35_000_000, 2) == 24
    assert partitions_for(10**12, 2) == MAX_PARTITIONS
    assert partitions_for(10**12, 64) == 128  # two per core beats the cap


def test_the_driver_grows_with_the_rows_to_the_nearest_256_mb() -> None:
    assert driver_mb_for(0) == DRIVER_BASE_MB
    assert driver_mb_for(1_000_000) == DRIVER_BASE_MB
    assert driver_mb_for(2_000_000) == 1280
    assert driver_mb_for(35_000_000) == 4608
    assert all(driver_mb_for(n) % 256 == 0 for n in range(0, 10**8, 3_333_333))


def test_a_machine_with_less_memory_gets_what_it_has_and_one_line_says_so() -> None:
    ample = size_run(35_000_000, 2, local=True, driver_memory_given=False, available=20_000)
    assert ample.driver_mb == 4608 and ample.shortfall() is None
    short = size_run(35_000_000, 2, local=True, driver_memory_given=False, available=3000)
    assert short.driver_mb == 1280 and short.wanted_mb == 4608  # half of what is there
    line = short.shortfall()
    assert line is not None and "\n" not in line
    assert "4.5 GB" in line and "2.9 GB available" in line and "gets 1.2 GB" in line
    # Never below Spark's own default, even on a tiny machine.
    assert size_run(35_000_000, 2, local=True, driver_memory_given=False,
                    available=500).driver_mb == DRIVER_BASE_MB


def test_the_memory_is_not_ours_to_set_on_a_cluster_or_when_given() -> None:
    assert size_run(10**7, 2, local=False, driver_memory_given=False,
                    available=None).driver_mb is None
    assert size_run(10**7, 2, local=True, driver_memory_given=True,
                    available=None).driver_mb is None
    assert size_run(10**7, 2, local=True, driver_memory_given=False,
                    available=None).driver_mb == driver_mb_for(10**7)


def test_available_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemAvailable:   12582912 kB\n")
    assert available_mb(f) == 12288
    f.write_text("MemTotal: 1 kB\n")
    assert available_mb(f) is None
    assert available_mb(tmp_path / "absent") is None


def _args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {"snapshot": None, "partitions": None, "master": None,
                               "remote": None, "synapse_config": None}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.postgres
def test_the_row_counts_come_from_postgresql_before_spark(pg_url: str) -> None:
    async def migrate() -> None:
        engine = create_engine(pg_url)
        await upgrade(engine)
        await engine.dispose()

    asyncio.run(migrate())
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("INSERT INTO destination_rooms (destination, room_id, stream_ordering)"
                     " SELECT 'd' || i, '!r:x', i FROM generate_series(1, 3000) i")
        # Never analyzed: an exact count.
        db = Database.from_urls(pg_url, None)
        with db.read() as read:
            assert batch_reads.estimated_rows(read, ["destination_rooms", "events"],
                                              sqlite=False) == 3000
        conn.execute("ANALYZE destination_rooms")
    with db.read() as read:
        assert batch_reads.estimated_rows(read, ["destination_rooms", "no_such_table"],
                                          sqlite=False) == 3000
    sized = cli._size(_args(), db, {})
    assert sized is not None and sized.rows == 3000
    assert sized.driver_mb == DRIVER_BASE_MB and sized.partitions >= 4
    assert cli._size(_args(), db, {"spark.driver.memory": "2g"}).driver_mb is None  # type: ignore[union-attr]
    assert cli._size(_args(partitions=3), db, {"spark.driver.memory": "2g"}) is None
    assert cli._size(_args(snapshot="/x"), db, {}) is None
    on_cluster = cli._size(_args(master="spark://127.0.0.1:7077"), db, {})
    assert on_cluster is not None and on_cluster.driver_mb is None


def test_sqlite_counts_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "x.db"
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("CREATE TABLE events (stream_ordering INTEGER)")
        conn.executemany("INSERT INTO events VALUES (?)", [(i,) for i in range(7)])
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        assert batch_reads.estimated_rows(conn, ["events", "destination_rooms",
                                                 "federation_sender.x"], sqlite=True) == 7


@pytest.mark.parametrize(("master", "cores"), [
    ("local", None), ("local[3]", 3), ("local[3,2]", 3), ("local-cluster[2,1,1024]", None),
    ("spark://h:7077", None)])
def test_local_cores(master: str, cores: int | None) -> None:
    got = cli._local_cores(master)
    if master == "local":
        assert got is not None and got >= 1
    else:
        assert got == cores
