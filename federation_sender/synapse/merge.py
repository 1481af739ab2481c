"""Our settings merged with the deployment's facts from Synapse's files.

Synapse's values win for what the deployment decides (server name, database, Redis,
signing key, TLS and proxy settings, the retry schedule, the sender instances); a key
of ours that Synapse also sets (:data:`SHARED_FEDERATION_KEYS`) may only repeat
Synapse's value. The merged settings are validated again as a whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection, Mapping
from pathlib import Path

import yaml

from federation_sender.config import (
    ENV_PREFIX,
    FederationSettings,
    QueueSettings,
    Settings,
    ShardingSettings,
)
from federation_sender.config.validation import validate_settings
from federation_sender.errors import ConfigError
from federation_sender.synapse.config import SynapseConfig
from federation_sender.synapse.deployment import (
    outbound_proxy_location,
    refuse_duties,
    worker_listener_specs,
)

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
    way it must be one of ``federation_sender_instances``, and what the deployment asks
    of that instance (the outbound proxy, listeners, no duty of Synapse's) must be
    something we serve. ``check_instance`` off skips both: ``migrate`` creates the same
    schema whichever instance runs it, and serves nothing. Several
    instances shard statically by Synapse's rule (sha256 of the destination,
    little-endian, modulo N), which is our ``static`` mode with Synapse's list.

    ``explicit``: which of :data:`SHARED_FEDERATION_KEYS` our file sets (None: those
    whose value is not the default); one set to another value than Synapse's is
    refused (:class:`ConfigError`, exit 2) rather than silently replaced."""
    if explicit is None:
        explicit = _changed_shared_keys(settings)
    _refuse_conflicts(settings, syn, explicit)
    instance = syn.worker_name or settings.instance_name
    if check_instance and instance not in syn.federation_sender_instances:
        raise ConfigError(
            "federation_sender_instances",
            f"a list naming this worker ({instance!r}); otherwise main or another "
            "worker sends federation and events would go out twice",
            list(syn.federation_sender_instances) or None,
        )
    if check_instance:
        # What this instance would serve; `migrate` serves nothing, so a deployment
        # whose outbound_federation_restricted_to or worker_listeners name fed1 still
        # migrates with homeserver.yaml alone.
        outbound_proxy_location(syn, instance)  # refuses what we cannot serve
        refuse_duties(syn, instance)
        worker_listener_specs(syn, instance)  # refuses listeners we cannot serve
    merged = dataclasses.replace(
        settings,
        server_name=syn.server_name,
        instance_name=instance,
        database=dataclasses.replace(settings.database, url=syn.database_url),
        replication=dataclasses.replace(
            settings.replication, transport="redis", redis_url=syn.redis_url
        ),
        federation=_federation(settings.federation, syn),
        queue=_queue(settings.queue, syn),
        sharding=_sharding(settings.sharding, syn, instance),
    )
    validate_settings(merged)
    return merged


def _changed_shared_keys(settings: Settings) -> list[str]:
    """The shared keys whose value is not the default (when the file is not at hand)."""
    default = Settings().federation
    return [
        key for key in SHARED_FEDERATION_KEYS
        if getattr(settings.federation, key.split(".")[1])
        != getattr(default, key.split(".")[1])
    ]  # fmt: skip


def _sharding(ours: ShardingSettings, syn: SynapseConfig, instance: str) -> ShardingSettings:
    """Synapse's rule: several instances shard statically over its list."""
    instances = (
        list(syn.federation_sender_instances)
        if instance in syn.federation_sender_instances
        else []
    )
    return dataclasses.replace(
        ours,
        mode="static" if len(instances) > 1 else "single",
        instances=instances if len(instances) > 1 else [],
    )


def _federation(ours: FederationSettings, syn: SynapseConfig) -> FederationSettings:
    """The outbound connections' keys: Synapse's TLS, proxies, timeout and IP ranges."""
    return dataclasses.replace(
        ours,
        signing_key_path=syn.signing_key_path,
        verify_tls=syn.verify_tls,
        extra_ca_file=syn.extra_ca_file or ours.extra_ca_file,
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


def _queue(ours: QueueSettings, syn: SynapseConfig) -> QueueSettings:
    """The retry schedules: the persisted backoff and the short-retry phase."""
    return dataclasses.replace(
        ours,
        backoff_initial_s=syn.min_retry_interval_ms / 1000.0,
        backoff_multiplier=syn.retry_multiplier,
        backoff_max_s=syn.max_retry_interval_ms / 1000.0,
        max_long_retries=syn.max_long_retries,
        max_long_retry_delay_s=syn.max_long_retry_delay_ms / 1000.0,
        max_short_retries=syn.max_short_retries,
        max_short_retry_delay_s=syn.max_short_retry_delay_ms / 1000.0,
    )
