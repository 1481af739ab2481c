"""Argument parsing, URLs, session configuration and progress output: no Spark needed."""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

import pytest

from federation_sender.batch.arguments import EXIT_USAGE, add_batch_parser
from federation_sender.batch.cli import run_batch
from federation_sender.batch.io import Database, write_outputs
from federation_sender.batch.progress import Progress, format_summary
from federation_sender.batch.rooms import checked_rooms, room_frames
from federation_sender.batch.session import (
    SessionOptions,
    remote_session_conf,
    session_conf,
)
from federation_sender.config import Settings
from federation_sender.testing.clock import FakeClock


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_batch_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["batch", *argv])


def test_parser_jobs_and_options() -> None:
    a = _parse("audit", "--repair", "--master", "spark://h:7077", "--partitions", "8",
               "--snapshot", "/s", "--conf", "spark.driver.memory=4g")
    assert (a.command, a.job, a.repair, a.master, a.partitions, a.snapshot, a.conf) == (
        "batch", "audit", True, "spark://h:7077", 8, "/s", ["spark.driver.memory=4g"])
    assert _parse("backfill-destination-rooms", "--dry-run").dry_run is True
    with pytest.raises(SystemExit):
        _parse("audit", "--dry-run")                     # only the backfill has --dry-run
    with pytest.raises(SystemExit):
        _parse("audit", "--master", "x", "--remote", "sc://y")
    with pytest.raises(SystemExit):
        _parse("no-such-job")


def test_database_urls() -> None:
    db = Database.from_urls("postgresql+psycopg://u:p@db.example:5433/fed")
    assert db.jdbc_url == "jdbc:postgresql://db.example:5433/fed"
    assert db.url == "postgresql://u:p@db.example:5433/fed"
    assert db.jdbc_options() == {"url": db.jdbc_url, "driver": "org.postgresql.Driver",
                                 "user": "u", "password": "p"}
    other = Database.from_urls("postgresql://u@h/d", "jdbc:postgresql://inside:5432/d")
    assert other.jdbc_url == "jdbc:postgresql://inside:5432/d"
    with pytest.raises(ValueError):
        Database.from_urls("sqlite:///x.db")


def test_session_conf_local_and_cluster() -> None:
    local = session_conf(SessionOptions(shuffle_partitions=3))
    assert local["spark.master"] == "local[*]"
    assert local["spark.ui.enabled"] == "false"
    assert local["spark.sql.shuffle.partitions"] == "3"
    jars = local["spark.jars"].split(",")
    assert jars[0] == "/usr/share/java/postgresql.jar"
    sqlite_jar = "/usr/share/java/sqlite-jdbc.jar"
    assert (sqlite_jar in jars) == Path(sqlite_jar).exists()
    cluster = session_conf(SessionOptions(master="yarn", conf={"spark.executor.memory": "8g"}))
    assert "spark.sql.shuffle.partitions" not in cluster      # the cluster's default
    assert "spark.driver.host" not in cluster
    assert cluster["spark.executor.memory"] == "8g"


def test_progress_and_summary() -> None:
    clock = FakeClock()
    err = io.StringIO()
    named: list[str | None] = []
    p = Progress("audit", clock, stream=err, on_step=named.append)
    with p.step("read"):
        clock.advance(1.5)
    with pytest.raises(RuntimeError), p.step("boom"):
        clock.advance(0.5)
        raise RuntimeError
    assert err.getvalue().splitlines() == [
        "[audit] 1. read ...", "[audit] 1. read done in 1.5 s",
        "[audit] 2. boom ...", "[audit] 2. boom FAILED after 0.5 s"]
    assert named == ["1. read", None, "2. boom", None]   # the Spark jobs' names
    text = format_summary("audit", {"undelivered_lost": 12345, "rate": 0.5}, p.steps,
                          p.elapsed_s)
    assert "undelivered_lost  12,345" in text and "time: read" in text
    assert text.splitlines()[-1].endswith("2.0 s")


def test_remote_session_conf_is_runtime_sql_settings() -> None:
    conf = remote_session_conf(SessionOptions(remote="sc://h:15002", shuffle_partitions=6,
                                              conf={"spark.sql.ansi.enabled": "true"}))
    assert conf == {"spark.sql.session.timeZone": "UTC", "spark.sql.shuffle.partitions": "6",
                    "spark.sql.ansi.enabled": "true"}


class _ConnectLikeFrame:
    """What Spark Connect's ``toPandas`` returns: a frame with its query metrics (objects
    that are not JSON) in ``attrs``."""

    dtypes = [("destination", "string"), ("n", "bigint")]

    def toPandas(self) -> Any:
        import pandas as pd

        pdf = pd.DataFrame({"destination": ["a.example"], "n": [1]})
        pdf.attrs["metrics"] = [object()]
        return pdf


def test_write_outputs_drops_connect_metrics(tmp_path: Path) -> None:
    import pandas as pd

    pdf = write_outputs(_ConnectLikeFrame(), tmp_path, "x")  # type: ignore[arg-type]
    assert pdf.attrs == {}
    assert pd.read_parquet(tmp_path / "x.parquet").to_dict("list") == {
        "destination": ["a.example"], "n": [1]}
    assert (tmp_path / "x.csv").read_text() == "destination,n\na.example,1\n"


def test_room_option_restricts_audit_and_backfill_to_room_frames(
        capsys: pytest.CaptureFixture[str]) -> None:
    a = _parse("audit", "--room", "!one:example.org", "--room", "!two")
    assert a.rooms == ["!one:example.org", "!two"]
    assert _parse("backfill-destination-rooms", "--room", "!one").rooms == ["!one"]
    assert _parse("audit").rooms is None
    with pytest.raises(SystemExit):
        _parse("health-report", "--room", "!one")  # per destination: not by room
    capsys.readouterr()
    assert checked_rooms(["!b", "!a", "!b"]) == ("!b", "!a")
    with pytest.raises(ValueError, match="not an alias"):
        checked_rooms(["#general:example.org"])
    # The frames of a room on each schema; the destinations' and the log are read whole.
    assert room_frames("native") == {"events", "room_memberships", "destination_rooms",
                                     "partial_state_rooms"}
    assert room_frames("synapse") == {"events", "current_members", "destination_rooms",
                                      "partial_state_rooms"}
    args = _parse("audit", "--room", "#general:example.org", "--database-url",
                  "postgresql://u@db.invalid/fed")
    assert run_batch(args, Settings()) == EXIT_USAGE
    assert "--room wants a room id" in capsys.readouterr().err
