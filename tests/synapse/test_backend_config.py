"""Configuration from Synapse's own files, merged into our settings."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from federation_sender.builders import build_queue_manager
from federation_sender.config import Settings
from federation_sender.errors import ConfigError
from federation_sender.queue.telemetry_observer import TelemetryObserver
from federation_sender.sharding import ShardCoordinator
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.engine import create_engine
from federation_sender.synapse.config import load_synapse_config, parse_duration_ms
from federation_sender.synapse.merge import merge_settings
from federation_sender.telemetry.metrics import Metrics, new_registry
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.http_sender import HttpTransactionSender
from federation_sender.transport.addresses import AddressFilter
from federation_sender.transport.signing import KeyFileError, generate_key_file, load_signing_key

HOMESERVER: dict[str, Any] = {
    "server_name": "example.org",
    "signing_key_path": "/etc/synapse/example.org.signing.key",
    "database": {
        "name": "psycopg2",
        "args": {
            "user": "synapse",
            "password": "p@ss word",
            "dbname": "synapse",
            "host": "db.internal",
            "port": 5433,
            "cp_min": 5,
        },
    },
    "redis": {"enabled": True, "host": "redis.internal", "port": 6380, "dbid": 2},
    "federation_sender_instances": ["fed1", "fed2"],
    "federation_domain_whitelist": ["a.example", "b.example"],
    "ip_range_blacklist": ["203.0.114.0/24"],
    "ip_range_whitelist": ["127.0.0.0/8"],
    "federation": {"destination_min_retry_interval": "5m", "destination_retry_multiplier": 3,
                   "max_long_retries": 4, "max_long_retry_delay": "30s",
                   "max_short_retries": 2, "max_short_retry_delay": 1500},
}


def _write(tmp_path: Path, name: str, data: dict[str, Any]) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return p


def test_homeserver_and_worker_files_merge_into_settings(tmp_path: Path) -> None:
    hs = _write(tmp_path, "homeserver.yaml", HOMESERVER)
    worker = _write(tmp_path, "fed2.yaml", {"worker_app": "synapse.app.generic_worker",
                                            "worker_name": "fed2"})
    syn = load_synapse_config([hs, worker])
    ours = Settings(instance_name="ignored", queue=Settings().queue)
    s = merge_settings(ours, syn)
    assert s.server_name == "example.org"
    assert s.instance_name == "fed2"
    assert s.database.url == "postgresql://synapse:p%40ss%20word@db.internal:5433/synapse"
    assert s.replication.transport == "redis"
    assert s.replication.redis_url == "redis://redis.internal:6380/2"
    assert s.federation.signing_key_path == "/etc/synapse/example.org.signing.key"
    assert s.federation.ip_allow_list == ["127.0.0.0/8"]
    assert s.federation.ip_deny_list == ["203.0.114.0/24"]
    assert s.queue.backoff_initial_s == 300.0
    assert s.queue.backoff_multiplier == 3.0
    assert s.queue.backoff_max_s == 7 * 86400.0
    # The in-request retries of Synapse's sender set our short-retry phase's schedule.
    assert (s.queue.max_long_retries, s.queue.max_long_retry_delay_s) == (4, 30.0)
    assert (s.queue.max_short_retries, s.queue.max_short_retry_delay_s) == (2, 1.5)
    assert (s.sharding.mode, s.sharding.instances) == ("static", ["fed1", "fed2"])
    assert syn.domain_allowed("a.example") and not syn.domain_allowed("c.example")
    # Our own settings stay ours.
    assert s.queue.max_pdus_per_txn == ours.queue.max_pdus_per_txn
    assert s.admin == ours.admin


def test_single_instance_and_no_whitelist(tmp_path: Path) -> None:
    data = dict(HOMESERVER, federation_sender_instances=["fed1"])
    del data["federation_domain_whitelist"]
    syn = load_synapse_config([_write(tmp_path, "hs.yaml", data)])
    s = merge_settings(Settings(instance_name="fed1"), syn)
    assert s.sharding.mode == "single"
    # Synapse's defaults where its file says nothing (synapse/config/federation.py).
    bare = merge_settings(Settings(instance_name="fed1"), load_synapse_config(
        [_write(tmp_path, "bare.yaml", dict(data, federation={}))]))
    q = bare.queue
    assert (q.max_long_retries, q.max_long_retry_delay_s) == (10, 60.0)
    assert (q.max_short_retries, q.max_short_retry_delay_s) == (3, 2.0)
    assert syn.federation_domain_whitelist is None
    assert syn.domain_allowed("anything.example")


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"database": {"name": "sqlite3", "args": {"database": "x.db"}}}, "database.name"),
        ({"redis": {"enabled": False}}, "redis.enabled"),
        ({"federation_sender_instances": ["other"]}, "federation_sender_instances"),
        ({"federation_sender_instances": None}, "federation_sender_instances"),
        ({"server_name": None}, "server_name"),
        ({"federation": {"destination_min_retry_interval": "soon"}},
         "federation.destination_min_retry_interval"),
        ({"federation": {"max_long_retries": "many"}}, "federation.max_long_retries"),
        ({"federation": {"max_short_retries": -1}}, "federation.max_short_retries"),
        ({"federation": {"max_long_retry_delay": "1 minute"}},
         "federation.max_long_retry_delay"),
    ],
)
def test_refusals_name_the_key(tmp_path: Path, change: dict[str, Any], key: str) -> None:
    data = dict(HOMESERVER, **change)
    with pytest.raises(ConfigError) as e:
        syn = load_synapse_config([_write(tmp_path, "hs.yaml", data)])
        merge_settings(Settings(instance_name="fed1"), syn)
    assert e.value.key == key
    assert "\n" not in str(e.value)


def test_durations() -> None:
    assert parse_duration_ms("k", "10m") == 600_000
    assert parse_duration_ms("k", "7d") == 7 * 86_400_000
    assert parse_duration_ms("k", 1500) == 1500
    assert parse_duration_ms("k", "250ms") == 250


def test_unix_socket_redis_and_database(tmp_path: Path) -> None:
    data = dict(
        HOMESERVER,
        database={"name": "psycopg2", "args": {"dbname": "s", "host": "/run/postgresql"}},
        redis={"enabled": True, "path": "/run/redis.sock"},
    )
    syn = load_synapse_config([_write(tmp_path, "hs.yaml", data)])
    assert syn.database_url == "postgresql:///s?host=/run/postgresql"
    assert syn.redis_url == "unix:///run/redis.sock"


def test_synapse_key_file_mode_0644_is_accepted_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "signing.key"
    key = generate_key_file(path)
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError):
        load_signing_key(path)
    with caplog.at_level(logging.WARNING):
        assert load_signing_key(path, others_may_read=True).key_id == key.key_id
    assert len([r for r in caplog.records if "mode 644" in r.getMessage()]) == 1
    os.chmod(path, 0o646)  # writable by others: still refused
    with pytest.raises(KeyFileError):
        load_signing_key(path, others_may_read=True)


def test_ip_range_blacklist_refuses_and_whitelist_wins() -> None:
    f = AddressFilter(allow=["8.8.4.0/24"], deny=["8.8.0.0/16"])
    assert not f.is_allowed("8.8.8.8")
    assert f.is_allowed("8.8.4.4")
    assert f.is_allowed("1.1.1.1")
    assert not f.is_allowed("10.0.0.1")


async def test_domain_whitelist_gates_every_queue(sqlite_url: str, tmp_path: Path) -> None:
    """Beside Synapse, a destination outside federation_domain_whitelist gets no queue
    (so no EDU either), as Synapse's ``_get_per_destination_queue`` returns none."""
    settings = Settings(instance_name="fed1", data_dir=str(tmp_path))
    engine = create_engine(sqlite_url)
    try:
        observer = TelemetryObserver(Metrics(new_registry()), None, FakeClock())
        shards = ShardCoordinator(engine, "fed1", FakeClock(), settings.sharding)
        sender = HttpTransactionSender("http://127.0.0.1:9", "example.org", FakeClock())
        args = (settings, NativeBackend(engine), sender, FakeClock(), observer, shards)
        gated = build_queue_manager(*args, domain_allowed={"a.example"}.__contains__)
        assert gated.shard_filter("a.example") and not gated.shard_filter("b.example")
        assert build_queue_manager(*args).shard_filter("b.example")
    finally:
        await engine.dispose()
