"""Issue #43 item 4: what the batch jobs got wrong.

* the health report's latency chart showed the busiest destinations, not the slow ones;
* a ``--master`` or ``--remote`` that does not answer, and a database that is down or
  missing, were found out only once Spark had started (a minute and more), or never
  (``--remote`` hung): now each is one line and exit status 2 within seconds;
* read from SQLite, stream orderings came out as decimals (Parquet) and strings (JSON).

The command-line checks run the CLI in a subprocess (a process holds one SparkContext,
and an old build would hang: the timeout is the failure) and time it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import federation_sender
from federation_sender.batch.session import SQLITE_JDBC_JAR
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.postgres import PostgresCluster
from federation_sender.testing.prereq import missing

from .histories import History, load_pg, scenario
from .test_jobs import broken, run

pytestmark = [pytest.mark.spark]

FAST_S = 15.0
"""A check that answers in seconds, with room for a loaded machine (measured: 2-3 s for a
refused connection, 5-7 s for a Connect port that never answers, most of it imports)."""
OLD_BUILD_S = 60.0
"""What an old build took at least (75-125 s, or for ever): the subprocess's timeout."""


def closed_port() -> int:
    """A loopback port where nothing listens (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield int(s.getsockname()[1])


def batch_cli(cwd: Path, *argv: str) -> tuple[int, list[str], float]:
    """Exit status, stderr's lines and seconds of ``python -m federation_sender.batch``
    (the package this test imported, wherever the checkout is)."""
    env = dict(os.environ, PYTHONPATH=str(Path(federation_sender.__file__).parents[1]))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "federation_sender.batch", *argv],
                          capture_output=True, text=True, timeout=OLD_BUILD_S, cwd=cwd,
                          env=env)
    return proc.returncode, proc.stderr.strip().splitlines(), time.monotonic() - t0


# --- 1. the latency chart shows who is slow -----------------------------------------------

def test_the_latency_chart_shows_the_slowest_destinations(
        spark: Any, batch_db: str, tmp_path: Path) -> None:
    import pandas as pd

    from federation_sender.batch import report

    h = History()
    fast = [f"busy{i:02d}.example" for i in range(40)]
    slow = ["slow-a.example", "slow-b.example", "slow-c.example"]
    ts = 1_700_000_000_000
    for i, d in enumerate(fast):
        for k in range(30):
            h.send(d, [], started_ts=ts + 1000 * k, duration_ms=10 + (i + k) % 20)
    for j, d in enumerate(slow):
        for k in range(2):
            h.send(d, [], started_ts=ts + 5000 * k, duration_ms=4000 + 11 * j + k)
    load_pg(h, batch_db)
    status, doc = run(spark, batch_db, "health-report", "--output", str(tmp_path))
    assert status == 0, doc

    health = pd.read_parquet(tmp_path / "health.parquet")
    charts = dict(report.latency_charts(health))
    assert list(charts) == [report.LATENCY, report.LATENCY_BUSIEST]
    shown = charts[report.LATENCY]
    # The slowest first, by p99, although they are the quietest; none of them is busy.
    assert list(shown["destination"][:3]) == slow[::-1]
    assert not shown["busy"][:3].any()
    assert shown["latency_p99_ms"].iloc[0] > 4000 > shown["latency_p99_ms"].iloc[3]
    assert len(shown) == report.TOP_N
    assert not set(slow) & set(charts[report.LATENCY_BUSIEST]["destination"])
    assert [r["destination"] for r in doc["samples"]["slowest"][:3]] == slow[::-1]

    page = (tmp_path / "health.html").read_text()
    for title in ("Transactions", report.LATENCY, report.LATENCY_BUSIEST):
        marker = f'alt="{title}" src="data:image/png;base64,'
        assert marker in page, title
        png = base64.b64decode(page.split(marker, 1)[1].split('"', 1)[0])
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5_000


def test_a_few_destinations_get_one_latency_chart() -> None:
    import pandas as pd

    from federation_sender.batch import report

    health = pd.DataFrame({
        "destination": ["a.example", "b.example", "idle.example"],
        "transactions": [10, 2, 0],
        "latency_p50_ms": [5.0, 900.0, None], "latency_p95_ms": [9.0, 950.0, None],
        "latency_p99_ms": [12.0, 990.0, None],
    })
    ((title, shown),) = report.latency_charts(health)
    assert title == report.LATENCY
    assert list(shown["destination"]) == ["b.example", "a.example"]   # no idle one
    assert list(shown["busy"]) == [True, True]


# --- 2. a master that does not answer -------------------------------------------------------

def test_a_master_that_does_not_answer_is_one_line_in_seconds(
        batch_db: str, tmp_path: Path) -> None:
    port = closed_port()
    status, err, took = batch_cli(tmp_path, "health-report", "--master",
                                  f"spark://127.0.0.1:{port}", "--database-url", batch_db,
                                  "--output", str(tmp_path / "out"))
    assert status == 2, err
    (line,) = err
    assert f"spark://127.0.0.1:{port} does not answer" in line, line
    assert "Connection refused" in line and "sbin/start-master.sh" in line, line
    assert "Java" not in line, line
    assert took < FAST_S, took


def test_what_spark_logs_when_no_master_answers_is_the_reason() -> None:
    """The driver's error log of a run against a port that accepts connections but is no
    master (the exception Spark raises says only "stopped SparkContext")."""
    from federation_sender.batch.session import MASTERS_UNRESPONSIVE, start_failure_reason

    log = ("ERROR StandaloneSchedulerBackend: Application has been killed. Reason: All "
           "masters are unresponsive! Giving up.\n"
           "ERROR SparkContext: Error initializing SparkContext.\n"
           "java.lang.IllegalStateException: Cannot call methods on a stopped SparkContext.\n"
           "\tat org.apache.spark.SparkContext.assertNotStopped(SparkContext.scala:128)\n")
    reason = start_failure_reason(log)
    assert reason == "All masters are unresponsive! Giving up."
    assert MASTERS_UNRESPONSIVE in reason
    assert start_failure_reason("ERROR SparkContext: Error initializing SparkContext.\n"
                                ) == "Error initializing SparkContext."
    assert start_failure_reason("") is None


# --- 3. a Spark Connect server that does not answer ----------------------------------------

def test_a_connect_port_where_nothing_listens_is_one_line_in_seconds(
        batch_db: str, tmp_path: Path) -> None:
    port = closed_port()
    status, err, took = batch_cli(tmp_path, "health-report", "--remote",
                                  f"sc://127.0.0.1:{port}", "--database-url", batch_db,
                                  "--output", str(tmp_path / "out"))
    assert status == 2, err
    (line,) = err
    assert f"sc://127.0.0.1:{port} does not answer" in line, line
    assert "Connection refused" in line and "start-connect-server.sh" in line, line
    assert took < FAST_S, took


def test_a_connect_port_that_never_answers_is_one_line_in_seconds(
        batch_db: str, tmp_path: Path, silent_port: int) -> None:
    status, err, took = batch_cli(tmp_path, "health-report", "--remote",
                                  f"sc://127.0.0.1:{silent_port}", "--database-url", batch_db,
                                  "--output", str(tmp_path / "out"))
    assert status == 2, err
    (line,) = err
    assert f"sc://127.0.0.1:{silent_port} did not answer" in line, line
    assert "gRPC handshake" in line and "start-connect-server.sh" in line, line
    assert took < FAST_S, took


# --- 4. the database, before Spark -----------------------------------------------------------

def test_a_database_that_is_down_or_missing_is_one_line_before_spark(
        pg_cluster: PostgresCluster, tmp_path: Path) -> None:
    port = closed_port()
    not_a_db = tmp_path / "notes.db"
    not_a_db.write_text("not a database\n")
    cases = [
        (f"postgresql://fs:s3cret@127.0.0.1:{port}/fs",
         f"postgresql://fs:***@127.0.0.1:{port}/fs", "Connection refused"),
        (pg_cluster.url("no_such_database"), pg_cluster.url("no_such_database"),
         'database "no_such_database" does not exist'),
        (f"sqlite:///{tmp_path}/missing.db", f"{tmp_path}/missing.db", "no SQLite database"),
        (f"sqlite:///{not_a_db}", str(not_a_db), "is not an SQLite database"),
    ]
    for url, shown, why in cases:
        status, err, took = batch_cli(tmp_path, "audit", "--database-url", url)
        assert status == 2, (url, err)
        (line,) = err
        assert shown in line and why in line, line
        assert "s3cret" not in line
        assert took < 10, (url, took)


# --- 5. integers from SQLite -----------------------------------------------------------------

def load_sqlite(h: History, path: Path) -> str:
    """A migrated SQLite database holding the history; its URL."""
    url = f"sqlite:///{path}"

    async def migrate() -> None:
        eng = create_engine(url)
        try:
            await upgrade(eng)
        finally:
            await eng.dispose()

    asyncio.run(migrate())
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.executemany(
            "INSERT INTO events (stream_ordering, event_id, room_id, type, state_key, sender,"
            " origin_server_ts, outlier, rejected, json) VALUES (:stream_ordering, :event_id,"
            " :room_id, :type, :state_key, :sender, 0, :outlier, :rejected, '{}')", h.events)
        conn.executemany(
            "INSERT INTO room_memberships VALUES (:event_id, :event_stream_ordering, :room_id,"
            " :user_id, :server_name, :sender, :membership)", h.memberships)
        conn.executemany("INSERT INTO partial_state_rooms VALUES (?)",
                         [(r,) for r in h.partial_state_rooms])
        conn.executemany("INSERT INTO destination_rooms VALUES (?, ?, ?)",
                         [(d, r, so) for (d, r), so in h.destination_rooms.items()])
        conn.executemany("INSERT INTO destinations (destination, "
                         "last_successful_stream_ordering) VALUES (?, ?)",
                         list(h.destinations.items()))
        conn.executemany(
            "INSERT INTO federation_transaction_log (txn_id, destination, pdu_count,"
            " edu_count, request_bytes, status, http_status, started_ts, duration_ms,"
            " catchup, max_stream_ordering, pdu_event_ids) VALUES (:txn_id, :destination,"
            " :pdu_count, :edu_count, :request_bytes, :status, :http_status, :started_ts,"
            " :duration_ms, :catchup, :max_stream_ordering, :pdu_event_ids)", h.txn_log)
    return url


def _integer_columns(path: Path) -> dict[str, str]:
    import pyarrow.parquet as pq

    return {f.name: str(f.type) for f in pq.read_schema(path)
            if f.name in INTEGER_COLUMNS}


INTEGER_COLUMNS = {
    "stream_ordering", "expected_so", "actual_so", "delivered_so",
    "last_successful_stream_ordering", "max_stream_ordering", "transactions", "successes",
    "failures", "first_ts", "last_ts", "last_error_ts", "lag_stream_positions",
    "backoff_ms", "high_water_mark",
}


def test_stream_orderings_read_from_sqlite_are_integers(spark: Any, tmp_path: Path) -> None:
    if not Path(SQLITE_JDBC_JAR).exists():
        missing(f"{SQLITE_JDBC_JAR} (Debian package libxerial-sqlite-jdbc-java)")
    h = broken(scenario())
    h.destinations["b.example"] = 99      # past its undelivered rows: lost, not pending
    url = load_sqlite(h, tmp_path / "fs.db")

    out = tmp_path / "audit"
    status, audit = run(spark, url, "audit", "--output", str(out))
    assert status == 4, audit
    assert audit["summary"]["undelivered_lost"] > 0
    undelivered = _integer_columns(out / "undelivered.parquet")
    assert undelivered["stream_ordering"] == "int64", undelivered
    assert set(_integer_columns(out / "mismatches.parquet").values()) == {"int64"}
    for name in ("undelivered", "mismatches"):
        rows = audit["samples"][name]
        assert rows, name
        for row in rows:
            for col, v in row.items():
                if col in INTEGER_COLUMNS and v is not None:
                    assert type(v) is int, (name, col, v)
    assert type(audit["summary"]["high_water_mark"]) is int
    assert "12.0" not in (out / "mismatches.csv").read_text()

    out = tmp_path / "backfill"
    status, dry = run(spark, url, "backfill-destination-rooms", "--dry-run", "--output",
                      str(out))
    assert status == 0, dry
    assert set(_integer_columns(out / "differences.parquet").values()) == {"int64"}
    assert all(type(r["stream_ordering"]) is int for r in dry["samples"]["differences"]
               if r.get("stream_ordering") is not None)

    out = tmp_path / "health"
    status, health = run(spark, url, "health-report", "--output", str(out))
    assert status == 0, health
    types = _integer_columns(out / "health.parquet")
    assert types and set(types.values()) == {"int64"}, types
    assert json.dumps(health["samples"]["worst"])  # plain values
    for row in health["samples"]["worst"]:
        for col in ("max_stream_ordering", "last_successful_stream_ordering"):
            assert row[col] is None or type(row[col]) is int, (col, row[col])
