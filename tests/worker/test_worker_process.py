"""The whole worker, started as a subprocess from its CLI, against a real PostgreSQL,
a real TCP replication writer and loopback destinations."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.clock import SystemClock
from federation_sender.replication.rows import EventRow
from federation_sender.replication.server import ReplicationWriter
from federation_sender.replication.tcp import TcpReplicationServer
from federation_sender.testing.fake_homeserver import FakeHomeserver
from federation_sender.testing.postgres import free_port
from federation_sender.testing.queue_writer import HomeserverWriter, WrittenEvent

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
                EventRow(
                    ev.event_id, ev.room_id, "m.room.message", None, None, None, None, False, False
                ),
            )
            assert token == ev.stream_ordering

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()


@pytest.fixture
async def main_process(pg_engine: AsyncEngine) -> AsyncIterator[MainProcess]:
    mp = MainProcess(pg_engine)
    await mp.start()
    yield mp
    await mp.close()


@pytest.fixture
async def remotes() -> AsyncIterator[FakeHomeserver]:
    hs = FakeHomeserver()
    await hs.start(free_port())
    yield hs
    await hs.close()


def _config(tmp_path: Path, pg_url: str, repl_port: int, remote_url: str) -> tuple[Path, int]:
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
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, admin_port


def _start_worker(config: Path, tmp_path: Path) -> subprocess.Popen[bytes]:
    log = open(tmp_path / "worker.log", "ab")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [sys.executable, "-m", "federation_sender", "worker", "-c", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
        env=dict(os.environ),
    )


async def _wait_for(pred: Any, timeout_s: float = 30.0, what: str = "") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
    proc.send_signal(sig)
    for _ in range(300):
        if proc.poll() is not None:
            return proc.returncode
        await asyncio.sleep(0.1)
    proc.kill()
    raise AssertionError("worker did not exit within 30 s of the signal")


async def _wait_ready(admin_port: int, proc: subprocess.Popen[bytes]) -> None:
    """/ready answers 200 once the worker is started and connected to replication."""
    async with aiohttp.ClientSession() as http:
        for _ in range(300):
            assert proc.poll() is None, "worker exited during start-up"
            try:
                async with http.get(f"http://127.0.0.1:{admin_port}/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError("worker not ready within 30 s")


def _delivered(hs: FakeHomeserver, dest: str) -> set[str]:
    return set(hs.received_event_ids(dest))


async def test_worker_delivers_survives_shutdown_mid_flight_and_serves_admin(
    tmp_path: Path, pg_url: str, main_process: MainProcess, remotes: FakeHomeserver
) -> None:
    mp = main_process
    assert mp.server is not None
    config, admin_port = _config(tmp_path, pg_url, mp.server.port, remotes.url)
    room = "!room:local.test"
    setup = [await mp.db.join(room, "@alice:local.test")]
    for d in REMOTES:
        setup.append(await mp.db.join(room, f"@u:{d}"))
    mp.announce(setup)

    proc = _start_worker(config, tmp_path)
    try:
        await _wait_ready(admin_port, proc)
        first = await mp.db.messages(room, "@alice:local.test", 20)
        mp.announce(first)
        want = {e.event_id for e in first}
        await _wait_for(
            lambda: all(want <= _delivered(remotes, d) for d in REMOTES), 60, "first delivery"
        )

        # Admin API: token required; destinations listed with live state.
        base = f"http://127.0.0.1:{admin_port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/_synapse/admin/v1/federation/destinations") as r:
                assert r.status == 401
            hdrs = {"Authorization": "Bearer test-admin-token"}
            async with http.get(
                f"{base}/_synapse/admin/v1/federation/destinations", headers=hdrs
            ) as r:
                body = await r.json()
                assert r.status == 200
                assert {d["destination"] for d in body["destinations"]} == set(REMOTES)

        # Shutdown while transactions are in flight: remote1 answers slowly.
        remotes.behave(REMOTES[0], delay_s=3.0)
        second = await mp.db.messages(room, "@alice:local.test", 5)
        mp.announce(second)
        await asyncio.sleep(0.5)
        assert await _stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()

    remotes.behave(REMOTES[0], delay_s=0.0)
    # Events written while the worker is down are delivered after restart too.
    third = await mp.db.messages(room, "@alice:local.test", 3)
    mp.announce(third)
    proc = _start_worker(config, tmp_path)
    try:
        want = {e.event_id for e in first + second + third}
        latest = third[-1].event_id
        await _wait_for(
            lambda: all(latest in _delivered(remotes, d) for d in REMOTES),
            60,
            "delivery after restart",
        )
        # Small gap: catch-up replays the missed events in order, not only the latest.
        await _wait_for(
            lambda: all(want <= _delivered(remotes, d) for d in REMOTES),
            30,
            "every missed event after restart",
        )
        assert await _stop(proc, signal.SIGINT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_worker_refuses_unmigrated_database(tmp_path: Path, pg_url: str) -> None:
    config, _ = _config(tmp_path, pg_url, 1, "http://127.0.0.1:1")
    proc = subprocess.run(
        [sys.executable, "-m", "federation_sender", "worker", "-c", str(config)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 3
    assert "federation-sender migrate" in proc.stderr
