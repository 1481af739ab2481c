"""What a Synapse deployment asks of our instance, checked against what we serve.

Refused with one :class:`ConfigError` line: a duty of Synapse's given to our instance
(:func:`refuse_duties`), an ``outbound_federation_restricted_to`` that leaves us out or
that we cannot serve (:func:`outbound_proxy_location`), and worker listeners for
resources we do not serve (:func:`worker_listener_specs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from federation_sender.errors import ConfigError
from federation_sender.synapse.config import SynapseConfig
from federation_sender.transport.outbound_proxy import (
    ProxyLocation,
    location_from_instance_map,
)


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

