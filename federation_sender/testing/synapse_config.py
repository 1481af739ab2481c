"""Synapse's configuration files for a loopback test deployment (pure functions).

Main gets three listeners on 127.0.0.1: federation (TLS, with a certificate from the
test CA), client (plain HTTP) and, when workers are configured, replication (plain
HTTP, the ``instance_map`` entry for ``main``). Federation sending belongs to the
worker named in ``federation_sender_instances``; in Synapse that list alone
takes sending away from main (the legacy ``send_federation: false`` is implied and
must not be set beside it).

Outbound federation verifies certificates against the test CA
(``federation_custom_ca_list``) and may reach loopback (``ip_range_whitelist``):
both are needed for peers named ``localhost:<port>``. Rate limits are raised so that
scripted traffic is never throttled, and a failing outbound request gives up after
about a second; everything else stays at Synapse's defaults.

With ``event_persisters``, events are persisted by those generic workers
(``stream_writers.events``, one ``instance_map`` entry each), not by main: each room's
events go to one of them by a hash of the room id.

Every file is written as JSON, which is YAML.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOOPBACK_RANGES = ["127.0.0.0/8", "::1/128"]
_UNLIMITED = {"per_second": 10000, "burst_count": 100000}
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request)s] %(message)s"


@dataclass(frozen=True)
class SynapsePorts:
    federation: int
    client: int
    replication: int
    worker_health: int


@dataclass(frozen=True)
class PostgresDatabase:
    host: str
    port: int
    user: str
    name: str

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{self.name}"


@dataclass(frozen=True)
class RedisAddress:
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"


@dataclass(frozen=True)
class EventPersister:
    """A generic worker named in ``stream_writers.events``: its one listener serves
    HTTP replication (its ``instance_map`` entry: main hands it events to persist) and
    ``/health``."""

    name: str
    port: int


@dataclass(frozen=True)
class SynapseLayout:
    """Everything the configuration files depend on."""

    directory: Path
    server_name: str
    ports: SynapsePorts
    tls_cert: Path
    tls_key: Path
    ca_cert: Path
    database: PostgresDatabase | None
    redis: RedisAddress | None
    instance_name: str
    shared_secret: str
    replication_secret: str
    macaroon_secret: str
    event_persisters: tuple[EventPersister, ...] = ()

    @property
    def has_workers(self) -> bool:
        return self.redis is not None

    @property
    def signing_key(self) -> Path:
        return self.directory / "signing.key"


def log_config(path: Path) -> dict[str, Any]:
    return {
        "version": 1,
        "formatters": {"plain": {"format": LOG_FORMAT}},
        "filters": {"context": {"()": "synapse.logging.context.LoggingContextFilter"}},
        "handlers": {
            "file": {
                "class": "logging.FileHandler",
                "filename": str(path),
                "formatter": "plain",
                "filters": ["context"],
            }
        },
        "root": {"level": "INFO", "handlers": ["file"]},
        "disable_existing_loggers": False,
    }


def _listener(port: int, names: list[str], *, tls: bool = False) -> dict[str, Any]:
    return {
        "port": port,
        "bind_addresses": ["127.0.0.1"],
        "type": "http",
        "tls": tls,
        "x_forwarded": False,
        "resources": [{"names": names, "compress": False}],
    }


def _database(layout: SynapseLayout) -> dict[str, Any]:
    db = layout.database
    if db is None:
        return {"name": "sqlite3", "args": {"database": str(layout.directory / "homeserver.db")}}
    return {
        "name": "psycopg2",
        "args": {
            "user": db.user,
            "host": db.host,
            "port": db.port,
            "database": db.name,
            "cp_min": 1,
            "cp_max": 5,
        },
    }


_CLIENT_RATE_LIMITS: dict[str, Any] = {
    "rc_message": _UNLIMITED,
    "rc_registration": _UNLIMITED,
    "rc_joins": {"local": _UNLIMITED, "remote": _UNLIMITED},
    "rc_joins_per_room": _UNLIMITED,
    "rc_login": {"address": _UNLIMITED, "account": _UNLIMITED},
    "rc_invites": {"per_room": _UNLIMITED, "per_user": _UNLIMITED},
}
"""Tests register, log in, join and send as fast as they can."""


def homeserver_config(layout: SynapseLayout) -> dict[str, Any]:
    """``homeserver.yaml`` for main (also read by every worker)."""
    d = layout.directory
    listeners = [
        _listener(layout.ports.federation, ["federation"], tls=True),
        _listener(layout.ports.client, ["client"]),
    ]
    config: dict[str, Any] = {
        "server_name": layout.server_name,
        "pid_file": str(d / "homeserver.pid"),
        "public_baseurl": f"http://127.0.0.1:{layout.ports.client}/",
        "listeners": listeners,
        "tls_certificate_path": str(layout.tls_cert),
        "tls_private_key_path": str(layout.tls_key),
        "database": _database(layout),
        "log_config": str(d / "main.log.yaml"),
        "media_store_path": str(d / "media"),
        "signing_key_path": str(layout.signing_key),
        "report_stats": False,
        "enable_metrics": False,
        "registration_shared_secret": layout.shared_secret,
        "macaroon_secret_key": layout.macaroon_secret,
        "form_secret": layout.macaroon_secret + "-form",
        "federation_verify_certificates": True,
        "federation_custom_ca_list": [str(layout.ca_cert)],
        "ip_range_whitelist": LOOPBACK_RANGES,
        "trusted_key_servers": [],
        "suppress_key_server_warning": True,
        "rc_federation": {
            "window_size": 1000,
            "sleep_limit": 10000,
            "sleep_delay": 1,
            "reject_limit": 10000,
            "concurrent": 100,
        },
        # A failing request gives up after about a second instead of ~10 minutes of
        # in-request retries (a test sees the failure); the persisted backoff schedule
        # (destination_*_retry_interval) stays Synapse's default.
        "federation": {
            "client_timeout": "20s",
            "max_long_retries": 2,
            "max_long_retry_delay": 500,
            "max_short_retries": 1,
            "max_short_retry_delay": 200,
        },
        **_CLIENT_RATE_LIMITS,
    }
    if layout.redis is not None:
        listeners.append(_listener(layout.ports.replication, ["replication"]))
        config.update(_workers(layout, layout.redis))
    return config


def _workers(layout: SynapseLayout, redis: RedisAddress) -> dict[str, Any]:
    """Main's keys for workers: Redis, the replication listener's address, the shared
    secret, our sender instance, and the event persisters when there are any."""
    instance_map = {"main": {"host": "127.0.0.1", "port": layout.ports.replication}}
    keys: dict[str, Any] = {
        "redis": {"enabled": True, "host": redis.host, "port": redis.port},
        "instance_map": instance_map,
        "worker_replication_secret": layout.replication_secret,
        "federation_sender_instances": [layout.instance_name],
    }
    if layout.event_persisters:
        for p in layout.event_persisters:
            instance_map[p.name] = {"host": "127.0.0.1", "port": p.port}
        keys["stream_writers"] = {"events": [p.name for p in layout.event_persisters]}
    return keys


def worker_config(layout: SynapseLayout) -> dict[str, Any]:
    """The worker file of Synapse's own federation sender, ``<instance>.yaml``.

    It listens only for ``/health`` (every Synapse HTTP listener serves it), which is
    how the harness knows the worker has started.
    """
    return {
        "worker_app": "synapse.app.generic_worker",
        "worker_name": layout.instance_name,
        "worker_listeners": [_listener(layout.ports.worker_health, ["health"])],
        "worker_log_config": str(layout.directory / "worker.log.yaml"),
    }


def persister_config(layout: SynapseLayout, persister: EventPersister) -> dict[str, Any]:
    """The worker file of an event persister, ``<name>.yaml``."""
    return {
        "worker_app": "synapse.app.generic_worker",
        "worker_name": persister.name,
        "worker_listeners": [_listener(persister.port, ["replication"])],
        "worker_log_config": str(layout.directory / f"{persister.name}.log.yaml"),
    }


def minimal_worker_tree(**keys: Any) -> dict[str, Any]:
    """The smallest homeserver.yaml + worker tree :func:`~federation_sender.synapse.config.
    parse_synapse_config` accepts for a federation sender named ``fed1`` (no file, no
    server behind it: for tests of parsing and of what is built from the result), with
    ``keys`` added or replaced; a key given as None is left out."""
    tree: dict[str, Any] = {
        "server_name": "a.example",
        "signing_key_path": "/etc/synapse/a.key",
        "worker_name": "fed1",
        "database": {"name": "psycopg2", "args": {"dbname": "synapse", "host": "db"}},
        "redis": {"enabled": True},
        "federation_sender_instances": ["fed1"],
    }
    tree.update(keys)
    return {k: v for k, v in tree.items() if v is not None}
