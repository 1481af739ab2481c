"""Configuration taken from Synapse's own files (``homeserver.yaml`` and a worker file).

``federation-sender worker --synapse-config homeserver.yaml [--synapse-config fed1.yaml]``
reads the files in order, later top-level keys replacing earlier ones (as Synapse
merges ``-c`` files), and takes from them only what a federation sender shares with
the deployment: ``server_name``, ``database``, ``redis``, ``signing_key_path``,
``worker_name``, ``federation_sender_instances``, ``federation_domain_whitelist``, the IP
range settings, TLS verification (``federation_verify_certificates``,
``federation_custom_ca_list``), the destination retry settings and the in-request retry
settings (``federation.max_long_retries`` and the three others, for our short-retry
phase). Everything else of
ours (queue sizes, admin API, telemetry) stays in our own file.

Refused with one :class:`ConfigError` line: a SQLite database (Synapse workers need
PostgreSQL), Redis disabled (Synapse workers replicate over Redis), and a deployment
whose ``federation_sender_instances`` does not name our instance (main would then send
federation itself, or another worker would, and events would go out twice).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from federation_sender.config import Settings, _validate
from federation_sender.errors import ConfigError

# Synapse's defaults (synapse/config/federation.py).
_DEFAULT_MIN_RETRY_MS = 10 * 60 * 1000
_DEFAULT_MAX_RETRY_MS = 7 * 24 * 3600 * 1000
_DURATION_UNITS = {
    "ms": 1,
    "s": 1000,
    "m": 60 * 1000,
    "h": 3600 * 1000,
    "d": 86400 * 1000,
    "w": 7 * 86400 * 1000,
    "y": 365 * 86400 * 1000,
}


@dataclass(frozen=True)
class SynapseConfig:
    """What we take from Synapse's configuration; see the module docstring."""

    server_name: str
    database_url: str
    redis_url: str
    signing_key_path: str
    worker_name: str | None
    federation_sender_instances: tuple[str, ...]
    federation_domain_whitelist: frozenset[str] | None
    """None: every domain is allowed (Synapse's meaning of an absent whitelist)."""
    ip_range_blacklist: tuple[str, ...]
    ip_range_whitelist: tuple[str, ...]
    verify_tls: bool
    extra_ca_file: str | None
    """``federation_custom_ca_list`` (one file; several are refused: concatenate them)."""
    min_retry_interval_ms: int
    retry_multiplier: float
    max_retry_interval_ms: int
    max_long_retries: int = 10
    max_long_retry_delay_ms: int = 60_000
    max_short_retries: int = 3
    max_short_retry_delay_ms: int = 2_000
    """``federation.max_{long,short}_retr{ies,y_delay}``: our short-retry phase's schedule
    (Synapse's sender uses them for the retries inside each request)."""
    allow_device_name_lookup_over_federation: bool = False
    """Device display names go in ``m.device_list_update`` only when this is set."""
    presence_enabled: bool = True
    """``presence.enabled``; off: the presence streams are not consumed."""
    rooms_to_exclude_from_presence: frozenset[str] = frozenset()
    presence_last_active_granularity_ms: int = 60_000
    federation_rr_transactions_per_room_per_second: float = 50.0

    def domain_allowed(self, destination: str) -> bool:
        wl = self.federation_domain_whitelist
        return wl is None or destination in wl


def parse_duration_ms(key: str, value: object) -> int:
    """Synapse's duration syntax: an integer of milliseconds, or ``<n><unit>``."""
    if isinstance(value, bool):
        raise ConfigError(key, "a duration such as 10m or 60000", value)
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*(ms|s|m|h|d|w|y)?\s*", value)
        if m:
            return int(m.group(1)) * _DURATION_UNITS[m.group(2) or "ms"]
    raise ConfigError(key, "a duration such as 10m or 60000", value)


def read_synapse_files(paths: Sequence[str | Path]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for path in paths:
        p = Path(path)
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except OSError as e:
            where = f"a readable file at {str(p)!r}"
            raise ConfigError("--synapse-config", where, e.strerror) from e
        except yaml.YAMLError as e:
            raise ConfigError("--synapse-config", f"valid YAML in {str(p)!r}") from e
        if loaded is None:
            continue
        if not isinstance(loaded, dict):
            raise ConfigError("--synapse-config", f"a YAML mapping in {str(p)!r}")
        merged.update(loaded)
    return merged


def _database_url(db: object) -> str:
    if not isinstance(db, Mapping):
        raise ConfigError("database", "a mapping with name: psycopg2 and args", db)
    name = db.get("name", "sqlite3")
    if name not in ("psycopg2", "psycopg"):
        raise ConfigError(
            "database.name", "psycopg2 (Synapse workers need PostgreSQL)", name
        )
    args = db.get("args") or {}
    if not isinstance(args, Mapping):
        raise ConfigError("database.args", "a mapping", args)
    dbname = args.get("dbname") or args.get("database")
    if not dbname:
        raise ConfigError("database.args.dbname", "a database name", None)
    user = args.get("user")
    password = args.get("password")
    auth = ""
    if user:
        auth = quote(str(user), safe="")
        if password:
            auth += ":" + quote(str(password), safe="")
        auth += "@"
    host = str(args.get("host") or "")
    port = args.get("port")
    query: list[str] = []
    if host.startswith("/"):
        query.append("host=" + quote(host, safe="/"))
        host = ""
    netloc = auth + host + (f":{port}" if port and host else "")
    if port and not host:
        query.append(f"port={port}")
    for key in ("sslmode", "sslrootcert", "sslcert", "sslkey", "application_name"):
        if args.get(key):
            query.append(f"{key}={quote(str(args[key]), safe='/')}")
    url = f"postgresql://{netloc}/{quote(str(dbname), safe='')}"
    return url + ("?" + "&".join(query) if query else "")


def _redis_url(redis: object) -> str:
    if not isinstance(redis, Mapping) or not redis.get("enabled", False):
        raise ConfigError(
            "redis.enabled", "true (Synapse workers replicate over Redis)", None
        )
    dbid = redis.get("dbid")
    path = redis.get("path")
    user = redis.get("username")
    password = redis.get("password")
    if password is None and redis.get("password_path"):
        try:
            password = Path(str(redis["password_path"])).read_text().strip()
        except OSError as e:
            raise ConfigError("redis.password_path", "a readable file", e.strerror) from e
    auth = ""
    if password:
        auth = (quote(str(user), safe="") if user else "") + ":" + quote(str(password), safe="")
        auth += "@"
    if path:
        q = f"?db={int(dbid)}" if dbid is not None else ""
        return f"unix://{auth}{path}{q}"
    scheme = "rediss" if redis.get("use_tls") else "redis"
    host = redis.get("host", "localhost")
    port = int(redis.get("port", 6379))
    return f"{scheme}://{auth}{host}:{port}/{int(dbid) if dbid is not None else 0}"


def _str_list(key: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(key, "a list of strings", value)
    return tuple(value)


def _count(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(key, "an integer >= 0", value)
    return value


def parse_synapse_config(tree: Mapping[str, Any]) -> SynapseConfig:
    server_name = tree.get("server_name")
    if not isinstance(server_name, str) or not server_name:
        raise ConfigError("server_name", "the homeserver's server name", server_name)
    key_path = tree.get("signing_key_path")
    if not isinstance(key_path, str) or not key_path:
        raise ConfigError("signing_key_path", "the path of Synapse's signing key", key_path)
    worker_name = tree.get("worker_name")
    if worker_name is not None and not isinstance(worker_name, str):
        raise ConfigError("worker_name", "a string", worker_name)
    whitelist = tree.get("federation_domain_whitelist")
    fed = tree.get("federation") or {}
    if not isinstance(fed, Mapping):
        raise ConfigError("federation", "a mapping", fed)
    multiplier = fed.get("destination_retry_multiplier", 2)
    if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)):
        raise ConfigError("federation.destination_retry_multiplier", "a number", multiplier)
    blacklist = tree.get("federation_ip_range_blacklist", tree.get("ip_range_blacklist"))
    cas = _str_list("federation_custom_ca_list", tree.get("federation_custom_ca_list"))
    if len(cas) > 1:
        raise ConfigError(
            "federation_custom_ca_list", "at most one file (concatenate the certificates)", cas
        )
    presence = tree.get("presence") or {}
    if not isinstance(presence, Mapping):
        raise ConfigError("presence", "a mapping", presence)
    presence_on = presence.get("enabled")
    if presence_on is None:
        presence_on = tree.get("use_presence", True)
    rr = tree.get("federation_rr_transactions_per_room_per_second", 50)
    if isinstance(rr, bool) or not isinstance(rr, (int, float)) or rr <= 0:
        raise ConfigError(
            "federation_rr_transactions_per_room_per_second", "a positive number", rr
        )
    return SynapseConfig(
        server_name=server_name,
        database_url=_database_url(tree.get("database")),
        redis_url=_redis_url(tree.get("redis")),
        signing_key_path=key_path,
        worker_name=worker_name,
        federation_sender_instances=_str_list(
            "federation_sender_instances", tree.get("federation_sender_instances")
        ),
        federation_domain_whitelist=(
            None
            if whitelist is None
            else frozenset(_str_list("federation_domain_whitelist", whitelist))
        ),
        ip_range_blacklist=_str_list("ip_range_blacklist", blacklist),
        ip_range_whitelist=_str_list("ip_range_whitelist", tree.get("ip_range_whitelist")),
        verify_tls=bool(tree.get("federation_verify_certificates", True)),
        extra_ca_file=cas[0] if cas else None,
        min_retry_interval_ms=parse_duration_ms(
            "federation.destination_min_retry_interval",
            fed.get("destination_min_retry_interval", _DEFAULT_MIN_RETRY_MS),
        ),
        retry_multiplier=float(multiplier),
        max_retry_interval_ms=min(
            parse_duration_ms(
                "federation.destination_max_retry_interval",
                fed.get("destination_max_retry_interval", _DEFAULT_MAX_RETRY_MS),
            ),
            2**62,
        ),
        max_long_retries=_count("federation.max_long_retries",
                                fed.get("max_long_retries", 10)),
        max_long_retry_delay_ms=parse_duration_ms(
            "federation.max_long_retry_delay", fed.get("max_long_retry_delay", "60s")
        ),
        max_short_retries=_count("federation.max_short_retries",
                                 fed.get("max_short_retries", 3)),
        max_short_retry_delay_ms=parse_duration_ms(
            "federation.max_short_retry_delay", fed.get("max_short_retry_delay", "2s")
        ),
        allow_device_name_lookup_over_federation=bool(
            tree.get("allow_device_name_lookup_over_federation", False)
        ),
        presence_enabled=bool(presence_on),
        rooms_to_exclude_from_presence=frozenset(
            _str_list("exclude_rooms_from_presence", tree.get("exclude_rooms_from_presence"))
        ),
        presence_last_active_granularity_ms=parse_duration_ms(
            "presence.last_active_granularity", presence.get("last_active_granularity", 60_000)
        ),
        federation_rr_transactions_per_room_per_second=float(rr),
    )


def load_synapse_config(paths: Sequence[str | Path]) -> SynapseConfig:
    return parse_synapse_config(read_synapse_files(paths))


def merge_settings(settings: Settings, syn: SynapseConfig) -> Settings:
    """Our settings with the deployment's facts from Synapse's files.

    The instance name is the worker file's ``worker_name`` when given, else ours; either
    way it must be one of ``federation_sender_instances``. Several instances shard
    statically by Synapse's rule (sha256 of the destination, little-endian, modulo N),
    which is our ``static`` mode with Synapse's list."""
    instance = syn.worker_name or settings.instance_name
    if instance not in syn.federation_sender_instances:
        raise ConfigError(
            "federation_sender_instances",
            f"a list naming this worker ({instance!r}); otherwise main or another "
            "worker sends federation and events would go out twice",
            list(syn.federation_sender_instances) or None,
        )
    instances = list(syn.federation_sender_instances)
    sharding = dataclasses.replace(
        settings.sharding,
        mode="static" if len(instances) > 1 else "single",
        instances=instances if len(instances) > 1 else [],
    )
    fed = dataclasses.replace(
        settings.federation,
        signing_key_path=syn.signing_key_path,
        verify_tls=syn.verify_tls,
        extra_ca_file=syn.extra_ca_file or settings.federation.extra_ca_file,
        ip_allow_list=list(syn.ip_range_whitelist),
        ip_deny_list=list(syn.ip_range_blacklist),
    )
    queue = dataclasses.replace(
        settings.queue,
        backoff_initial_s=syn.min_retry_interval_ms / 1000.0,
        backoff_multiplier=syn.retry_multiplier,
        backoff_max_s=syn.max_retry_interval_ms / 1000.0,
        max_long_retries=syn.max_long_retries,
        max_long_retry_delay_s=syn.max_long_retry_delay_ms / 1000.0,
        max_short_retries=syn.max_short_retries,
        max_short_retry_delay_s=syn.max_short_retry_delay_ms / 1000.0,
    )
    merged = dataclasses.replace(
        settings,
        server_name=syn.server_name,
        instance_name=instance,
        database=dataclasses.replace(settings.database, url=syn.database_url),
        replication=dataclasses.replace(
            settings.replication, transport="redis", redis_url=syn.redis_url
        ),
        federation=fed,
        queue=queue,
        sharding=sharding,
    )
    _validate(merged)
    return merged
