"""The jobs end to end on a real PostgreSQL, through the CLI entry point, on the shared
local SparkSession."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import psycopg
import pytest

from federation_sender.batch.arguments import EXIT_FAILED, EXIT_FINDINGS, add_batch_parser
from federation_sender.batch.cli import run_batch
from federation_sender.batch.io import PARTITION_COLUMNS
from federation_sender.config import DatabaseSettings, Settings
from federation_sender.storage import batch_reads
from federation_sender.testing.clock import FakeClock

from .histories import (
    OUR,
    History,
    expected_destination_rooms,
    expected_diff,
    expected_health,
    expected_undelivered,
    load_pg,
    random_history,
    read_destination_rooms,
    read_positions,
    scenario,
    with_every_finding,
)

pytestmark = [pytest.mark.spark, pytest.mark.postgres]


def run(spark: Any, url: str, *argv: str) -> tuple[int, dict[str, Any]]:
    parser = argparse.ArgumentParser()
    add_batch_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["batch", *argv, "--json", "--quiet", "--partitions", "3"])
    settings = Settings(server_name=OUR, database=DatabaseSettings(url=url))
    out = io.StringIO()
    status = run_batch(args, settings, spark=spark, clock=FakeClock(), out=out)
    doc = json.loads(out.getvalue()) if out.getvalue() else {}
    return status, doc


def broken(h: History) -> History:
    """The scenario with a destination_rooms table in every state of disagreement, a row
    the worker wrote past the job's high-water mark, and a transaction log."""
    h.destination_rooms = dict(expected_destination_rooms(h))
    h.destination_rooms[("b.example", "!r1")] = 7          # behind
    h.destination_rooms[("c.example:8448", "!r1")] = 9     # ahead
    del h.destination_rooms[("b.example", "!r2")]          # missing
    h.destination_rooms[("b.example", "!gone")] = 5        # stale (purged room)
    h.destination_rooms[("z.example", "!new")] = 10_000    # newer than the job: untouchable
    h.send("b.example", ["$e5", "$e7"])
    h.send("c.example:8448", ["$e6"])
    h.destinations = {"b.example": 12, "c.example:8448": 26}
    return h


def _staging_tables(url: str) -> list[str]:
    with psycopg.connect(url.replace("+psycopg", "")) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE tablename LIKE "
                            "'batch_staging%'").fetchall()
    return [r[0] for r in rows]


def test_backfill_dry_run_then_apply_then_rerun(spark: Any, batch_db: str) -> None:
    h = broken(scenario())
    load_pg(h, batch_db)
    before = read_destination_rooms(batch_db)

    status, doc = run(spark, batch_db, "backfill-destination-rooms", "--dry-run")
    assert status == 0
    problems = list(expected_diff(h).values())
    s = doc["summary"]
    assert {p: s[p] for p in ("missing", "behind", "ahead", "stale")} == {
        p: problems.count(p) for p in ("missing", "behind", "ahead", "stale")}
    assert s["high_water_mark"] == h.high_water_mark
    assert read_destination_rooms(batch_db) == before      # dry run: nothing written

    status, doc = run(spark, batch_db, "backfill-destination-rooms")
    assert status == 0
    want = {**expected_destination_rooms(h), ("z.example", "!new"): 10_000}
    assert read_destination_rooms(batch_db) == want
    assert doc["summary"]["upserted"] == 3 and doc["summary"]["deleted"] == 1
    assert _staging_tables(batch_db) == []

    status, doc = run(spark, batch_db, "backfill-destination-rooms")
    assert status == 0
    assert sum(doc["summary"][p] for p in ("missing", "behind", "ahead", "stale")) == 0
    assert read_destination_rooms(batch_db) == want


def test_failed_apply_changes_nothing(spark: Any, batch_db: str) -> None:
    h = broken(scenario())
    load_pg(h, batch_db)
    before = read_destination_rooms(batch_db)
    # The DELETE runs after the upsert in the same transaction: fail it.
    with psycopg.connect(batch_db.replace("+psycopg", "")) as conn:
        conn.execute("""
            CREATE FUNCTION no_delete() RETURNS trigger LANGUAGE plpgsql AS
            $$ BEGIN RAISE EXCEPTION 'injected failure'; END $$;
            CREATE TRIGGER no_delete BEFORE DELETE ON destination_rooms
            FOR EACH ROW EXECUTE FUNCTION no_delete();
        """)
    status, _ = run(spark, batch_db, "backfill-destination-rooms")
    assert status == EXIT_FAILED
    assert read_destination_rooms(batch_db) == before
    assert _staging_tables(batch_db) == []


def test_audit_report_repair_and_reaudit(spark: Any, batch_db: str, tmp_path: Path) -> None:
    h = broken(scenario())
    load_pg(h, batch_db)
    und = expected_undelivered(h)
    assert "lost" in und.values()   # the scenario must exercise what it tests

    status, doc = run(spark, batch_db, "audit", "--output", str(tmp_path))
    assert status == EXIT_FINDINGS
    s = doc["summary"]
    assert s["undelivered_lost"] == list(und.values()).count("lost")
    assert s["undelivered_pending"] == list(und.values()).count("pending")
    assert s["rows_stale"] == 1 and s["rows_missing"] == 1
    got = {(r["destination"], r["room_id"]): r["status"] for r in doc["samples"]["undelivered"]}
    assert got == und
    assert (tmp_path / "undelivered.csv").exists() and (tmp_path / "mismatches.parquet").exists()

    status, doc = run(spark, batch_db, "audit", "--repair")
    assert status == EXIT_FINDINGS
    assert read_destination_rooms(batch_db) == {
        **expected_destination_rooms(h), ("z.example", "!new"): 10_000}
    earliest: dict[str, int] = {}
    exp = expected_destination_rooms(h)
    for key in und:
        earliest[key[0]] = min(earliest.get(key[0], 10**9), exp[key])
    pos = read_positions(batch_db)
    for d, so in earliest.items():
        assert pos[d] == min(h.destinations[d] or 10**9, so - 1)

    # Repaired: nothing lost or mismatched any more; catch-up has the rest pending.
    status, doc = run(spark, batch_db, "audit")
    assert status == 0
    assert doc["summary"]["undelivered_lost"] == 0
    assert doc["summary"]["undelivered_pending"] == len(und)


def test_snapshot_round_trip(spark: Any, batch_db: str, tmp_path: Path) -> None:
    h = broken(scenario())
    load_pg(h, batch_db)
    snap = tmp_path / "snap"
    status, doc = run(spark, batch_db, "snapshot", "--output", str(snap))
    assert status == 0
    assert doc["summary"]["rows_events"] == len(h.events)
    assert doc["summary"]["high_water_mark"] == h.high_water_mark
    # A snapshot needs no database for reports; its results are the database's.
    status, doc = run(spark, "sqlite:///nowhere.db", "audit", "--snapshot", str(snap))
    assert status == EXIT_FINDINGS
    und = list(expected_undelivered(h).values())
    assert doc["summary"]["undelivered_lost"] == und.count("lost")
    assert doc["summary"]["undelivered_pending"] == und.count("pending")
    assert doc["summary"]["rows_ahead"] == 1
    # Writing needs the database, and says so before doing any work.
    assert run(spark, "sqlite:///nowhere.db", "audit", "--snapshot", str(snap),
               "--repair")[0] == 2


def test_health_report(spark: Any, batch_db: str, tmp_path: Path) -> None:
    import pandas as pd

    h = scenario()
    h.send("b.example", ["$e5"], started_ts=1_700_000_000_000, duration_ms=120)
    h.send("b.example", [], status="transient", started_ts=1_700_000_100_000, duration_ms=900)
    h.send("c.example:8448", ["$e6"], started_ts=1_700_000_000_500, duration_ms=80,
           catchup=True)
    h.destinations = {"b.example": 5, "c.example:8448": 6}
    h.destination_rooms = {("b.example", "!r1"): 11, ("c.example:8448", "!r1"): 6}
    load_pg(h, batch_db)
    status, doc = run(spark, batch_db, "health-report", "--output", str(tmp_path))
    assert status == 0
    assert doc["summary"]["destinations"] == 2 and doc["summary"]["transactions"] == 3
    page = (tmp_path / "health.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "b.example" in page
    csv = pd.read_csv(tmp_path / "health.csv").set_index("destination")
    want = expected_health(h, int(FakeClock().time_s() * 1000))
    assert csv.loc["b.example", "backoff_ms"] == want["b.example"]["backoff_ms"]
    assert csv.loc["b.example", "lag_stream_positions"] == 6
    assert pd.read_parquet(tmp_path / "health.parquet").shape[0] == 2


def test_usage_errors(spark: Any) -> None:
    assert run(spark, "sqlite:///x.db", "audit")[0] == 2          # no such database file
    assert run(spark, "postgresql://u@h/db", "snapshot")[0] == 2  # snapshot needs --output


def test_audit_and_backfill_agree_on_rows_pruned_after_delivery(
        spark: Any, batch_db: str) -> None:
    """Catch-up deletes the row of a room once its events are delivered; neither job may
    call that row missing, and the backfill must not put it back."""
    h = broken(scenario())
    # c.example:8448 was sent $e6, the latest event of !r1 it should have: delivered.
    pruned_key = ("c.example:8448", "!r1")
    assert pruned_key not in expected_undelivered(h)
    assert expected_destination_rooms(h)[pruned_key] == 6
    del h.destination_rooms[pruned_key]
    load_pg(h, batch_db)

    status, audit = run(spark, batch_db, "audit")
    status, dry = run(spark, batch_db, "backfill-destination-rooms", "--dry-run")
    assert status == 0
    assert audit["summary"]["rows_pruned_after_delivery"] == 1
    assert dry["summary"]["pruned_after_delivery"] == 1
    assert dry["summary"]["missing"] == audit["summary"]["rows_missing"] == 1
    status, _ = run(spark, batch_db, "backfill-destination-rooms")
    assert status == 0
    assert pruned_key not in read_destination_rooms(batch_db)


@pytest.mark.parametrize("rooms", [("!r1",), ("!r2", "!gone")])
def test_room_option_finds_those_rooms_differences_only(
        spark: Any, batch_db: str, rooms: tuple[str, ...]) -> None:
    """``--room`` on our schema: each room's differences as in a run on every room, and
    no other room's (``!gone``, a purged room, has only a stale row)."""
    h = broken(scenario())
    load_pg(h, batch_db)
    status, doc = run(spark, batch_db, "backfill-destination-rooms", "--dry-run",
                      *[a for r in rooms for a in ("--room", r)])
    assert status == 0
    problems = [p for (_, room), p in expected_diff(h).items() if room in rooms]
    s = doc["summary"]
    assert {p: s[p] for p in ("missing", "behind", "ahead", "stale")} == {
        p: problems.count(p) for p in ("missing", "behind", "ahead", "stale")}
    assert s["only_rooms"] == len(rooms) and problems


def test_audit_over_ranges_of_heap_blocks_matches_the_oracle(
        spark: Any, batch_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On PostgreSQL 14 and later the big tables are read in ranges of heap blocks. Here
    every one of them is split (a block a range at least), the events stored in room
    order rather than stream order: the audit finds exactly the oracle's rows."""
    h = with_every_finding(random_history(3, rooms=12, steps=800))
    for n, ev in enumerate(h.events):   # failed attempts: rows of the log, no delivery
        h.send("b.example", [ev["event_id"]], status="failed", started_ts=1000 + n)
    load_pg(h, batch_db)
    monkeypatch.setattr(batch_reads, "MIN_BLOCKS_PER_RANGE", 1)
    with psycopg.connect(batch_db.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("CLUSTER events USING ix_events_room_id_stream_ordering")
        for table in PARTITION_COLUMNS:   # spread over many blocks: a tenth of each full
            conn.execute(f"ALTER TABLE {table} SET (fillfactor = 10)")
            conn.execute(f"VACUUM FULL {table}")
        split = {t: batch_reads.block_predicates(conn, t, 3) for t in PARTITION_COLUMNS}
    assert {t: len(p or ()) for t, p in split.items()} == dict.fromkeys(PARTITION_COLUMNS, 3)

    status, doc = run(spark, batch_db, "audit")
    assert status == EXIT_FINDINGS
    s = doc["summary"]
    und = list(expected_undelivered(h).values())
    problems = list(expected_diff(h).values())
    assert all(und.count(c) for c in ("lost", "pending")), und
    assert (s["undelivered_lost"], s["undelivered_pending"]) == (
        und.count("lost"), und.count("pending"))
    assert s["rows_missing"] + s["rows_pruned_after_delivery"] == problems.count("missing")
    assert {p: s[f"rows_{p}"] for p in ("behind", "ahead", "stale")} == {
        p: problems.count(p) for p in ("behind", "ahead", "stale")}
