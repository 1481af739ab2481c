"""Builders of the worker's parts from :class:`Settings` (the signing key, the admin
token, the federation client, the replication transport, the queue manager); the
composition root, ``app.py``, calls them in order and owns what they return."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import secrets
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from federation_sender.clock import Clock
from federation_sender.config import Settings
from federation_sender.queue.manager import QueueManager
from federation_sender.queue.telemetry_observer import TelemetryObserver
from federation_sender.replication.transport import Transport
from federation_sender.sharding import ShardCoordinator
from federation_sender.storage.protocols import Backend
from federation_sender.telemetry.metrics import metrics_app
from federation_sender.transport.client import FederationClient
from federation_sender.transport.forward_proxy import ProxyPolicy
from federation_sender.transport.keyserver import make_key_app, server_ssl_context
from federation_sender.transport.result import TransactionSender
from federation_sender.transport.signing import SigningKey, generate_key_file, load_signing_key

log = logging.getLogger(__name__)

Listener = tuple[str, str, int, web.Application, ssl.SSLContext | None]
"""(config key, bind, port, application, TLS context or None for plain HTTP)"""


def load_or_create_signing_key(path: str | Path) -> SigningKey:
    p = Path(path)
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        log.info("no signing key at %s; generating one", p)
        return generate_key_file(p)
    return load_signing_key(p)


def signing_key_path(settings: Settings) -> Path:
    """``federation.signing_key_path``, else ``<data_dir>/signing.key``."""
    configured = settings.federation.signing_key_path
    return Path(configured) if configured else Path(settings.data_dir) / "signing.key"


def admin_token_path(settings: Settings) -> Path:
    return Path(settings.data_dir) / "admin.token"


def read_admin_token(settings: Settings) -> str | None:
    """The configured admin token, else the one in ``data_dir/admin.token``, else None."""
    if settings.admin.token:
        return settings.admin.token
    p = admin_token_path(settings)
    if p.exists():
        token = p.read_text().strip()
        if token:
            return token
    return None


def create_admin_token(settings: Settings) -> str:
    """Generate a token into ``data_dir/admin.token`` (mode 0600)."""
    p = admin_token_path(settings)
    p.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def load_or_create_admin_token(settings: Settings) -> str:
    token = read_admin_token(settings)
    if token is None:
        token = create_admin_token(settings)
        log.info("generated an admin token in %s", admin_token_path(settings))
    return token


def user_agent(suffix: str | None) -> str:
    """``federation-sender``, then the suffix after a space (as Synapse appends it)."""
    return f"federation-sender {suffix}" if suffix else "federation-sender"


def build_federation_client(settings: Settings, key: SigningKey, clock: Clock) -> FederationClient:
    f = settings.federation
    return FederationClient(
        server_name=settings.server_name,
        signing_key=key,
        clock=clock,
        attempt_timeout_s=f.request_timeout_s,
        connect_timeout_s=f.connect_timeout_s,
        max_connections=f.pool_total,
        max_connections_per_host=f.pool_per_host,
        max_response_bytes=f.max_response_bytes,
        tls_verify=f.verify_tls,
        tls_extra_ca_file=f.extra_ca_file,
        ip_allow_list=f.ip_allow_list,
        ip_deny_list=f.ip_deny_list,
        destination_overrides=f.destination_overrides or None,
        plain_http=not f.use_tls,
        http_client=f.http_client,
        tls_ca_files=f.ca_files,
        tls_min_version=f.tls_min_version,
        tls_unverified_names=f.tls_verification_whitelist,
        proxy_policy=ProxyPolicy.from_settings(f.http_proxy, f.https_proxy, f.no_proxy),
        user_agent=user_agent(f.user_agent_suffix),
    )


@contextlib.asynccontextmanager
async def running_federation_client(
    settings: Settings, clock: Clock, *, synapse_key: bool = False
) -> AsyncIterator[FederationClient]:
    """The worker's federation client, started, on the signing key the worker signs
    with (loaded, never generated: a new key would sign what nobody can verify), for a
    process beside the worker (``batch audit --ask-receivers``); closed on the way out.
    ``synapse_key``: the key is Synapse's own file (mode 0644 is accepted, warned)."""
    key = load_signing_key(signing_key_path(settings), others_may_read=synapse_key)
    client = build_federation_client(settings, key, clock)
    await client.start()
    try:
        yield client
    finally:
        await client.close()


def build_replication_transport(settings: Settings, clock: Clock) -> Transport | None:
    r = settings.replication
    if r.transport == "tcp":
        from federation_sender.replication.tcp import TcpTransport

        return TcpTransport(r.host, r.port, clock=clock, client_name=settings.instance_name)
    if r.transport == "redis":
        from federation_sender.replication.redis import RedisTransport

        return RedisTransport(r.redis_url, settings.server_name, clock=clock)
    return None


def build_queue_manager(
    settings: Settings,
    storage: Backend,
    sender: TransactionSender,
    clock: Clock,
    observer: TelemetryObserver,
    shards: ShardCoordinator,
    domain_allowed: Callable[[str], bool] | None = None,
) -> QueueManager:
    """``domain_allowed``: beside Synapse, its ``federation_domain_whitelist`` (a
    destination outside it gets no queue, so no EDU either, as in Synapse)."""
    owns: Callable[[str], bool] = shards.owns
    if domain_allowed is not None:
        allowed = domain_allowed

        def owns(destination: str) -> bool:
            return allowed(destination) and shards.owns(destination)

    poll = (
        settings.replication.poll_interval_s
        if settings.replication.transport == "none"
        else None
    )
    return QueueManager(
        storage,
        sender,
        settings.queue,
        settings.server_name,
        settings.instance_name,
        clock,
        random.Random(),
        owns,
        observer,
        attempt_deadline_s=settings.federation.request_timeout_s + 5.0,
        poll_interval_s=poll,
        leases=None if settings.sharding.mode == "single" else shards,
    )


def build_listeners(
    settings: Settings,
    admin_app: web.Application | None,
    registry: CollectorRegistry,
    signing_key: SigningKey | None,
    clock: Clock,
) -> list[Listener]:
    """The listeners to open, admin first: admin API (when ``admin_app`` is given),
    metrics, key listener (when configured and we hold the signing key)."""
    s = settings
    out: list[Listener] = []
    if admin_app is not None:
        out.append(("admin.port", s.admin.bind, s.admin.port, admin_app, None))
    if s.telemetry.metrics_port is not None:
        out.append(
            (
                "telemetry.metrics_port",
                s.telemetry.metrics_bind,
                s.telemetry.metrics_port,
                metrics_app(registry, s.server_name),
                None,
            )
        )
    if s.federation.key_listener_port is not None and signing_key is not None:
        out.append(build_key_listener(s, signing_key, s.federation.key_listener_port, clock))
    return out


def build_key_listener(
    settings: Settings, signing_key: SigningKey, port: int, clock: Clock
) -> Listener:
    """Remote servers fetch keys over HTTPS: TLS with the configured certificate, or
    plain HTTP (warned about) for a reverse proxy that terminates TLS."""
    f = settings.federation
    tls = None
    if f.tls_certificate_path is not None and f.tls_private_key_path is not None:
        tls = server_ssl_context(f.tls_certificate_path, f.tls_private_key_path)
    else:
        log.warning(
            "the key listener serves plain HTTP; remote servers fetch keys over HTTPS, "
            "so set federation.tls_certificate_path or put a TLS proxy in front"
        )
    app = make_key_app(server_name=settings.server_name, signing_key=signing_key, clock=clock)
    bind = f.key_listener_bind or settings.admin.bind
    return ("federation.key_listener_port", bind, port, app, tls)
