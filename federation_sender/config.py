"""Typed, validated settings: one :class:`Settings` object, loaded from an optional YAML
file and then from environment overrides, and passed down explicitly.

Environment overrides use ``FEDERATION_SENDER__<SECTION>__<KEY>`` (double underscores
separate levels), for example ``FEDERATION_SENDER__DATABASE__URL``. Values from the
environment are parsed as YAML scalars, so ``true``, ``30`` and ``[a, b]`` work.

Every key is documented in ``docs/configuration.md``; a test checks that the document
and these dataclasses agree. A missing or bad value raises :class:`ConfigError` naming
the key and what was expected; the CLI turns that into exit status 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from federation_sender.errors import ConfigError
from federation_sender.proxy_url import parse_proxy
from federation_sender.redaction import redact_url

ENV_PREFIX = "FEDERATION_SENDER__"
DEMO_SERVER_NAME = "demo.local"
"""``federation-sender demo``'s server name (its database: ``<data_dir>/demo/demo.db``)."""


@dataclass(frozen=True)
class DatabaseSettings:
    url: str = "sqlite:///./data/federation_sender.db"
    """SQLAlchemy URL: ``postgresql://user:pass@host/db`` or ``sqlite:///path``."""
    pool_size: int = 10
    connect_attempts: int = 5
    connect_retry_s: float = 2.0


@dataclass(frozen=True)
class ReplicationSettings:
    transport: Literal["tcp", "redis", "none"] = "none"
    """``none`` runs without a main process (the worker polls the database)."""
    host: str = "127.0.0.1"
    port: int = 9092
    redis_url: str = "redis://127.0.0.1:6379/0"
    poll_interval_s: float = 1.0
    """With transport ``none``, how often to look for new events in the database."""
    position_save_interval_s: float = 1.0
    """How often the streams' positions are saved (0: after every received batch).
    After a crash the rows since the last save are delivered again."""


@dataclass(frozen=True)
class FederationSettings:
    signing_key_path: str | None = None
    """Synapse-format ed25519 key file; generated on first run when missing. Unset:
    ``<data_dir>/signing.key`` (as the admin token follows ``data_dir``)."""
    verify_tls: bool = True
    extra_ca_file: str | None = None
    ip_allow_list: list[str] = field(default_factory=list)
    """CIDRs outbound federation may reach even though they are private/reserved."""
    ip_deny_list: list[str] = field(default_factory=list)
    """CIDRs refused in addition to the built-in private/reserved ranges (the allow list
    still wins, as with Synapse's ``ip_range_blacklist``/``ip_range_whitelist``)."""
    request_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    max_response_bytes: int = 1_048_576
    pool_total: int = 1000
    pool_per_host: int = 4
    http_client: Literal["builtin", "aiohttp"] = "builtin"
    """``/send`` over the built-in HTTP/1.1 client (transport/h1.py) or aiohttp."""
    destination_overrides: dict[str, str] = field(default_factory=dict)
    """destination -> ``host:port`` to connect to instead of discovery (tests, demo)."""
    use_tls: bool = True
    """``false`` only for loopback test peers that speak plain HTTP."""
    key_listener_port: int | None = None
    """Serve ``GET /_matrix/key/v2/server`` on this port when set."""
    key_listener_bind: str | None = None
    """Address of the key listener; ``None`` uses ``admin.bind``."""
    tls_certificate_path: str | None = None
    """PEM certificate (chain) of the server name: the key listener serves HTTPS with it,
    as remote servers fetch keys over HTTPS. Set together with ``tls_private_key_path``."""
    tls_private_key_path: str | None = None
    ca_files: list[str] = field(default_factory=list)
    """PEM files of the only CAs trusted (replacing the system's; Synapse's
    ``federation_custom_ca_list``); ``extra_ca_file`` is added to them."""
    tls_min_version: str | None = None
    """``1``, ``1.1``, ``1.2`` or ``1.3``; None: Python's default (1.2)."""
    tls_verification_whitelist: list[str] = field(default_factory=list)
    """Globs of server names whose certificates are not checked."""
    user_agent_suffix: str | None = None
    http_proxy: str | None = None
    """Forward proxy for plain-HTTP targets (``[http://][user:pass@]host[:port]``)."""
    https_proxy: str | None = None
    """Forward proxy (``CONNECT``) for every TLS target: federation itself."""
    no_proxy: list[str] = field(default_factory=list)
    """Hosts, IP addresses or CIDRs reached directly; ``*``: all."""
    metrics_domains: list[str] = field(default_factory=list)
    """Destinations whose transactions get per-destination metrics."""


@dataclass(frozen=True)
class QueueSettings:
    max_pdus_per_txn: int = 50
    max_edus_per_txn: int = 100
    max_txn_bytes: int = 4_000_000
    max_concurrent_transactions: int = 500
    backoff_initial_s: float = 600.0
    backoff_multiplier: float = 2.0
    backoff_jitter_min: float = 0.8
    backoff_jitter_max: float = 1.4
    backoff_max_s: float = 7 * 24 * 3600.0
    catchup_threshold_s: float = 3600.0
    """Backoff interval past which the in-memory queue is dropped for catch-up mode."""
    catchup_rooms_per_batch: int = 50
    catchup_max_gap_events: int = 10_000
    """Per room, catch-up replays up to this many missed events in order, a page of 50
    at a time (``queue/catchup.py``); beyond, extremities. The default was 50 before
    catch-up paged: a real Synapse receiver then lacked most of a longer gap."""
    pacing_confirm_deadline_s: float = 30.0
    """Once 40 PDUs of one room were accepted by a destination but not yet confirmed
    processed, the next transaction waits until it holds the newest, at most this long
    (``queue/pacing.py``); 0 never waits."""
    wakeup_interval_s: float = 60.0
    wakeup_rate_per_s: float = 100.0
    event_batch_size: int = 100
    coalesce_hold_s: float = 0.5
    """While the intake is behind, a queue about to send a part-filled transaction waits
    up to this long for the intake's next hand-over (``queue/coalesce.py``); 0 never waits."""
    busy_txn_interval_s: float = 2.0
    """A destination sent ``busy_min_pdus`` PDUs or more within one interval (a steady
    stream) sends its next part-filled transaction one interval after its last one;
    0 never waits. Only transactions that took every pending PDU count (one cut by
    the limits is a backlog, though in a stream what it leaves waits too); a full
    batch and a stop end the wait; retries, catch-up and EDU-only transactions
    neither count nor wait; a destination sent fewer PDUs in an interval never
    waits. EDUs that arrive during the wait go with that transaction."""
    busy_min_pdus: int = 20
    idle_queue_ttl_s: float = 60.0
    max_item_failures: int = 3
    """Times one item may be isolated as the cause of a refusal before it is dropped."""
    max_long_retries: int = 10
    """Short-retry phase (``queue/backoff.py``): after the probe window, retries on
    Synapse's long-retry schedule (4 s, 16 s, then ``max_long_retry_delay_s``, jitter 0.8
    to 1.4) before the persisted backoff. Beside Synapse: ``federation.max_long_retries``."""
    max_long_retry_delay_s: float = 60.0
    """Beside Synapse: ``federation.max_long_retry_delay``."""
    max_short_retries: int = 3
    """Probes of the window wait 0.5 s, doubling this many times, then
    ``max_short_retry_delay_s``. Beside Synapse: ``federation.max_short_retries``."""
    max_short_retry_delay_s: float = 2.0
    """The longest wait between two probes of the window. Beside Synapse:
    ``federation.max_short_retry_delay``."""
    short_retry_probe_window_s: float = 30.0
    """How long after a destination's first failure it is probed every
    ``max_short_retry_delay_s`` or sooner (ours; Synapse has no such window). 0, with
    ``max_long_retries`` 0, goes straight to the persisted backoff."""


@dataclass(frozen=True)
class AdminSettings:
    enabled: bool = True
    bind: str = "127.0.0.1"
    port: int = 9293
    """Not 9093: Synapse's documented replication listener (docs/synapse.md)."""
    token: str | None = None
    """Bearer token for admin routes; generated and written to ``./data`` when unset."""


@dataclass(frozen=True)
class TelemetrySettings:
    metrics_port: int | None = 9094
    metrics_bind: str = "127.0.0.1"
    tracing_exporter: Literal["none", "console", "otlp"] = "none"
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    trace_sample_ratio: float = 1.0
    """Share of transactions (and replication batches) traced when tracing is on:
    the root span is sampled with this probability and its children follow it."""
    trace_max_per_s: float = 10.0
    """At most this many traces begun per second (of those the ratio keeps), so that
    tracing's cost stays bounded under load; 0: no limit."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"


@dataclass(frozen=True)
class ShardingSettings:
    mode: Literal["single", "static", "dynamic"] = "single"
    instances: list[str] = field(default_factory=list)
    """For ``static``: all instance names; destinations go by sha256 % len."""
    heartbeat_interval_s: float = 5.0
    lease_s: float = 30.0


@dataclass(frozen=True)
class Settings:
    server_name: str = "localhost:8448"
    instance_name: str = "federation_sender1"
    data_dir: str = "./data"
    shutdown_deadline_s: float = 10.0
    database: DatabaseSettings = field(default_factory=DatabaseSettings)
    replication: ReplicationSettings = field(default_factory=ReplicationSettings)
    federation: FederationSettings = field(default_factory=FederationSettings)
    queue: QueueSettings = field(default_factory=QueueSettings)
    admin: AdminSettings = field(default_factory=AdminSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    sharding: ShardingSettings = field(default_factory=ShardingSettings)


# --- loading -------------------------------------------------------------------------


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_describe(get_args(tp)[0])}"
    if origin is dict:
        return "a mapping of strings"
    if tp is type(None):
        return "null"
    if tp is float:
        return "a number"
    if tp is int:
        return "an integer"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, tp: Any, value: Any) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise ConfigError(key, "a mapping", value)
        return _build(tp, value, key + ".")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(key, _describe(tp), value)
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, arg, value)
            except ConfigError:
                continue
        raise ConfigError(key, _describe(tp), value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, _describe(tp), value)
        (inner,) = get_args(tp)
        return [_coerce(f"{key}[{i}]", inner, v) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise ConfigError(key, _describe(tp), value)
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, _describe(tp), value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, _describe(tp), value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, _describe(tp), value)
        return float(value)
    if tp is str:
        if not isinstance(value, str) or value == "":
            raise ConfigError(key, "a non-empty string", value)
        return value
    raise ConfigError(key, _describe(tp), value)  # pragma: no cover


def _build(cls: type[Any], data: Mapping[str, Any], prefix: str = "") -> Any:
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            close = difflib.get_close_matches(str(k), sorted(names), n=1, cutoff=0.6)
            hint = f"did you mean {prefix + close[0]!r}? " if close else ""
            raise ConfigError(prefix + str(k),
                              f"a known key ({hint}see docs/configuration.md)", None)
    kwargs = {k: _coerce(prefix + k, hints[k], v) for k, v in data.items()}
    return cls(**kwargs)


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(".".join(path), "a mapping", nxt)
        node = nxt
    node[path[-1]] = value


def load_settings(
    path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Load settings from ``path`` (optional) and the environment; validate everything."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError("<file>", f"a readable YAML file at {str(p)!r}", e.strerror) from e
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise ConfigError("<file>", f"valid YAML{where}", None) from e
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError("<file>", "a YAML mapping at the top level", type(loaded).__name__)
        tree = loaded
    env = os.environ if environ is None else environ
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]
        if not parts:
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        if value is None and raw != "null":
            value = raw
        _set_path(tree, parts, value)
    settings: Settings = _build(Settings, tree)
    _validate(settings)
    return settings


_DATABASE_DRIVERS = {
    "postgresql": ("", "psycopg", "psycopg2"),
    "postgres": ("", "psycopg", "psycopg2"),
    "sqlite": ("", "aiosqlite"),
}
"""Backends and drivers the worker can run on (psycopg2 and no driver mean psycopg 3,
no driver for SQLite means aiosqlite: see ``storage.engine.normalise_url``)."""


def _check_database_url(url: str) -> None:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    expected = "postgresql://user:password@host/database or sqlite:///path/to/file.db"
    try:
        u = make_url(url)
    except ArgumentError:
        raise ConfigError("database.url", expected, redact_url(url)) from None
    backend, _, driver = u.drivername.partition("+")
    if driver not in _DATABASE_DRIVERS.get(backend, ()):
        raise ConfigError("database.url", f"PostgreSQL (psycopg) or SQLite (aiosqlite): "
                          f"{expected}", redact_url(url))
    if backend == "sqlite" and u.database in (None, "", ":memory:"):
        # Every pooled connection would get its own empty in-memory database.
        raise ConfigError("database.url", "an SQLite database file, not memory: "
                          "sqlite:///path/to/file.db", redact_url(url))
    if backend != "sqlite" and not u.database:
        raise ConfigError("database.url", f"a database name: {expected}", redact_url(url))


TLS_MIN_VERSIONS = ("1", "1.1", "1.2", "1.3")
"""``federation.tls_min_version``'s values (Synapse's ``federation_client_minimum_tls_version``)."""

def _validate_egress(f: FederationSettings) -> None:
    if f.tls_min_version is not None and f.tls_min_version not in TLS_MIN_VERSIONS:
        raise ConfigError("federation.tls_min_version", "one of 1, 1.1, 1.2, 1.3",
                          f.tls_min_version)
    for pattern in f.tls_verification_whitelist:
        if not pattern.isascii():
            raise ConfigError("federation.tls_verification_whitelist",
                              "ASCII names (IDNA names are not allowed)", pattern)
    if f.user_agent_suffix is not None and (
        not f.user_agent_suffix.isascii() or not f.user_agent_suffix.isprintable()
    ):
        raise ConfigError("federation.user_agent_suffix", "printable ASCII", None)
    for key, proxy in (("https_proxy", f.https_proxy), ("http_proxy", f.http_proxy)):
        if proxy:
            parse_proxy(key, proxy)  # ConfigError if bad


def _validate_queue(q: QueueSettings) -> None:
    if not 1 <= q.max_pdus_per_txn <= 50:
        raise ConfigError("queue.max_pdus_per_txn", "an integer from 1 to 50", q.max_pdus_per_txn)
    if not 1 <= q.max_edus_per_txn <= 100:
        raise ConfigError("queue.max_edus_per_txn", "an integer from 1 to 100", q.max_edus_per_txn)
    if q.backoff_jitter_min > q.backoff_jitter_max or q.backoff_jitter_min <= 0:
        raise ConfigError(
            "queue.backoff_jitter_min",
            "a positive number <= backoff_jitter_max",
            q.backoff_jitter_min,
        )
    if q.max_long_retries < 0 or q.max_short_retries < 0 or q.short_retry_probe_window_s < 0:
        bad = min(("queue.max_long_retries", q.max_long_retries),
                  ("queue.max_short_retries", q.max_short_retries),
                  ("queue.short_retry_probe_window_s", q.short_retry_probe_window_s),
                  key=lambda kv: kv[1])
        raise ConfigError(bad[0], "a number >= 0", bad[1])


def _validate(s: Settings) -> None:
    _check_database_url(s.database.url)
    if ":" in s.server_name and not s.server_name.rsplit(":", 1)[1].isdigit():
        raise ConfigError(
            "server_name", "a server name with an optional numeric port", s.server_name
        )
    q = s.queue
    _validate_queue(q)
    for key, val in (
        ("queue.max_long_retry_delay_s", q.max_long_retry_delay_s),
        ("queue.max_short_retry_delay_s", q.max_short_retry_delay_s),
        ("queue.backoff_initial_s", q.backoff_initial_s),
        ("queue.backoff_max_s", q.backoff_max_s),
        ("queue.wakeup_rate_per_s", q.wakeup_rate_per_s),
        ("queue.max_txn_bytes", q.max_txn_bytes),
        ("queue.max_concurrent_transactions", q.max_concurrent_transactions),
        ("federation.request_timeout_s", s.federation.request_timeout_s),
        ("federation.connect_timeout_s", s.federation.connect_timeout_s),
        ("shutdown_deadline_s", s.shutdown_deadline_s),
        ("database.connect_attempts", s.database.connect_attempts),
    ):
        if val <= 0:
            raise ConfigError(key, "a positive number", val)
    _validate_egress(s.federation)
    if not 0.0 <= s.telemetry.trace_max_per_s < math.inf:
        raise ConfigError("telemetry.trace_max_per_s", "a number of traces per second, "
                          "0 for no limit", s.telemetry.trace_max_per_s)
    if not 0.0 <= s.telemetry.trace_sample_ratio <= 1.0:
        raise ConfigError("telemetry.trace_sample_ratio", "a number from 0 to 1",
                          s.telemetry.trace_sample_ratio)
    if s.replication.position_save_interval_s < 0:
        raise ConfigError("replication.position_save_interval_s", "a number >= 0",
                          s.replication.position_save_interval_s)
    if q.busy_txn_interval_s < 0:
        raise ConfigError("queue.busy_txn_interval_s", "a number >= 0", q.busy_txn_interval_s)
    if q.busy_min_pdus < 1:
        raise ConfigError("queue.busy_min_pdus", "a positive integer", q.busy_min_pdus)
    if q.coalesce_hold_s < 0:
        raise ConfigError("queue.coalesce_hold_s", "a number >= 0", q.coalesce_hold_s)
    if s.database.connect_retry_s < 0:
        raise ConfigError("database.connect_retry_s", "a number >= 0", s.database.connect_retry_s)
    for key, port in (
        ("replication.port", s.replication.port),
        ("admin.port", s.admin.port),
        ("telemetry.metrics_port", s.telemetry.metrics_port),
        ("federation.key_listener_port", s.federation.key_listener_port),
    ):
        if port is not None and not 0 <= port <= 65535:
            raise ConfigError(key, "a TCP port from 0 to 65535", port)
    f = s.federation
    if (f.tls_certificate_path is None) != (f.tls_private_key_path is None):
        unset = "tls_private_key_path" if f.tls_private_key_path is None else "tls_certificate_path"
        raise ConfigError(f"federation.{unset}", "a path (the certificate and key go together)")
    if s.sharding.mode == "static" and s.instance_name not in s.sharding.instances:
        raise ConfigError(
            "sharding.instances", "a list containing instance_name", s.sharding.instances
        )


def iter_keys(cls: type[Any] = Settings, prefix: str = "") -> list[str]:
    """All dotted keys, for the documentation check."""
    out: list[str] = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            out.extend(iter_keys(tp, prefix + f.name + "."))
        else:
            out.append(prefix + f.name)
    return out
