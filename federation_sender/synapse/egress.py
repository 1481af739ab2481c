"""Building the outbound federation proxy from Synapse's configuration.

Our worker serves ``matrix-federation://`` requests
(:mod:`federation_sender.transport.outbound_proxy`) when the deployment's
``outbound_federation_restricted_to`` names it, at its ``instance_map`` address: TLS
with ``tls_certificate_path``/``tls_private_key_path`` when the entry says ``tls: true``
(as a Synapse worker's TLS listener), bound to the ``worker_listeners`` entry's
addresses on that port when there is one, else to the ``instance_map`` host. It serves
at most ``federation.outbound_proxy_max_connections`` connections at once (unset: derived
from the open-file limit by ``outbound_proxy.default_max_connections``).
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry

from federation_sender.builders import Listener
from federation_sender.clock import Clock
from federation_sender.config import Settings
from federation_sender.errors import ConfigError
from federation_sender.synapse.config import SynapseConfig
from federation_sender.synapse.deployment import (
    outbound_proxy_location,
    proxy_bind_addresses,
    worker_listener_specs,
)
from federation_sender.telemetry.metrics import metrics_app
from federation_sender.transport.client import FederationClient
from federation_sender.transport.forward_proxy import parse_proxy
from federation_sender.transport.keyserver import server_ssl_context
from federation_sender.transport.outbound_proxy import OutboundProxyServer


def build_outbound_proxy(
    settings: Settings,
    synapse: SynapseConfig | None,
    client: FederationClient | None,
    clock: Clock,
    registry: CollectorRegistry,
) -> OutboundProxyServer | None:
    """The proxy server, or None when the deployment does not restrict outbound
    federation (or a test supplies its own sender: there is no client to forward with)."""
    if synapse is None or client is None:
        return None
    location = outbound_proxy_location(synapse, settings.instance_name)
    if location is None:
        return None
    tls = None
    if location.tls:
        cert, key = synapse.tls_certificate_path, synapse.tls_private_key_path
        if not cert or not key:
            raise ConfigError("tls_certificate_path",
                              "a certificate and key (instance_map entry has tls: true)", None)
        tls = server_ssl_context(cert, key)
    assert synapse.worker_replication_secret is not None  # checked by the location
    return OutboundProxyServer(
        client,
        secret=synapse.worker_replication_secret,
        location=location,
        clock=clock,
        registry=registry,
        tls=tls,
        bind=proxy_bind_addresses(synapse, location),
        max_connections=settings.federation.outbound_proxy_max_connections,
    )


def egress_secrets(settings: Settings, synapse: SynapseConfig | None) -> list[str]:
    """Values redacted from every log line: the proxy's shared secret and the forward
    proxies' passwords (never logged on purpose; this is the safety net)."""
    out = []
    if synapse is not None and synapse.worker_replication_secret:
        out.append(synapse.worker_replication_secret)
    f = settings.federation
    for value in (f.http_proxy, f.https_proxy):
        if value:
            proxy = parse_proxy("https_proxy", value)
            if proxy.password:
                out.append(proxy.password)
    return out


def worker_listeners(settings: Settings, synapse: SynapseConfig | None,
                     registry: CollectorRegistry) -> list[Listener]:
    """The worker file's ``health`` and ``metrics`` listeners (synapse/deployment.py,
    :func:`worker_listener_specs`), one per bind address."""
    if synapse is None:
        return []
    out: list[Listener] = []
    for spec in worker_listener_specs(synapse, settings.instance_name):
        app = metrics_app(registry, settings.server_name) if spec.metrics else (
            web.Application())
        if spec.health:
            app.router.add_get("/health", _health)
        tls = None
        if spec.tls:
            cert, key = synapse.tls_certificate_path, synapse.tls_private_key_path
            if not cert or not key:
                raise ConfigError("tls_certificate_path",
                                  f"a certificate and key ({spec.key} has tls: true)", None)
            tls = server_ssl_context(cert, key)
        out.extend((spec.key, address, spec.port, app, tls) for address in spec.addresses)
    return out


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="OK")
