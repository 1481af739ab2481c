"""A real Synapse verifies our worker's signatures, fetching its key over HTTPS.

The worker runs standalone (its own database, no main process) as ``localhost:<port>``
with its key listener on that port, serving TLS with a certificate from the test CA.
It sends a to-device message to Synapse's main; Synapse fetches our key from
``https://localhost:<port>/_matrix/key/v2/server``, verifies the X-Matrix signature,
accepts the transaction and hands the message to Alice's device. Served over plain
HTTP (before the fix), Synapse answers 401 "Failed to find any key": the test fails at
the first refused attempt instead of waiting for a retry after the backoff.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from federation_sender.app.worker import Worker
from federation_sender.clock import SystemClock
from federation_sender.config import (
    AdminSettings,
    DatabaseSettings,
    FederationSettings,
    QueueSettings,
    ReplicationSettings,
    Settings,
    TelemetrySettings,
)
from federation_sender.storage.destinations import ensure_destinations
from federation_sender.storage.engine import create_engine
from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.ports import free_port
from federation_sender.testing.queue_writer import HomeserverWriter
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_deployment import SynapseDeployment

WAIT_S = 30.0


def worker_settings(tmp_path: Path, ca: LoopbackCA, port: int) -> Settings:
    certs = ca.issue(tmp_path / "tls", ["localhost", "127.0.0.1"])
    return Settings(
        server_name=f"localhost:{port}",
        data_dir=str(tmp_path),
        database=DatabaseSettings(url=f"sqlite:///{tmp_path}/worker.db"),
        replication=ReplicationSettings(transport="none", poll_interval_s=0.05),
        federation=FederationSettings(
            signing_key_path=str(tmp_path / "signing.key"),
            extra_ca_file=str(ca.cert_path),  # Synapse's certificate is from the test CA
            ip_allow_list=["127.0.0.0/8", "::1/128"],
            request_timeout_s=20.0,
            key_listener_port=port,
            tls_certificate_path=str(certs.cert),
            tls_private_key_path=str(certs.key),
        ),
        queue=QueueSettings(wakeup_interval_s=0.2),
        admin=AdminSettings(enabled=False),
        telemetry=TelemetrySettings(metrics_port=None),
    )


async def to_device_messages(
    d: SynapseDeployment, user: User, worker: Worker, destination: str
) -> list[dict[str, Any]]:
    """Long-poll Alice's sync until to-device messages arrive; fail at once if the
    worker's transaction to Synapse was refused."""
    since = (await asyncio.to_thread(d.client.sync, user))["next_batch"]
    clock = SystemClock()
    deadline = clock.monotonic_s() + WAIT_S
    while clock.monotonic_s() < deadline:
        status = worker.manager.status(destination)
        assert status is None or status.last_error is None, status
        body = await asyncio.to_thread(d.client.sync, user, since, 200)
        events: list[dict[str, Any]] = body.get("to_device", {}).get("events", [])
        if events:
            return events
        since = body["next_batch"]
    raise AssertionError(f"no to-device message within {WAIT_S} s")


async def test_synapse_accepts_our_worker_transaction_with_key_over_tls(
    synapse_deployment: SynapseDeployment, loopback_ca: LoopbackCA, tmp_path: Path
) -> None:
    d = synapse_deployment
    alice = await asyncio.to_thread(d.client.register, f"alice_{uuid.uuid4().hex[:8]}")
    settings = worker_settings(tmp_path, loopback_ca, free_port())
    worker = await Worker.create(settings)
    writer_engine = create_engine(settings.database.url)
    marker = uuid.uuid4().hex
    try:
        await worker.start()
        writer = await HomeserverWriter(writer_engine, settings.server_name).init()
        async with writer_engine.begin() as conn:  # as main records a new destination
            await ensure_destinations(conn, [d.server_name])
        await writer.to_device(
            d.server_name,
            {
                "sender": f"@bob:{settings.server_name}",
                "type": "org.example.key_over_tls",
                "message_id": marker,
                "messages": {alice.user_id: {alice.device_id: {"marker": marker}}},
            },
        )
        events = await to_device_messages(d, alice, worker, d.server_name)
    finally:
        await worker.stop(deadline_s=1.0)
        await writer_engine.dispose()
    assert [(e["sender"], e["content"]) for e in events] == [
        (f"@bob:{settings.server_name}", {"marker": marker})
    ]
