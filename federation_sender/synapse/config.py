"""Configuration taken from Synapse's own files (``homeserver.yaml`` and a worker file).

``federation-sender worker --synapse-config homeserver.yaml [--synapse-config fed1.yaml]``
reads the files in order, later top-level keys replacing earlier ones (as Synapse
merges ``-c`` files), and takes from them every key Synapse's federation sender reads:
docs/synapse-reference.md, "Every key the sender reads", is the list, with what each becomes
(``tests/synapse/test_key_table.py`` proves each row). Everything else of ours (queue
sizes, admin API, telemetry) stays in our own file.

Refused here with one :class:`ConfigError` line: a SQLite database (Synapse workers
need PostgreSQL) and Redis disabled (Synapse workers replicate over Redis)
(:mod:`~federation_sender.synapse.connection_urls`), keys whose effect we do not
implement (:data:`REFUSED`), and values of the wrong type. What the deployment asks of
our instance is checked in :mod:`~federation_sender.synapse.deployment` (duties of
Synapse's given to it, :data:`DUTIES`; ``outbound_federation_restricted_to`` without us;
worker listeners for resources we do not serve), and a deployment whose
``federation_sender_instances`` does not name our instance (main would then send
federation itself, or another worker would, and events would go out twice) is refused
when the settings are merged (:mod:`~federation_sender.synapse.merge`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from federation_sender.errors import ConfigError
from federation_sender.synapse.connection_urls import database_url, redis_url
from federation_sender.transport.forward_proxy import ProxyPolicy, policy_from_environment
from federation_sender.transport.http import TLS_VERSIONS

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
    device_list_writers: tuple[str, ...] = ("master",)
    """``stream_writers.device_lists`` (several allowed, unlike ``to_device``, which
    Synapse limits to one writer): device-list outbox reads stay below what all of
    them finished."""
    # --- egress (docs/synapse.md, "Restricted egress") ----------------------------------
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


def load_synapse_config(paths: Sequence[str | Path]) -> SynapseConfig:
    return parse_synapse_config(read_synapse_files(paths))


def _str_list(key: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(key, "a list of strings", value)
    return tuple(value)


def parse_synapse_config(tree: Mapping[str, Any]) -> SynapseConfig:
    server_name, key_path, worker_name = _identity(tree)
    fed = _mapping(tree, "federation", "a mapping")
    multiplier = fed.get("destination_retry_multiplier", 2)
    if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)):
        raise ConfigError("federation.destination_retry_multiplier", "a number", multiplier)
    blacklist = tree.get("federation_ip_range_blacklist", tree.get("ip_range_blacklist"))
    cas = _str_list("federation_custom_ca_list", tree.get("federation_custom_ca_list"))
    if tree.get("federation_custom_ca_list") is not None and not cas:
        raise ConfigError("federation_custom_ca_list", "at least one certificate file", [])
    _refuse_unsupported(tree)
    presence = _mapping(tree, "presence", "a mapping")
    writers = _mapping(tree, "stream_writers", "a mapping of stream names to instances")
    event_writers = writers.get("events") or ["master"]
    if isinstance(event_writers, str):  # Synapse accepts one name for a list of one
        event_writers = [event_writers]
    device_list_writers = writers.get("device_lists") or ["master"]
    if isinstance(device_list_writers, str):
        device_list_writers = [device_list_writers]
    rr = tree.get("federation_rr_transactions_per_room_per_second", 50)
    if isinstance(rr, bool) or not isinstance(rr, (int, float)) or rr <= 0:
        raise ConfigError(
            "federation_rr_transactions_per_room_per_second", "a positive number", rr
        )
    whitelist = tree.get("federation_domain_whitelist")
    return SynapseConfig(
        server_name=server_name,
        database_url=database_url(tree.get("database")),
        redis_url=redis_url(tree.get("redis")),
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
        **_retry_schedule(fed, float(multiplier)),
        allow_device_name_lookup_over_federation=bool(
            tree.get("allow_device_name_lookup_over_federation", False)
        ),
        **_presence(tree, presence),
        federation_rr_transactions_per_room_per_second=float(rr),
        event_writers=_str_list("stream_writers.events", event_writers),
        device_list_writers=_str_list("stream_writers.device_lists", device_list_writers),
        **_egress(tree, fed, cas),
    )


def _identity(tree: Mapping[str, Any]) -> tuple[str, str, str | None]:
    """``server_name``, ``signing_key_path`` and ``worker_name`` (None: main's file)."""
    server_name = tree.get("server_name")
    if not isinstance(server_name, str) or not server_name:
        raise ConfigError("server_name", "the homeserver's server name", server_name)
    key_path = tree.get("signing_key_path")
    if not isinstance(key_path, str) or not key_path:
        raise ConfigError("signing_key_path", "the path of Synapse's signing key", key_path)
    worker_name = tree.get("worker_name")
    if worker_name is not None and not isinstance(worker_name, str):
        raise ConfigError("worker_name", "a string", worker_name)
    return server_name, key_path, worker_name


def _mapping(tree: Mapping[str, Any], key: str, expected: str) -> Mapping[str, Any]:
    """A section that may be absent (then empty) but is a mapping when given."""
    value = tree.get(key) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(key, expected, value)
    return value


def _retry_schedule(fed: Mapping[str, Any], multiplier: float) -> dict[str, Any]:
    """The persisted backoff: ``federation.destination_{min,max}_retry_interval``."""
    return {
        "min_retry_interval_ms": parse_duration_ms(
            "federation.destination_min_retry_interval",
            fed.get("destination_min_retry_interval", _DEFAULT_MIN_RETRY_MS),
        ),
        "retry_multiplier": multiplier,
        "max_retry_interval_ms": min(
            parse_duration_ms(
                "federation.destination_max_retry_interval",
                fed.get("destination_max_retry_interval", _DEFAULT_MAX_RETRY_MS),
            ),
            2**62,
        ),
    }


def _presence(tree: Mapping[str, Any], presence: Mapping[str, Any]) -> dict[str, Any]:
    """``presence.enabled`` (or the older ``use_presence``) and what shapes presence."""
    enabled = presence.get("enabled")
    if enabled is None:
        enabled = tree.get("use_presence", True)
    return {
        "presence_enabled": bool(enabled),
        "rooms_to_exclude_from_presence": frozenset(
            _str_list("exclude_rooms_from_presence", tree.get("exclude_rooms_from_presence"))
        ),
        "presence_last_active_granularity_ms": parse_duration_ms(
            "presence.last_active_granularity", presence.get("last_active_granularity", 60_000)
        ),
    }


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
worker at start (docs/synapse-reference.md, "Every key the sender reads")."""


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
    secret = _replication_secret(tree)
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
    http_proxy, https_proxy, no_proxy_list = _proxies(tree)
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


def _replication_secret(tree: Mapping[str, Any]) -> str | None:
    """``worker_replication_secret``, or the contents of ``worker_replication_secret_path``."""
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
    return secret


def _proxies(tree: Mapping[str, Any]) -> tuple[str | None, str | None, tuple[str, ...]]:
    """``http_proxy``, ``https_proxy`` and ``no_proxy_hosts``, each defaulting to the
    environment's variable as Synapse's do."""
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
    return http_proxy, https_proxy, no_proxy_list


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
