"""The steps of building a :class:`~federation_sender.app.worker.Worker`: the storage
opened (the one place that chooses the backend), the instance lock taken, the signing
key, the telemetry, the EDU fan-outs, what a change of the live shard instances does."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.builders import load_or_create_signing_key, signing_key_path
from federation_sender.clock import Clock
from federation_sender.config import Settings
from federation_sender.edus.fanouts import EduFanouts, edu_fanouts
from federation_sender.edus.room_hosts import StorageRoomHosts
from federation_sender.queue.manager import QueueManager
from federation_sender.queue.telemetry_observer import TelemetryObserver
from federation_sender.sharding import ShardCoordinator
from federation_sender.startup import wait_for_database
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.capabilities import Capabilities
from federation_sender.storage.engine import is_sqlite
from federation_sender.storage.instance_lock import InstanceLock, instance_lock
from federation_sender.storage.migrate import check_schema, upgrade
from federation_sender.storage.protocols import Backend
from federation_sender.synapse.config import SynapseConfig
from federation_sender.synapse.wiring import (
    SynapseEdus,
    load_synapse_signing_key,
    open_synapse_storage,
)
from federation_sender.telemetry.metrics import Metrics, new_registry
from federation_sender.telemetry.tracing import setup_tracing
from federation_sender.transport.client import FederationClient
from federation_sender.transport.domain_metrics import DomainMetrics
from federation_sender.transport.signing import SigningKey

log = logging.getLogger(__name__)


def build_edu_fanouts(
    server_name: str,
    storage: Backend,
    manager: QueueManager,
    clock: Clock,
    synapse: SynapseEdus | None,
) -> EduFanouts:
    """The replication intake's EDU fan-outs: beside Synapse on its rooms, at its receipt
    pacing, with its presence; otherwise on the rooms the storage Protocols read."""
    if synapse is None:
        return edu_fanouts(server_name, StorageRoomHosts(storage), manager, clock)
    return edu_fanouts(
        server_name, synapse.rooms, manager, clock,
        receipt_max_delay_s=synapse.receipt_max_delay_s, presence=synapse.presence,
    )  # fmt: skip


async def acquire_instance_lock(
    engine: AsyncEngine, settings: Settings, clock: Clock, resources: contextlib.AsyncExitStack
) -> InstanceLock | None:
    """The instance lock (where the database has one), released with ``resources``."""
    lock = instance_lock(engine.url, settings.instance_name, clock)
    if lock is not None:
        await lock.acquire()
        resources.push_async_callback(lock.release)
    return lock


def telemetry(
    settings: Settings, clock: Clock, own_client: FederationClient | None
) -> tuple[CollectorRegistry, Metrics, TelemetryObserver]:
    """The worker's metrics registry and tracing, with our own federation client (when
    we built it) counting and tracing its requests into them."""
    registry = new_registry()
    metrics = Metrics(registry)
    provider = setup_tracing(settings.telemetry, instance_name=settings.instance_name,
                             clock=clock)
    observer = TelemetryObserver(metrics, provider, clock)
    if own_client is not None:
        own_client.tracer = observer.tracing.tracer
        own_client.request_counter = metrics
        if settings.federation.metrics_domains:
            own_client.domain_metrics = DomainMetrics(
                registry, settings.federation.metrics_domains
            )
    return registry, metrics, observer


def own_signing_key(settings: Settings, synapse: SynapseConfig | None) -> SigningKey:
    """Beside Synapse, its key (never generated); standalone, ours (generated once)."""
    path = signing_key_path(settings)
    return load_synapse_signing_key(str(path)) if synapse is not None else (
        load_or_create_signing_key(path)
    )


def on_membership_change(
    shards: ShardCoordinator, manager: QueueManager, metrics: Metrics
) -> Callable[[frozenset[str]], Awaitable[None]]:
    """When the live instances change: hand over the queues this one no longer owns and
    wake the ones it now does."""

    async def changed(live: frozenset[str]) -> None:
        metrics.shard_membership(len(live), len(shards.held_destinations()))
        stopped = manager.rebalance()
        log.info("shard membership now %s; %d queues handed over", sorted(live), stopped)
        await manager.wake_due_destinations()

    return changed


async def open_storage(
    settings: Settings,
    clock: Clock,
    engine: AsyncEngine,
    resources: contextlib.AsyncExitStack,
    auto_migrate: bool,
    synapse: SynapseConfig | None,
) -> tuple[Backend, Capabilities]:
    """Wait for the database, check (or migrate) its schema, open the backend (ours, or
    Synapse's): the one place that chooses it, with what it offers beyond its Protocols."""
    db = settings.database
    await wait_for_database(
        engine, attempts=db.connect_attempts, interval_s=db.connect_retry_s, clock=clock
    )
    if synapse is not None:
        synapse_backend = await open_synapse_storage(
            engine, settings, synapse, clock, resources, auto_migrate=auto_migrate
        )
        return synapse_backend, synapse_backend.capabilities()
    if auto_migrate and is_sqlite(engine):
        await upgrade(engine)
    await check_schema(engine)
    native = NativeBackend(engine)
    return native, native.capabilities()
