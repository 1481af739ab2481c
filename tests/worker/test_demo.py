"""The README's main job, small: the demo must pass its own delivery check."""

from __future__ import annotations

import contextlib
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

from federation_sender.testing.ports import free_port_block
from tests.conftest import DEMO_DESTINATIONS as DESTINATIONS
from tests.conftest import DemoRun


def test_demo_runs_end_to_end_and_passes_the_delivery_check(demo_run: DemoRun) -> None:
    """Also --keep-running: after the check, the dashboard stays up until Ctrl-C (the
    run is the session's, ``tests/conftest.py``; the batch jobs read its database
    too)."""
    tmp_path, base, status = demo_run.directory, demo_run.port_base, demo_run.status
    assert demo_run.dashboard_status == 200, "the dashboard did not answer after the run"
    stdout = demo_run.output
    assert status == 0, stdout[-3000:]
    assert "delivery check: OK" in stdout
    assert "totals:" in stdout
    # --port-base: the dashboard is where it was asked to be.
    assert f"dashboard: http://127.0.0.1:{base}/dashboard" in stdout
    assert "Traceback" not in stdout
    log = (tmp_path / "data" / "demo" / "worker.log").read_text()
    # The remote that is down for most of the run goes through catch-up and comes back.
    assert "enters catch-up" in log
    assert "Traceback" not in log
    with contextlib.closing(sqlite3.connect(tmp_path / "data" / "demo" / "demo.db")) as db, db:
        caught_up = {d for (d,) in db.execute(
            "SELECT DISTINCT destination FROM federation_transaction_log WHERE catchup")}
    assert caught_up
    # Fewer deliveries seen than expected is allowed only where catch-up sent each
    # room's newest event instead of every missed one: a destination that never went
    # through catch-up must have seen every event it should have.
    got, want = map(int, re.search(r"(\d+)/(\d+) expected PDU deliveries seen",
                                   stdout).groups())  # type: ignore[union-attr]
    if got < want:
        line = re.search(r"expected deliveries not seen, by destination: (.*)", stdout)
        assert line is not None, stdout[-3000:]
        short = dict(item.rsplit(" ", 1) for item in line[1].split(", "))
        assert sum(map(int, short.values())) == want - got
        assert set(short) <= caught_up, (short, caught_up)


def test_demo_with_a_taken_port_says_so_in_one_line(tmp_path: Path) -> None:
    import socket

    base = free_port_block(10 + DESTINATIONS)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 12))  # a remote's port
        taken.listen()
        proc = subprocess.run(
            [sys.executable, "-m", "federation_sender", "demo", "--destinations",
             str(DESTINATIONS), "--port-base", str(base), "--no-live"],
            capture_output=True, text=True, cwd=tmp_path, timeout=60,
        )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert f"port {base + 12} " in line and "--port-base" in line, line
    assert "Traceback" not in proc.stdout + proc.stderr
