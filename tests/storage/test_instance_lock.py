"""The instance lock (storage/instance_lock.py) on a real PostgreSQL and on SQLite:
a second holder of the same name is refused with one line naming the first; another
name is not; the lock survives its connection being terminated (taken again) and,
when another process took it meanwhile, the holder stops (InstanceLockLost), and a
worker process whose lock was taken stops at once with one ERROR line, exit 1."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.clock import SystemClock
from federation_sender.errors import StartupError
from federation_sender.storage.engine import normalise_url
from federation_sender.storage.instance_lock import (
    InstanceLockLost,
    PostgresInstanceLock,
    SqliteInstanceLock,
    instance_lock,
    lock_key,
)
from federation_sender.testing.postgres import PostgresCluster

pytestmark = pytest.mark.postgres


def _lock(url: str, name: str = "fed1") -> PostgresInstanceLock:
    return PostgresInstanceLock(
        make_url(normalise_url(url)), name, SystemClock(),
        check_interval_s=0.05, timeout_s=2.0, retake_for_s=3.0,
    )  # fmt: skip


def _holder_pid(cluster: PostgresCluster, name: str = "fed1") -> str:
    classid, objid = lock_key(name)
    return cluster.psql(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
        f" AND classid = ({classid})::int::oid AND objid = ({objid})::int::oid"
    ).strip()


async def _lock_session_setting(lock: PostgresInstanceLock, name: str) -> str:
    cur = await lock._conn.execute(f"SHOW {name}")
    row = await cur.fetchone()
    return str(row[0])


async def _until(cond: Callable[[], Awaitable[bool] | bool], what: str) -> None:
    async def poll() -> None:
        while True:
            v = cond()
            if v if isinstance(v, bool) else await v:
                return
            await SystemClock().sleep(0.02)

    try:
        await asyncio.wait_for(poll(), 10.0)
    except TimeoutError:
        raise AssertionError(f"not within 10 s: {what}") from None


async def test_second_holder_refused_with_one_line_naming_the_first(
    pg_url: str, pg_cluster: PostgresCluster
) -> None:
    first, second, other = _lock(pg_url), _lock(pg_url), _lock(pg_url, "fed2")
    await first.acquire()
    try:
        pid = _holder_pid(pg_cluster)
        # The server ends the session ~25 s after our host vanished (TCP keepalives).
        assert await _lock_session_setting(first, "tcp_keepalives_idle") == "10"
        with pytest.raises(StartupError) as e:
            await second.acquire()
        message = str(e.value)
        assert "\n" not in message
        assert "running as instance 'fed1'" in message
        assert f"backend pid {pid}" in message and "'federation-sender fed1 lock'" in message
        await other.acquire()  # another instance name is another lock
        await other.release()
    finally:
        await first.release()
    await second.acquire()  # released with the connection
    await second.release()


async def test_terminated_connection_takes_the_lock_again(
    pg_url: str, pg_cluster: PostgresCluster
) -> None:
    lock = _lock(pg_url)
    await lock.acquire()
    holder = asyncio.create_task(lock.hold())
    try:
        pid = _holder_pid(pg_cluster)
        pg_cluster.psql(f"SELECT pg_terminate_backend({pid}, 5000)")
        await _until(lambda: lock.retaken == 1, "the lock taken again")
        assert _holder_pid(pg_cluster) not in ("", pid)
        assert not holder.done()
    finally:
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)
        await lock.release()


async def test_lock_taken_by_another_while_disconnected_stops_the_holder(
    pg_url: str, pg_cluster: PostgresCluster
) -> None:
    lock = _lock(pg_url)
    lock.check_interval_s = 0.5  # room for the other process to take it in the gap
    await lock.acquire()
    holder = asyncio.create_task(lock.hold())
    other = _lock(pg_url)
    try:
        pg_cluster.psql(f"SELECT pg_terminate_backend({_holder_pid(pg_cluster)}, 5000)")
        await other.acquire()
        with pytest.raises(InstanceLockLost, match="another process took it"):
            await asyncio.wait_for(holder, 10.0)
    finally:
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)
        await lock.release()
        await other.release()


async def test_sqlite_file_lock(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/fs.db"
    first = instance_lock(url, "fed/1", SystemClock())
    second = instance_lock(url, "fed/1", SystemClock())
    assert isinstance(first, SqliteInstanceLock) and isinstance(second, SqliteInstanceLock)
    await first.acquire()
    with pytest.raises(StartupError, match="running as instance 'fed/1'"):
        await second.acquire()
    await first.release()
    await second.acquire()
    await second.release()
    assert instance_lock("sqlite:///:memory:", "fed1", SystemClock()) is None


async def test_native_worker_second_copy_refused_on_either_database(
    db_url: str, engine: AsyncEngine, tmp_path: Path
) -> None:
    """The native backend takes the same lock: two workers as ``fed1`` on one database
    (PostgreSQL: advisory lock; SQLite: the file lock) are one too many; ``fed2`` is
    another instance; the first's stop releases it. (``engine``: the schema migrated.)"""
    from federation_sender.app.worker import Worker
    from federation_sender.config import AdminSettings, DatabaseSettings, Settings

    def settings(name: str, directory: str) -> Settings:
        return Settings(
            instance_name=name, data_dir=str(tmp_path / directory),
            database=DatabaseSettings(url=db_url),
            admin=AdminSettings(token="t" * 32),
        )  # fmt: skip

    first = await Worker.create(settings("fed1", "a"))
    try:
        with pytest.raises(StartupError, match="running as instance 'fed1'"):
            await Worker.create(settings("fed1", "b"))
        other = await Worker.create(settings("fed2", "c"))
        await other.stop()
    finally:
        await first.stop()
    again = await Worker.create(settings("fed1", "b"))
    await again.stop()


def test_worker_process_that_loses_its_lock_to_another_stops_at_once(
    pg_url: str, pg_engine: AsyncEngine, pg_cluster: PostgresCluster, tmp_path: Path
) -> None:
    """The worker's lock connection is terminated and another process takes the lock
    before the worker can take it again: the worker stops with exit status 1 and one
    ERROR line naming what happened, no traceback (``pg_engine``: the schema migrated)."""
    config = tmp_path / "ours.yaml"
    config.write_text(json.dumps({
        "instance_name": "fed1", "data_dir": str(tmp_path / "data"),
        "database": {"url": pg_url}, "admin": {"enabled": False},
        "telemetry": {"metrics_port": None},
    }))  # fmt: skip
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "federation_sender", "worker", "-c", str(config)],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=dict(os.environ),
        )  # fmt: skip
    try:
        clock = SystemClock()
        deadline = clock.monotonic_s() + 30
        while "took the instance lock" not in log_path.read_text() or not _holder_pid(
            pg_cluster
        ):
            assert proc.poll() is None, log_path.read_text()
            assert clock.monotonic_s() < deadline, log_path.read_text()
            threading.Event().wait(0.05)  # polling a child's log and pg_locks

        async def take_it() -> PostgresInstanceLock:
            other = _lock(pg_url)
            pg_cluster.psql(f"SELECT pg_terminate_backend({_holder_pid(pg_cluster)}, 5000)")
            await other.acquire()
            return other

        other = asyncio.run(take_it())
        try:
            assert proc.wait(20) == 1
        finally:
            asyncio.run(other.release())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert "Traceback" not in text
    stops = [ln for ln in text.splitlines() if "stopping at once" in ln]
    assert len(stops) == 1 and " ERROR " in stops[0], text[-2000:]
    assert "lost the instance lock of 'fed1': another process took it" in stops[0]
