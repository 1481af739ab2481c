"""The whole worker, started as a subprocess from its CLI, against a real PostgreSQL,
a real TCP replication writer and loopback destinations."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
from worker_harness import (
    REMOTES,
    MainProcess,
    delivered,
    start_worker,
    stop,
    wait_ready,
    write_config,
)

from federation_sender.testing.fake_homeserver import FakeHomeserver
from federation_sender.testing.waiting import wait_until


async def test_worker_delivers_survives_shutdown_mid_flight_and_serves_admin(
    tmp_path: Path, pg_url: str, main_process: MainProcess, remotes: FakeHomeserver
) -> None:
    mp = main_process
    assert mp.server is not None
    config, admin_port = write_config(tmp_path, pg_url, mp.server.port, remotes.url)
    room = "!room:local.test"
    setup = [await mp.db.join(room, "@alice:local.test")]
    for d in REMOTES:
        setup.append(await mp.db.join(room, f"@u:{d}"))
    mp.announce(setup)

    proc = start_worker(config, tmp_path)
    try:
        await wait_ready(admin_port, proc)
        first = await mp.db.messages(room, "@alice:local.test", 20)
        mp.announce(first)
        want = {e.event_id for e in first}
        await wait_until(
            lambda: all(want <= delivered(remotes, d) for d in REMOTES), "first delivery",
            timeout_s=60, every_s=0.1,
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

        # Shutdown while a transaction is in flight: remote1 does not answer. The worker
        # gives it shutdown_deadline_s (1 s in this config, 10 s by default), then exits 0;
        # the cancelled transaction's events are sent again after the restart.
        remotes.behave(REMOTES[0], hang=True)
        in_flight = remotes.in_progress
        second = await mp.db.messages(room, "@alice:local.test", 5)
        mp.announce(second)
        await wait_until(lambda: remotes.in_progress > in_flight, "a transaction in flight",
                         timeout_s=30, every_s=0.1)
        assert await stop(proc, within_s=6.0) == 0
    finally:
        if proc.poll() is None:
            proc.kill()

    remotes.behave(REMOTES[0])
    remotes.release()
    # Events written while the worker is down are delivered after restart too.
    third = await mp.db.messages(room, "@alice:local.test", 3)
    mp.announce(third)
    proc = start_worker(config, tmp_path)
    try:
        want = {e.event_id for e in first + second + third}
        latest = third[-1].event_id
        await wait_until(
            lambda: all(latest in delivered(remotes, d) for d in REMOTES),
            "delivery after restart",
            timeout_s=60,
            every_s=0.1,
        )
        # Small gap: catch-up replays the missed events in order, not only the latest.
        await wait_until(
            lambda: all(want <= delivered(remotes, d) for d in REMOTES),
            "every missed event after restart",
            timeout_s=30,
            every_s=0.1,
        )
        assert await stop(proc, signal.SIGINT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_worker_refuses_unmigrated_database(tmp_path: Path, pg_url: str) -> None:
    config, _ = write_config(tmp_path, pg_url, 1, "http://127.0.0.1:1")
    proc = subprocess.run(
        [sys.executable, "-m", "federation_sender", "worker", "-c", str(config)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 3
    assert "federation-sender migrate" in proc.stderr
