"""What an operator sees when the worker cannot start: the CLI runs as a subprocess and
its stderr is read as the operator would read it (issue 17 item 7)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from federation_sender.testing.ports import free_port


def run_worker(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {
        "FEDERATION_SENDER__DATA_DIR": str(tmp_path),
        "FEDERATION_SENDER__DATABASE__URL": f"sqlite:///{tmp_path}/w.db",
        "FEDERATION_SENDER__TELEMETRY__METRICS_PORT": "null",
        "FEDERATION_SENDER__REPLICATION__TRANSPORT": "none",
    }
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FEDERATION_SENDER__")}
    return subprocess.run(
        [sys.executable, "-m", "federation_sender", "worker"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**clean, **base, **env},
        timeout=120,
    )


def test_unreachable_database_is_one_line_per_attempt_then_exit_1(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    proc = run_worker(
        tmp_path,
        FEDERATION_SENDER__DATABASE__URL=f"postgresql://fs:hunter2@127.0.0.1:{port}/fs",
        FEDERATION_SENDER__DATABASE__CONNECT_ATTEMPTS="3",
        FEDERATION_SENDER__DATABASE__CONNECT_RETRY_S="0.05",
    )
    lines = [ln for ln in proc.stderr.strip().splitlines() if " INFO " not in ln]
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "hunter2" not in proc.stderr
    attempts = [ln for ln in lines if "unreachable (attempt" in ln]
    assert [("attempt 1 of 3" in a, "attempt 2 of 3" in a) for a in attempts] == [
        (True, False),
        (False, True),
    ]
    assert lines[-1].startswith("federation-sender: database postgresql 127.0.0.1:")
    assert "unreachable after 3 attempts" in lines[-1]
    assert "retrying in 0.05 s" in attempts[0]
    assert len(lines) == 3, proc.stderr


def test_admin_port_in_use_is_one_line_and_no_unclosed_session(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_worker(tmp_path, FEDERATION_SENDER__ADMIN__PORT=str(port))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Unclosed" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"federation-sender: admin.port: 127.0.0.1:{port} is already in use"
