"""The README's main job, small: the demo must pass its own delivery check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from federation_sender.testing.ports import free_port_block

DESTINATIONS = 8


def test_demo_runs_end_to_end_and_passes_the_delivery_check(tmp_path: Path) -> None:
    base = free_port_block(10 + DESTINATIONS)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "federation_sender",
            "demo",
            "--destinations",
            str(DESTINATIONS),
            "--port-base",
            str(base),
            "--rooms",
            "5",
            "--events",
            "150",
            "--duration",
            "8",
            "--no-live",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "delivery check: OK" in proc.stdout
    assert "totals:" in proc.stdout
    # --port-base: the dashboard is where it was asked to be.
    assert f"dashboard: http://127.0.0.1:{base}/dashboard" in proc.stdout
    log = (tmp_path / "data" / "demo" / "worker.log").read_text()
    # The remote that is down for most of the run goes through catch-up and comes back.
    assert "enters catch-up" in log
    assert "Traceback" not in log


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
