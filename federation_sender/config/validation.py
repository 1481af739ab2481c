"""Checks of :class:`Settings` as a whole, beyond each value's type: ranges, the database
URL, keys that go together. Run at load and again after a merge with Synapse's files."""

from __future__ import annotations

import math

from federation_sender.config import (
    TLS_MIN_VERSIONS,
    FederationSettings,
    QueueSettings,
    Settings,
)
from federation_sender.errors import ConfigError
from federation_sender.proxy_url import parse_proxy
from federation_sender.redaction import redact_url

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
    if f.outbound_proxy_max_connections is not None and f.outbound_proxy_max_connections < 1:
        raise ConfigError("federation.outbound_proxy_max_connections",
                          "a positive number of connections, or null (derived from the "
                          "open-file limit)", f.outbound_proxy_max_connections)


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
    if (q.max_long_retries < 0 or q.max_short_retries < 0 or q.short_retry_probe_window_s < 0
            or q.return_probe_interval_s < 0):
        bad = min(("queue.max_long_retries", q.max_long_retries),
                  ("queue.max_short_retries", q.max_short_retries),
                  ("queue.short_retry_probe_window_s", q.short_retry_probe_window_s),
                  ("queue.return_probe_interval_s", q.return_probe_interval_s),
                  key=lambda kv: kv[1])
        raise ConfigError(bad[0], "a number >= 0", bad[1])


def validate_settings(s: Settings) -> None:
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
    if not 0 <= q.commit_gather_s <= 5:
        raise ConfigError("queue.commit_gather_s", "a number of seconds from 0 to 5",
                          q.commit_gather_s)
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

