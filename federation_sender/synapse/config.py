"""Configuration taken from Synapse's own files (``homeserver.yaml`` and a worker file).

``federation-sender worker --synapse-config homeserver.yaml [--synapse-config fed1.yaml]``
reads the files in order, later top-level keys replacing earlier ones (as Synapse
merges ``-c`` files), and takes from them every key Synapse's federation sender reads:
docs/synapse.md, "Every key the sender reads", is the list, with what each becomes
(``tests/synapse/test_key_table.py`` proves each row). Everything else of ours (queue
sizes, admin API, telemetry) stays in our own file.

Refused with one :class:`ConfigError` line: a SQLite database (Synapse workers need
PostgreSQL), Redis disabled (Synapse workers replicate over Redis), a deployment whose
``federation_sender_instances`` does not name our instance (main would then send
federation itself, or another worker would, and events would go out twice), keys whose
effect we do not implement (:data:`REFUSED`), duties of Synapse's given to our instance
(:data:`DUTIES`), ``outbound_federation_restricted_to`` without us, and worker
listeners for resources we do not serve.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from federation_sender.config import ENV_PREFIX, Settings, _validate
from federation_sender.errors import ConfigError
from federation_sender.transport.forward_proxy import ProxyPolicy, policy_from_environment
from federation_sender.transport.http import TLS_VERSIONS
from federation_sender.transport.outbound_proxy import (
    ProxyLocation,
    location_from_instance_map,
)

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
    allow_device_name_lookup_over_federation: bool = False
    """Device display names go in ``m.device_list_update`` only when this is set."""
    presence_enabled: bool = True
    """``presence.enabled``; off: the presence streams are not consumed."""
    rooms_to_exclude_from_presence: frozenset[str] = frozenset()
    presence_last_active_granularity_ms: int = 60_000
    federation_rr_transactions_per_room_per_second: float = 50.0
    event_writers: tuple[str, ...] = ("master",)
    """``stream_writers.events``: the processes that persist events (main, ``master``,
    by default). The events intake reads only below what all of them finished."""
    # --- egress (docs/synapse.md, "Egress") -------------------------------------------
    worker_replication_secret: str | None = field(default=None, repr=False)
    outbound_federation_restricted_to: tuple[str, ...] | None = None
    """None: every instance may contact remote servers (the key is absent)."""
    instance_map: Mapping[str, Any] = field(default_factory=dict)
    worker_listeners: tuple[Any, ...] = ()
    tls_certificate_path: str | None = None
    tls_private_key_path: str | None = None
    ca_files: tuple[str, ...] = ()
    """``federation_custom_ca_list``: the only CAs trusted, as in Synapse."""
    tls_min_version: str | None = None
    tls_verification_whitelist: tuple[str, ...] = ()
    user_agent_suffix: str | None = None
    http_proxy: str | None = field(default=None, repr=False)
    https_proxy: str | None = field(default=None, repr=False)
    no_proxy_hosts: tuple[str, ...] = ()
    client_timeout_ms: int = 60_000
    max_long_retries: int = 10
    max_short_retries: int = 3
    max_long_retry_delay_ms: int = 60_000
    max_short_retry_delay_ms: int = 2_000
    """``federation.max_{long,short}_retr{ies,y_delay}``: our short-retry phase's schedule
    (Synapse's sender uses them for the retries inside each request)."""
    federation_metrics_domains: frozenset[str] = frozenset()
    worker_app: str | None = None
    duties: Mapping[str, Any] = field(default_factory=dict)
    """The other duties a deployment may give an instance (``run_background_tasks_on``,
    ``pusher_instances``, ``stream_writers``, ...): refused when they name ours."""

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
    if tree.get("federation_custom_ca_list") is not None and not cas:
        raise ConfigError("federation_custom_ca_list", "at least one certificate file", [])
    _refuse_unsupported(tree)
    presence = tree.get("presence") or {}
    if not isinstance(presence, Mapping):
        raise ConfigError("presence", "a mapping", presence)
    presence_on = presence.get("enabled")
    if presence_on is None:
        presence_on = tree.get("use_presence", True)
    writers = tree.get("stream_writers") or {}
    if not isinstance(writers, Mapping):
        raise ConfigError("stream_writers", "a mapping of stream names to instances", writers)
    event_writers = writers.get("events") or ["master"]
    if isinstance(event_writers, str):  # Synapse accepts one name for a list of one
        event_writers = [event_writers]
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
        federation_sender_instances=_sender_instances(tree, worker_name),
        federation_domain_whitelist=(
            None
            if whitelist is None
            else frozenset(_str_list("federation_domain_whitelist", whitelist))
        ),
        ip_range_blacklist=_str_list("ip_range_blacklist", blacklist),
        ip_range_whitelist=_str_list("ip_range_whitelist", tree.get("ip_range_whitelist")),
        verify_tls=bool(tree.get("federation_verify_certificates", True)),
        extra_ca_file=None,
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
        event_writers=_str_list("stream_writers.events", event_writers),
        **_egress(tree, fed, cas),
    )


def _sender_instances(tree: Mapping[str, Any], worker_name: str | None) -> tuple[str, ...]:
    """``federation_sender_instances``, or Synapse's legacy form: ``send_federation:
    false`` with ``worker_app: synapse.app.federation_sender`` names this worker."""
    listed = tree.get("federation_sender_instances")
    if listed is None and tree.get("send_federation", True) is False and (
        tree.get("worker_app") == "synapse.app.federation_sender" and worker_name
    ):
        return (worker_name,)
    return _str_list("federation_sender_instances", listed)


WORKER_APPS = (None, "synapse.app.generic_worker", "synapse.app.federation_sender")
DUTIES = ("run_background_tasks_on", "pusher_instances", "notify_appservices_from_worker",
          "update_user_directory_from_worker", "media_instance_running_background_jobs",
          "stream_writers")
"""Keys that hand a duty to an instance; none may name ours (we do none of them)."""


REFUSED: tuple[tuple[str, str], ...] = (
    ("experimental_features.msc4354_enabled",
     "false or absent: sticky events (MSC4354) are not sent by this worker yet"),
)
"""Keys that change what Synapse's sender does in ways we do not: set, they stop the
worker at start (docs/synapse.md, "Every key the sender reads")."""


def _refuse_unsupported(tree: Mapping[str, Any]) -> None:
    for key, expected in REFUSED:
        section, _, name = key.partition(".")
        value = tree.get(section)
        if isinstance(value, Mapping) and value.get(name):
            raise ConfigError(key, expected, value.get(name))


def _egress(tree: Mapping[str, Any], fed: Mapping[str, Any],
            cas: tuple[str, ...]) -> dict[str, Any]:
    """The keys of outbound connections: proxies, TLS, the client's timeouts, the
    outbound federation proxy's (``outbound_federation_restricted_to``)."""
    secret = tree.get("worker_replication_secret")
    secret_path = tree.get("worker_replication_secret_path")
    if secret is not None and secret_path is not None:
        raise ConfigError("worker_replication_secret_path",
                          "absent when worker_replication_secret is set", "both set")
    if secret_path is not None:
        try:
            secret = Path(str(secret_path)).read_text().strip()
        except OSError as e:
            raise ConfigError("worker_replication_secret_path", "a readable file",
                              e.strerror) from e
    if secret is not None and not isinstance(secret, str):
        raise ConfigError("worker_replication_secret", "a string", None)
    restricted = tree.get("outbound_federation_restricted_to")
    instance_map = tree.get("instance_map") or {}
    if not isinstance(instance_map, Mapping):
        raise ConfigError("instance_map", "a mapping", instance_map)
    listeners = tree.get("worker_listeners") or []
    if not isinstance(listeners, list):
        raise ConfigError("worker_listeners", "a list", listeners)
    min_tls = tree.get("federation_client_minimum_tls_version")
    if min_tls is not None:
        min_tls = str(min_tls)
        if min_tls not in TLS_VERSIONS:
            raise ConfigError("federation_client_minimum_tls_version",
                              "one of 1, 1.1, 1.2, 1.3", min_tls)
    suffix = tree.get("user_agent_suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise ConfigError("user_agent_suffix", "a string", suffix)
    env_http, env_https, env_no = policy_from_environment(os.environ)
    http_proxy = tree.get("http_proxy", env_http)
    https_proxy = tree.get("https_proxy", env_https)
    for key, value in (("http_proxy", http_proxy), ("https_proxy", https_proxy)):
        if value is not None and not isinstance(value, str):
            raise ConfigError(key, "a string", None)
    no_proxy = tree.get("no_proxy_hosts")
    no_proxy_list = (
        _str_list("no_proxy_hosts", no_proxy) if no_proxy is not None else tuple(env_no or ())
    )
    ProxyPolicy.from_settings(http_proxy, https_proxy, no_proxy_list)  # refuses bad values
    worker_app = tree.get("worker_app")
    if worker_app not in WORKER_APPS:
        raise ConfigError("worker_app", "synapse.app.generic_worker (or the legacy "
                          "synapse.app.federation_sender)", worker_app)
    return {
        "worker_app": worker_app,
        "duties": {k: tree[k] for k in DUTIES if tree.get(k) is not None},
        "worker_replication_secret": secret,
        "outbound_federation_restricted_to": (
            None if restricted is None
            else _str_list("outbound_federation_restricted_to", restricted)
        ),
        "instance_map": dict(instance_map),
        "worker_listeners": tuple(listeners),
        "tls_certificate_path": tree.get("tls_certificate_path"),
        "tls_private_key_path": tree.get("tls_private_key_path"),
        "ca_files": cas,
        "tls_min_version": min_tls,
        "tls_verification_whitelist": _ascii_globs(
            tree.get("federation_certificate_verification_whitelist")
        ),
        "user_agent_suffix": suffix,
        "http_proxy": http_proxy,
        "https_proxy": https_proxy,
        "no_proxy_hosts": no_proxy_list,
        "client_timeout_ms": _positive_ms(fed, "client_timeout", 60_000),
        "max_long_retries": _count(fed, "max_long_retries", 10),
        "max_short_retries": _count(fed, "max_short_retries", 3),
        "max_long_retry_delay_ms": _positive_ms(fed, "max_long_retry_delay", 60_000),
        "max_short_retry_delay_ms": _positive_ms(fed, "max_short_retry_delay", 2_000),
        "federation_metrics_domains": frozenset(
            _str_list("federation_metrics_domains", tree.get("federation_metrics_domains"))
        ),
    }


def _ascii_globs(value: object) -> tuple[str, ...]:
    globs = _str_list("federation_certificate_verification_whitelist", value)
    for glob in globs:
        if not glob.isascii():
            raise ConfigError("federation_certificate_verification_whitelist",
                              "ASCII names (IDNA names are not allowed)", glob)
    return globs


def _positive_ms(fed: Mapping[str, Any], name: str, default: int) -> int:
    value = parse_duration_ms(f"federation.{name}", fed.get(name, default))
    if value <= 0:
        raise ConfigError(f"federation.{name}", "a positive duration", fed.get(name))
    return value


def _count(fed: Mapping[str, Any], name: str, default: int) -> int:
    value = fed.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"federation.{name}", "a whole number >= 0", value)
    return value


def refuse_duties(syn: SynapseConfig, instance: str) -> None:
    """A deployment that gives our instance a duty of Synapse's (background tasks,
    pushers, a stream to write, ...) would wait for it forever: refused."""
    for key, value in syn.duties.items():
        if key == "stream_writers":
            if not isinstance(value, Mapping):
                raise ConfigError(key, "a mapping", value)
            for stream, writers in value.items():
                names = [writers] if isinstance(writers, str) else writers
                if isinstance(names, list) and instance in names:
                    raise ConfigError(f"stream_writers.{stream}",
                                      f"other instances than {instance!r} (this worker "
                                      "writes no Synapse stream)", writers)
            continue
        names = [value] if isinstance(value, str) else value
        if isinstance(names, list) and instance in names:
            raise ConfigError(key, f"another instance than {instance!r} (this worker only "
                              "sends federation)", value)


def outbound_proxy_location(syn: SynapseConfig, instance: str) -> ProxyLocation | None:
    """Where our instance serves the outbound federation proxy, or None when the
    deployment does not restrict outbound federation. Refused: a list that does not
    name us (we would have to send through another instance's proxy, which we do not
    do), a listed instance without an ``instance_map`` entry, no shared secret."""
    restricted = syn.outbound_federation_restricted_to
    if not restricted:
        return None
    if instance not in restricted:
        raise ConfigError(
            "outbound_federation_restricted_to",
            f"a list naming this worker ({instance!r}): this worker does not send through "
            "another instance's proxy", list(restricted),
        )  # fmt: skip
    if not syn.worker_replication_secret:
        raise ConfigError("worker_replication_secret",
                          "a secret (outbound_federation_restricted_to is set)", None)
    if instance not in syn.instance_map:
        raise ConfigError(f"instance_map.{instance}",
                          "this worker's address (it is in outbound_federation_restricted_to)",
                          None)
    return location_from_instance_map(syn.instance_map[instance], f"instance_map.{instance}",
                                      ConfigError)


@dataclass(frozen=True)
class ListenerSpec:
    """One ``worker_listeners`` entry we open: ``/health`` and/or metrics."""

    key: str
    port: int
    addresses: tuple[str, ...]
    tls: bool
    health: bool
    metrics: bool


SERVED_RESOURCES = frozenset({"health", "metrics"})


def worker_listener_specs(syn: SynapseConfig, instance: str) -> list[ListenerSpec]:
    """The worker file's listeners, as Synapse's worker would open them, for the
    resources we serve: ``health`` (``GET /health``) and ``metrics`` (also a listener of
    type ``metrics``). The entry on the outbound proxy's port is the proxy's (it answers
    ``/health`` too). Other resources (``client``, ``federation``, ...) are refused:
    routing them here would silently lose their requests."""
    location = outbound_proxy_location(syn, instance)
    proxy_port = location.port if location is not None else None
    specs = []
    for i, listener in enumerate(syn.worker_listeners):
        key = f"worker_listeners[{i}]"
        if not isinstance(listener, Mapping):
            raise ConfigError(key, "a mapping", listener)
        port = listener.get("port")
        kind = listener.get("type", "http")
        if "path" in listener and port is None:
            raise ConfigError(key + ".path", "a TCP listener (port)", listener.get("path"))
        if isinstance(port, bool) or not isinstance(port, int):
            raise ConfigError(key + ".port", "a TCP port", port)
        if port == proxy_port:
            continue
        names: set[str] = set()
        if kind == "metrics":
            names.add("metrics")
        elif kind == "http":
            for resource in listener.get("resources") or []:
                names.update(resource.get("names") or [] if isinstance(resource, Mapping)
                             else [])
            if names - SERVED_RESOURCES:
                raise ConfigError(f"{key}.resources",
                                  "only health and metrics (this worker serves no Synapse "
                                  "API)", sorted(names - SERVED_RESOURCES))
        else:
            raise ConfigError(key + ".type", "http or metrics", kind)
        addresses = listener.get("bind_addresses")
        if addresses is None and isinstance(listener.get("bind_address"), str):
            addresses = [listener["bind_address"]]
        if not addresses:
            # Synapse's default is ['::', '0.0.0.0'], tolerating a host without IPv6;
            # ours is IPv4 only rather than a start that fails there.
            addresses = ["0.0.0.0"]
        specs.append(ListenerSpec(key, port, tuple(str(a) for a in addresses),
                                  bool(listener.get("tls", False)), "health" in names,
                                  "metrics" in names))
    return specs


def proxy_bind_addresses(syn: SynapseConfig, location: ProxyLocation) -> list[str] | None:
    """The addresses of the ``worker_listeners`` entry on the proxy's port (where a
    Synapse worker would bind), or None: bind the ``instance_map`` host itself."""
    for listener in syn.worker_listeners:
        if isinstance(listener, Mapping) and listener.get("port") == location.port:
            addresses = listener.get("bind_addresses")
            if isinstance(addresses, list) and addresses:
                return [str(a) for a in addresses]
            if isinstance(listener.get("bind_address"), str):
                return [listener["bind_address"]]
    return None


def load_synapse_config(paths: Sequence[str | Path]) -> SynapseConfig:
    return parse_synapse_config(read_synapse_files(paths))


SHARED_FEDERATION_KEYS = {
    "federation.verify_tls": "federation_verify_certificates",
    "federation.ip_allow_list": "ip_range_whitelist",
    "federation.ip_deny_list": "ip_range_blacklist",
}
"""Our keys whose value beside Synapse is Synapse's (ours -> Synapse's key)."""

_ABSENT = object()


def keys_set_in(
    path: str | Path | None, environ: Mapping[str, str], keys: Collection[str]
) -> frozenset[str]:
    """Which of the dotted ``keys`` our file (or a ``FEDERATION_SENDER__`` variable)
    sets, whatever the value (the file was read and validated already)."""
    found: set[str] = set()
    tree: object = None
    if path is not None:
        with contextlib.suppress(OSError, yaml.YAMLError):
            tree = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    for key in keys:
        node = tree
        for part in key.split("."):
            node = node.get(part, _ABSENT) if isinstance(node, Mapping) else _ABSENT
        env = ENV_PREFIX + "__".join(p.upper() for p in key.split("."))
        if node is not _ABSENT or env in environ:
            found.add(key)
    return frozenset(found)


def _refuse_conflicts(settings: Settings, syn: SynapseConfig, explicit: Collection[str]) -> None:
    """A shared key our file sets to another value than Synapse's is refused: it would
    be replaced silently (Synapse's value is the deployment's)."""
    ours = settings.federation
    values: dict[str, tuple[object, object]] = {
        "federation.verify_tls": (ours.verify_tls, syn.verify_tls),
        "federation.ip_allow_list": (sorted(ours.ip_allow_list), sorted(syn.ip_range_whitelist)),
        "federation.ip_deny_list": (sorted(ours.ip_deny_list), sorted(syn.ip_range_blacklist)),
    }
    for key, (mine, theirs) in values.items():
        if key in explicit and mine != theirs:
            raise ConfigError(
                key,
                f"to be left out beside Synapse, whose {SHARED_FEDERATION_KEYS[key]} "
                f"decides ({theirs!r})",
                mine,
            )


def merge_settings(
    settings: Settings,
    syn: SynapseConfig,
    *,
    explicit: Collection[str] | None = None,
    check_instance: bool = True,
) -> Settings:
    """Our settings with the deployment's facts from Synapse's files.

    The instance name is the worker file's ``worker_name`` when given, else ours; either
    way it must be one of ``federation_sender_instances`` (unless ``check_instance`` is
    off: ``migrate`` creates the same schema whichever instance runs it). Several
    instances shard statically by Synapse's rule (sha256 of the destination,
    little-endian, modulo N), which is our ``static`` mode with Synapse's list.

    ``explicit``: which of :data:`SHARED_FEDERATION_KEYS` our file sets (None: those
    whose value is not the default); one set to another value than Synapse's is
    refused (:class:`ConfigError`, exit 2) rather than silently replaced."""
    if explicit is None:
        default = Settings().federation
        explicit = [
            key for key in SHARED_FEDERATION_KEYS
            if getattr(settings.federation, key.split(".")[1])
            != getattr(default, key.split(".")[1])
        ]  # fmt: skip
    _refuse_conflicts(settings, syn, explicit)
    instance = syn.worker_name or settings.instance_name
    if check_instance and instance not in syn.federation_sender_instances:
        raise ConfigError(
            "federation_sender_instances",
            f"a list naming this worker ({instance!r}); otherwise main or another "
            "worker sends federation and events would go out twice",
            list(syn.federation_sender_instances) or None,
        )
    instances = (
        list(syn.federation_sender_instances)
        if instance in syn.federation_sender_instances
        else []
    )
    sharding = dataclasses.replace(
        settings.sharding,
        mode="static" if len(instances) > 1 else "single",
        instances=instances if len(instances) > 1 else [],
    )
    outbound_proxy_location(syn, instance)  # refuses what we cannot serve
    refuse_duties(syn, instance)
    worker_listener_specs(syn, instance)  # refuses listeners we cannot serve
    fed = dataclasses.replace(
        settings.federation,
        signing_key_path=syn.signing_key_path,
        verify_tls=syn.verify_tls,
        extra_ca_file=syn.extra_ca_file or settings.federation.extra_ca_file,
        ca_files=list(syn.ca_files),
        tls_min_version=syn.tls_min_version,
        tls_verification_whitelist=list(syn.tls_verification_whitelist),
        user_agent_suffix=syn.user_agent_suffix,
        http_proxy=syn.http_proxy,
        https_proxy=syn.https_proxy,
        no_proxy=list(syn.no_proxy_hosts),
        request_timeout_s=syn.client_timeout_ms / 1000.0,
        metrics_domains=sorted(syn.federation_metrics_domains),
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
