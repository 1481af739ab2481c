"""The jobs on the embedded SQLite database, through Debian's SQLite JDBC driver: the
demo's database, found without arguments, then the audit and the backfill."""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from federation_sender.batch.arguments import add_batch_parser
from federation_sender.batch.cli import run_batch
from federation_sender.batch.session import SQLITE_JDBC_JAR
from federation_sender.config import Settings
from federation_sender.demo import SERVER_NAME
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.prereq import missing
from tests.conftest import DemoRun

pytestmark = [pytest.mark.spark]


@pytest.fixture(scope="module")
def demo_dir(demo_run: DemoRun, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the session's demo run (``tests/conftest.py``): the jobs write to it."""
    if not Path(SQLITE_JDBC_JAR).exists():
        missing(f"{SQLITE_JDBC_JAR} (Debian package libxerial-sqlite-jdbc-java)")
    assert demo_run.status == 0, demo_run.output[-3000:]
    work = tmp_path_factory.mktemp("demo") / "run"
    shutil.copytree(demo_run.directory / "data", work / "data")
    return work


def batch(spark: Any, *argv: str, capsys: pytest.CaptureFixture[str] | None = None
          ) -> tuple[int, dict[str, Any]]:
    parser = argparse.ArgumentParser()
    add_batch_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["batch", *argv, "--json", "--quiet"])
    out = io.StringIO()
    status = run_batch(args, Settings(), spark=spark, clock=FakeClock(), out=out)
    return status, json.loads(out.getvalue()) if out.getvalue() else {}


def test_health_report_right_after_the_demo(spark: Any, demo_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(demo_dir)  # the default configuration: ./data
    status, doc = batch(spark, "health-report", "--output", "report")
    assert status == 0, doc
    assert "using the demo's database" in capsys.readouterr().err
    db = demo_dir / "data" / "demo" / "demo.db"
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        (txns,) = conn.execute("SELECT count(*) FROM federation_transaction_log").fetchone()
        (dests,) = conn.execute("SELECT count(DISTINCT destination) FROM "
                                "federation_transaction_log").fetchone()
    assert doc["summary"]["transactions"] == txns > 0
    assert doc["summary"]["destinations"] == dests
    assert (demo_dir / "report" / "health.html").stat().st_size > 10_000


def test_audit_and_backfill_on_sqlite(spark: Any, demo_dir: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(demo_dir)
    status, audit = batch(spark, "audit")
    # The demo ends when its delivery check passes: nothing lost.
    assert audit["summary"]["undelivered_lost"] == 0, audit
    status, dry = batch(spark, "backfill-destination-rooms", "--dry-run")
    assert status == 0
    assert dry["summary"]["pruned_after_delivery"] == audit["summary"][
        "rows_pruned_after_delivery"]
    assert dry["summary"]["missing"] == audit["summary"]["rows_missing"]
    url = f"sqlite:///{demo_dir / 'data' / 'demo' / 'demo.db'}"
    status, applied = batch(spark, "backfill-destination-rooms", "--database-url", url,
                            "--server-name", SERVER_NAME)
    assert status == 0, applied
    status, again = batch(spark, "backfill-destination-rooms", "--dry-run")
    assert sum(again["summary"][p] for p in ("missing", "behind", "ahead", "stale")) == 0


def test_the_health_report_read_as_a_picture(spark: Any, demo_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's report in headless Chromium: every chart drawn, no empty lag chart (the
    demo ends caught up), a timeline in seconds for a run of seconds, the worst
    destination first with its error, rounded figures."""
    import os

    import pandas as pd
    from PIL import Image

    from federation_sender.testing.browser import headless_chromium

    monkeypatch.chdir(demo_dir)
    report = demo_dir / "report"
    if not (report / "health.html").exists():
        assert batch(spark, "health-report", "--output", "report")[0] == 0
    health = pd.read_csv(report / "health.csv")
    shots = (Path(__file__).resolve().parents[2] / "docs" / "images"
             if os.environ.get("FEDERATION_SENDER_DOC_IMAGES") else demo_dir)
    png = shots / "health-report.png"
    with headless_chromium(1200, 2400) as d:
        d.get((report / "health.html").as_uri())
        drawn = d.execute_script(
            "return [...document.images].map(i => [i.alt, i.complete && i.naturalWidth > 0])")
        text = d.find_element("tag name", "body").text
        first_row = d.execute_script(
            "return [...document.querySelectorAll('tbody tr:first-child td')]"
            ".map(td => td.innerText)")
        d.save_screenshot(str(png))
    # A demo runs for seconds: buckets of seconds, not one bar for the hour.
    timeline = pd.read_csv(report / "timeline.csv")
    starts = sorted(set(timeline["bucket_ts"]))
    step_ms = min((b - a for a, b in itertools.pairwise(starts)), default=0)
    assert len(starts) > 1 and step_ms <= 5_000
    label = "second" if step_ms == 1000 else f"{step_ms // 1000} seconds"
    assert drawn == [["Transactions", True], ["Latency", True],
                     [f"Timeline, per {label}", True]]
    assert "No destination is behind the events stream" in text
    worst = health.sort_values("success_rate").iloc[0]
    assert first_row[0] == worst["destination"]
    if worst["success_rate"] < 1:
        assert first_row[-1] not in ("", "-")   # its last error
    # Rounded: a percentage with one decimal, latencies with at most one.
    assert first_row[2].endswith("%") and len(first_row[2].split(".")[-1]) == 2
    assert all(len(c.split(".")[-1]) <= 1 for c in first_row[3:6] if "." in c)
    # Looked at as a picture: a page with content, not a blank or broken render.
    with Image.open(png) as im:
        colours = len(im.convert("RGB").resize((200, 400)).getcolors(maxcolors=100_000) or [])
    assert colours > 50
