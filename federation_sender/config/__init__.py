"""Typed settings: one :class:`Settings` object, loaded from an optional YAML file and
then from environment overrides (:mod:`.loading`), validated as a whole
(:mod:`.validation`), and passed down explicitly.

Environment overrides use ``FEDERATION_SENDER__<SECTION>__<KEY>`` (double underscores
separate levels), for example ``FEDERATION_SENDER__DATABASE__URL``. Values from the
environment are parsed as YAML scalars, so ``true``, ``30`` and ``[a, b]`` work.

Every key is documented in ``docs/configuration.md``; a test checks that the document
and these dataclasses agree. A missing or bad value raises :class:`ConfigError` naming
the key and what was expected; the CLI turns that into exit status 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ENV_PREFIX = "FEDERATION_SENDER__"
DEMO_SERVER_NAME = "demo.local"
"""``federation-sender demo``'s server name (its database: ``<data_dir>/demo/demo.db``)."""
TLS_MIN_VERSIONS = ("1", "1.1", "1.2", "1.3")
"""``federation.tls_min_version``'s values (Synapse's ``federation_client_minimum_tls_version``)."""



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
    outbound_proxy_max_connections: int | None = None
    """Connections the outbound federation proxy (``outbound_federation_restricted_to``)
    serves at once; one more is refused at once. None: an eighth of the open-file limit,
    from 16 to 1,024 (``transport/outbound_proxy.py``)."""
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
    at a time (``queue/core/catchup.py``); beyond, extremities. The default was 50 before
    catch-up paged: a real Synapse receiver then lacked most of a longer gap."""
    pacing_confirm_deadline_s: float = 30.0
    """Once 40 PDUs of one room were accepted by a destination but not yet confirmed
    processed, the next transaction waits until it holds the newest, at most this long
    (``queue/core/pacing.py``); 0 never waits."""
    wakeup_interval_s: float = 60.0
    wakeup_rate_per_s: float = 100.0
    event_batch_size: int = 100
    coalesce_hold_s: float = 0.5
    """While the intake is behind, a queue about to send a part-filled transaction waits
    up to this long for the intake's next hand-over (``queue/coalesce.py``); 0 never waits."""
    commit_gather_s: float = 0.025
    """Transaction results (positions, backoffs, log rows) are written in group commits;
    each gathers results this long before it begins (``queue/persistence.py``): at one
    message a second to 415 servers, a few commits a message instead of one every
    10-20 results. A crash forgets at most this much more (those PDUs are sent again,
    as duplicates the receiver drops). 0: commit as soon as the previous one is done."""
    busy_txn_interval_s: float = 2.0
    """Deprecated and ignored (with ``busy_min_pdus``): a destination with nothing in
    flight sends at once (``queue/core/loop_policy.py``); still accepted so configs load."""
    busy_min_pdus: int = 20
    idle_queue_ttl_s: float = 60.0
    max_item_failures: int = 3
    """Times one item may be isolated as the cause of a refusal before it is dropped."""
    max_long_retries: int = 10
    """Short-retry phase (``queue/core/backoff.py``): after the probe window, retries on
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
    return_probe_interval_s: float = 60.0
    """In a persisted backoff, a destination with something to send that has been down
    for less than ``catchup_threshold_s`` is asked this often whether it is back (``GET
    /_matrix/federation/v1/version``), and sent to at once when it is (ours; Synapse
    waits the backoff out). 0 turns it off."""
    send_time_filter: bool = True
    """Just before each transaction goes out, withhold the PDUs whose sender was erased
    since they were queued and prune those redacted since (one database read per
    transaction with PDUs; ``queue/send_time.py``). False sends them as queued, as
    Synapse's own sender does."""


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
