"""The real-Synapse deployment harness: main on PostgreSQL and Redis, its own sender."""

from __future__ import annotations

import os
import stat

from federation_sender.testing.replication_tap import ReplicationTap
from federation_sender.testing.synapse_deployment import SynapseDeployment


def test_main_runs_on_postgres_with_workers_configured(
    synapse_deployment: SynapseDeployment,
) -> None:
    d = synapse_deployment
    assert d.main.running
    assert d.database_url.startswith("postgresql://")
    assert d.sql("SHOW lc_collate").strip() == "C"
    assert d.sql("SELECT version FROM schema_version").strip() == "94"
    assert d.homeserver_yaml.exists() and d.worker_yaml.exists()
    assert stat.S_IMODE(os.stat(d.signing_key_path).st_mode) & 0o077 == 0


def test_client_api_and_own_federation_sender(synapse_deployment: SynapseDeployment) -> None:
    d = synapse_deployment
    alice = d.client.register("harness_alice")
    room_id = d.client.create_room(alice)
    event_id = d.client.send_message(alice, room_id, "hello")
    assert d.sql(f"SELECT room_id FROM events WHERE event_id = '{event_id}'").strip() == room_id
    assert d.client.joined_members(alice, room_id) == [alice.user_id]
    with ReplicationTap(d.redis_url, d.server_name) as tap:
        d.start_federation_sender()
        try:
            assert d.sender is not None and d.sender.running
            # The worker joined replication on Redis under the configured instance name.
            tap.wait_for(
                lambda lines: f"POSITION caches {d.instance_name} " in "\n".join(lines),
                what="the worker's POSITION caches",
            )
        finally:
            d.stop_federation_sender()
    assert not d.sender.running
