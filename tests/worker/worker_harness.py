"""Shared pieces of the worker process tests: a stand-in main process (database writer
plus TCP replication writer), worker configs and subprocess control, and fixtures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.clock import SystemClock
from federation_sender.replication.rows import EventsStreamRow
from federation_sender.replication.server import ReplicationWriter
from federation_sender.replication.tcp import TcpReplicationServer
from federation_sender.testing.fake_homeserver import FakeHomeserver
from federation_sender.testing.ports import free_port
from federation_sender.testing.queue_writer import HomeserverWriter, WrittenEvent
from federation_sender.testing.waiting import WaitTimedOut, wait_admin_ready, wait_until

LOCAL = "local.test"
REMOTES = [f"remote{i}.test" for i in range(1, 6)]


class MainProcess:
    """The database writer plus its replication writer, as Synapse's main process."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.db = HomeserverWriter(engine, LOCAL)
        self.repl = ReplicationWriter(LOCAL)
        self.server: TcpReplicationServer | None = None

    async def start(self) -> None:
        await self.db.init()
        self.repl.add_stream("events", current=self.db.stream_ordering)
        self.server = TcpReplicationServer(self.repl, clock=SystemClock(), port=free_port())
        await self.server.start()

    def announce(self, evs: list[WrittenEvent]) -> None:
        for ev in evs:
            token = self.repl.publish(
                "events",
                EventsStreamRow(
                    ev.event_id, ev.room_id, "m.room.message", None, None, None, None, False, False
                ),
            )
            assert token == ev.stream_ordering

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()


def write_config(tmp_path: Path, pg_url: str, repl_port: int, remote_url: str) -> tuple[Path, int]:
    admin_port = free_port()
    host_port = remote_url.split("//", 1)[1]
    cfg: dict[str, Any] = {
        "server_name": LOCAL,
        "instance_name": "fed1",
        "data_dir": str(tmp_path / "data"),
        "database": {"url": pg_url},
        "replication": {"transport": "tcp", "host": "127.0.0.1", "port": repl_port},
        "federation": {
            "signing_key_path": str(tmp_path / "data" / "signing.key"),
            "use_tls": False,
            "ip_allow_list": ["127.0.0.0/8"],
            "request_timeout_s": 10.0,
            "destination_overrides": {d: host_port for d in REMOTES},
        },
        "queue": {"backoff_initial_s": 1.0, "wakeup_interval_s": 1.0},
        "admin": {"port": admin_port, "token": "test-admin-token"},
        "telemetry": {"metrics_port": None},
        "shutdown_deadline_s": 1.0,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, admin_port


def start_worker(config: Path, tmp_path: Path) -> subprocess.Popen[bytes]:
    # The worker writes to its own copy of the file descriptor; ours is closed at once.
    with open(tmp_path / "worker.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "federation_sender", "worker", "-c", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env=dict(os.environ),
        )


async def stop(
    proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, *, within_s: float = 30.0
) -> int:
    """Signal the worker and return its exit status; fail unless it exits within ``within_s``."""
    proc.send_signal(sig)
    try:
        code = await wait_until(proc.poll, f"the worker to exit on signal {sig}",
                                accept=lambda c: c is not None, timeout_s=within_s, every_s=0.1)
    except WaitTimedOut:
        proc.kill()
        raise
    assert code is not None
    return code


async def wait_ready(admin_port: int, proc: subprocess.Popen[bytes]) -> None:
    """/ready answers 200 once the worker is started and connected to replication."""

    def alive() -> None:
        assert proc.poll() is None, "worker exited during start-up"

    await wait_admin_ready(admin_port, alive, timeout_s=30)


def delivered(hs: FakeHomeserver, dest: str) -> set[str]:
    return set(hs.received_event_ids(dest))
