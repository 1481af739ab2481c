"""The worker's background tasks run under its one supervisor, and its stop leaves none
behind, in the stop order of ``app/worker.py``: the intake first, then the queues drain
(the shard heartbeat still renewing leases meanwhile), then the heartbeat."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from federation_sender.app.worker import Worker
from federation_sender.clock import SystemClock
from federation_sender.config import (
    AdminSettings,
    DatabaseSettings,
    ReplicationSettings,
    Settings,
    ShardingSettings,
    TelemetrySettings,
)
from federation_sender.queue.housekeeping import EVICTION, SWEEP
from federation_sender.queue.manager import FANOUT
from federation_sender.replication.server import ReplicationWriter
from federation_sender.replication.tcp import TcpReplicationServer
from federation_sender.sharding import HEARTBEAT
from federation_sender.transport.result import SendResult, Transaction

LOCAL = "local.test"
INTAKE = {"instance-lock", "replication", "typing-resend", "receipt-wakeups", "memory-trim"}
PARTS = {HEARTBEAT, FANOUT, SWEEP, EVICTION}


class NoSends:
    """No event is written: nothing is sent."""

    async def send_transaction(self, txn: Transaction) -> SendResult:
        raise AssertionError(f"unexpected transaction to {txn.destination}")


async def test_one_supervisor_runs_every_task_and_the_stop_leaves_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = TcpReplicationServer(ReplicationWriter(LOCAL), clock=SystemClock(), port=0)
    await server.start()
    settings = Settings(
        server_name=LOCAL, instance_name="fed1", data_dir=str(tmp_path / "data"),
        shutdown_deadline_s=1.0,
        database=DatabaseSettings(url=f"sqlite:///{tmp_path}/w.db"),
        replication=ReplicationSettings(transport="tcp", host="127.0.0.1", port=server.port),
        sharding=ShardingSettings(mode="static", instances=["fed1"]),
        admin=AdminSettings(port=0, token="t" * 32),
        telemetry=TelemetrySettings(metrics_port=None),
    )  # fmt: skip
    worker = await Worker.create(settings, sender=NoSends())
    try:
        await worker.start()
        sup = worker.supervisor
        assert sup is not None
        names = set(sup.names())
        assert names >= PARTS | INTAKE, names
        seen_at_drain: list[set[str]] = []
        drain = worker.manager.stop

        async def stop_queues(deadline_s: float) -> None:
            seen_at_drain.append(set(sup.names()))
            await drain(deadline_s)

        monkeypatch.setattr(worker.manager, "stop", stop_queues)
    finally:
        await worker.stop()
        await server.close()
    (at_drain,) = seen_at_drain
    assert not at_drain & INTAKE  # the intake stopped before the queues drain
    assert HEARTBEAT in at_drain  # leases are renewed while in-flight sends finish
    assert sup.names() == []
    left = {t.get_name() for t in asyncio.all_tasks()} & names
    assert not left, left
