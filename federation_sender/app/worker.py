"""The worker: its parts, built in order and released in reverse (see the package
docstring for the start and stop orders and the failure policy)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.admin.app import build_admin_app
from federation_sender.admin.protocols import TokenVerifier
from federation_sender.admin.queue_control import AdminQueueControl
from federation_sender.admin.server import RunningServer, start_http_server
from federation_sender.app.assembly import (
    acquire_instance_lock,
    build_edu_fanouts,
    on_membership_change,
    open_storage,
    own_signing_key,
    telemetry,
)
from federation_sender.builders import (
    Listener,
    build_federation_client,
    build_listeners,
    build_queue_manager,
    build_replication_transport,
    load_or_create_admin_token,
)
from federation_sender.clock import Clock, SystemClock
from federation_sender.config import Settings
from federation_sender.errors import ConfigError
from federation_sender.intake import DbPositionStore, ReplicationIntake
from federation_sender.intake.streams import ROW_PARSERS, gap_notes
from federation_sender.queue.manager import QueueManager
from federation_sender.queue.telemetry_observer import TelemetryObserver
from federation_sender.replication.client import ReplicationClient
from federation_sender.runtime import MemoryTrimmer
from federation_sender.sharding import ShardCoordinator
from federation_sender.startup import listen
from federation_sender.storage.capabilities import Capabilities
from federation_sender.storage.engine import create_engine, db_outage, is_sqlite
from federation_sender.storage.instance_lock import InstanceLock
from federation_sender.storage.protocols import Backend
from federation_sender.storage.synapse.database import create_synapse_engine
from federation_sender.supervisor import Supervisor
from federation_sender.synapse.admin_auth import SynapseAdminTokens
from federation_sender.synapse.config import SynapseConfig
from federation_sender.synapse.egress import build_outbound_proxy, worker_listeners
from federation_sender.synapse.wiring import synapse_edus
from federation_sender.telemetry.metrics import Metrics
from federation_sender.transport.client import FederationClient
from federation_sender.transport.forward_proxy import forward_proxy_line
from federation_sender.transport.outbound_proxy import OutboundProxyServer
from federation_sender.transport.result import TransactionSender
from federation_sender.transport.signing import SigningKey

log = logging.getLogger(__name__)


@dataclass
class Worker:
    """A running worker's parts; built by :meth:`create`, run by :meth:`start`.

    Every resource the worker acquires (the engine, the federation client it built,
    the shard heartbeat, the queues, the replication task, the listeners) is entered
    into one :class:`AsyncExitStack` as it is acquired, so :meth:`stop`, and a failure
    half-way through :meth:`create` or :meth:`start`, release exactly what was taken,
    in reverse order.
    """

    settings: Settings
    clock: Clock
    engine: AsyncEngine
    storage: Backend
    sender: TransactionSender
    manager: QueueManager
    shards: ShardCoordinator
    metrics: Metrics
    registry: CollectorRegistry
    observer: TelemetryObserver
    admin_token: str
    signing_key: SigningKey | None
    resources: contextlib.AsyncExitStack
    own_client: FederationClient | None = None
    replication: ReplicationClient | None = None
    servers: list[RunningServer] = field(default_factory=list)
    supervisor: Supervisor | None = None
    ready: bool = False
    stop_deadline_s: float = 10.0
    capabilities: Capabilities = field(default_factory=lambda: Capabilities({}, {}))
    """What the backend offers beyond its Protocols (beside Synapse: the replication
    signals about the ``caches`` stream we write, the EDUs' rooms, more gap fetchers)."""
    admin_verifier: TokenVerifier | None = None
    """Beside Synapse: Synapse server admins' access tokens, besides our admin token."""
    event_writers: tuple[str, ...] | None = None
    """Beside Synapse: ``stream_writers.events``; None: one writer, whoever it is."""
    device_list_writers: tuple[str, ...] | None = None
    """Beside Synapse: ``stream_writers.device_lists``; None: one writer."""
    listening: dict[str, str] = field(default_factory=dict)
    """Listener config key -> base URL it answers on (``admin.port``...), once started."""
    outbound_proxy: OutboundProxyServer | None = None
    """Beside Synapse, as an instance of ``outbound_federation_restricted_to``."""
    synapse: SynapseConfig | None = None
    lock: InstanceLock | None = None
    """The instance lock (:mod:`federation_sender.storage.instance_lock`), held from
    before anything is sent until the worker stops."""

    @property
    def admin_url(self) -> str | None:
        return self.servers[0].url if self.servers and self.settings.admin.enabled else None

    @classmethod
    async def create(
        cls,
        settings: Settings,
        *,
        clock: Clock | None = None,
        auto_migrate: bool = True,
        sender: TransactionSender | None = None,
        engine: AsyncEngine | None = None,
        synapse: SynapseConfig | None = None,
    ) -> Worker:
        """Build the parts. ``sender``, when given, stays the caller's (never closed).
        ``synapse``: run as the federation sender of that Synapse deployment, on its
        database (:mod:`federation_sender.synapse`); otherwise on our own schema."""
        clock = clock or SystemClock()
        resources = contextlib.AsyncExitStack()
        try:
            pool = settings.database.pool_size
            engine = engine or (
                create_synapse_engine(settings.database.url, pool_size=pool)
                if synapse is not None
                else create_engine(settings.database.url, pool_size=pool)
            )
            resources.push_async_callback(engine.dispose)
            return await cls._build(
                settings, clock, engine, sender, resources, auto_migrate, synapse
            )
        except BaseException:
            await resources.aclose()
            raise

    @classmethod
    async def _build(
        cls,
        settings: Settings,
        clock: Clock,
        engine: AsyncEngine,
        sender: TransactionSender | None,
        resources: contextlib.AsyncExitStack,
        auto_migrate: bool,
        synapse: SynapseConfig | None = None,
    ) -> Worker:
        storage, capabilities = await open_storage(
            settings, clock, engine, resources, auto_migrate, synapse
        )
        # Before anything that sends is built: a second copy of this instance stops here.
        lock = await acquire_instance_lock(engine, settings, clock, resources)
        if settings.sharding.mode == "dynamic" and is_sqlite(engine):
            raise ConfigError("sharding.mode", "'single' or 'static' with SQLite", "dynamic")
        key: SigningKey | None = None
        own_client: FederationClient | None = None
        if sender is None:
            key = own_signing_key(settings, synapse)
            sender = own_client = build_federation_client(settings, key, clock)
        registry, metrics, observer = telemetry(settings, clock, own_client)
        shards = ShardCoordinator(engine, settings.instance_name, clock, settings.sharding)
        manager = build_queue_manager(
            settings, storage, sender, clock, observer, shards,
            domain_allowed=synapse.domain_allowed
            if synapse is not None and synapse.federation_domain_whitelist is not None
            else None,
        )

        shards.on_membership_change = on_membership_change(shards, manager, metrics)
        metrics.set_snapshot_source(manager.snapshot)
        return cls(
            settings=settings,
            clock=clock,
            engine=engine,
            storage=storage,
            sender=sender,
            manager=manager,
            shards=shards,
            metrics=metrics,
            registry=registry,
            observer=observer,
            admin_token=load_or_create_admin_token(settings),
            signing_key=key,
            resources=resources,
            own_client=own_client,
            stop_deadline_s=settings.shutdown_deadline_s,
            capabilities=capabilities,
            admin_verifier=SynapseAdminTokens(engine, clock) if synapse is not None else None,
            lock=lock,
            event_writers=synapse.event_writers if synapse is not None else None,
            device_list_writers=synapse.device_list_writers if synapse is not None else None,
            outbound_proxy=build_outbound_proxy(settings, synapse, own_client, clock, registry),
            synapse=synapse,
        )

    async def start(self) -> None:
        """Start every part, each entered into :attr:`resources` once it runs."""
        try:
            await self._start_parts()
        except BaseException:
            await self.resources.aclose()
            raise
        s = self.settings
        self.ready = True
        log.info(
            "worker %s started for %s (replication: %s, database: %s); %s",
            s.instance_name,
            s.server_name,
            s.replication.transport,
            self.engine.url.get_backend_name(),
            self.listening_description(),
        )
        log.info("%s", catchup_at_start_line(self.manager.catchup_at_start))
        f = s.federation
        proxied = forward_proxy_line(f.http_proxy, f.https_proxy, f.no_proxy)
        if proxied is not None and self.own_client is not None:
            log.info("%s", proxied)

    def listening_description(self) -> str:
        """Where the listeners answer, for the start-up line: ``admin API
        http://127.0.0.1:9293/_synapse/admin/v1/federation/destinations, dashboard
        http://127.0.0.1:9293/dashboard, metrics http://127.0.0.1:9094/metrics``."""
        parts = []
        admin = self.listening.get("admin.port")
        if admin is not None:
            parts += [f"admin API {admin}/_synapse/admin/v1/federation/destinations",
                      f"dashboard {admin}/dashboard"]
        else:
            parts.append("admin API off (admin.enabled: false)")
        metrics = self.listening.get("telemetry.metrics_port")
        parts.append(f"metrics {metrics}/metrics" if metrics is not None else
                     "metrics off (telemetry.metrics_port: null)")
        keys = self.listening.get("federation.key_listener_port")
        if keys is not None:
            parts.append(f"signing keys {keys}/_matrix/key/v2/server")
        return ", ".join(parts)

    async def _start_parts(self) -> None:
        push = self.resources.push_async_callback
        if self.own_client is not None:
            await self.own_client.start()
            push(self.own_client.close)
        # One supervisor for every background task. Each part stops its own at its
        # place in the stop order (the shard heartbeat after the queues drained); the
        # shutdown pushed here, run last, cancels anything a failed start left behind.
        self.supervisor = supervisor = Supervisor(self.clock)
        push(supervisor.shutdown, 5.0)
        await self.shards.start(supervisor)
        push(self.shards.stop)
        await self.manager.start(supervisor)
        push(self._stop_queues)
        parts = set(supervisor.names())

        async def stop_own_tasks() -> None:
            # The intake, the lock and the trimmer stop before the queues drain.
            await supervisor.stop(*(n for n in supervisor.names() if n not in parts),
                                  timeout_s=5.0)

        push(stop_own_tasks)
        if self.lock is not None:
            supervisor.start("instance-lock", self.lock.hold)
        self.replication = self._start_replication(supervisor)
        trimmer = MemoryTrimmer(lambda: self.manager.active_queues, self.clock)
        supervisor.start("memory-trim", trimmer.run, restart=True)
        for key, bind, port, app, tls in self._listeners():
            server = await listen(
                key, bind, port, start_http_server(app, bind, port, ssl_context=tls)
            )
            self.servers.append(server)
            self.listening[key] = server.url
            push(server.stop)
        if self.outbound_proxy is not None:
            await self.outbound_proxy.start()
            push(self.outbound_proxy.close)

    async def _stop_queues(self) -> None:
        await self.manager.stop(self.stop_deadline_s)

    def _start_replication(self, supervisor: Supervisor) -> ReplicationClient | None:
        s = self.settings
        transport = build_replication_transport(s, self.clock)
        if transport is None:
            return None
        store = DbPositionStore(self.storage, s.instance_name)
        caps = self.capabilities
        fanouts = build_edu_fanouts(
            s.server_name, self.storage, self.manager, self.clock,
            synapse_edus(caps.edu_rooms, self.synapse, self.manager, self.clock),
        )  # fmt: skip
        handler = ReplicationIntake(
            self.manager,
            self.storage,
            fanouts,
            self.clock,
            self.metrics,
            on_events_token=self.observer.note_poke,
            tracing=self.observer.tracing,
            event_writers=self.event_writers,
            device_list_writers=self.device_list_writers,
            stored_positions=store,
        )
        caps.bind_stream_tokens(handler.tokens)
        client = ReplicationClient(
            transport,
            instance_name=s.instance_name,
            store=store,
            streams=ROW_PARSERS,
            fetchers=caps.fetchers,
            gap_notes=gap_notes(caps.gap_notes),
            handler=handler,
            clock=self.clock,
            announce=caps.signals.announce if caps.signals is not None else None,
            save_interval_s=s.replication.position_save_interval_s,
            outage=db_outage,
        )
        if caps.signals is not None:
            caps.signals.attach(client.send)

        async def ack(token: int) -> None:
            client.send_federation_ack(token)

        self.manager.set_federation_ack(ack)

        async def replicate() -> None:
            await handler.prepare()
            await client.run()

        supervisor.start("replication", replicate, restart=True)
        for name, loop in fanouts.background().items():
            supervisor.start(name, loop, restart=True)
        return client

    def _listeners(self) -> list[Listener]:
        """(config key, bind, port, application, TLS) of each listener to open, admin first."""
        admin = None
        if self.settings.admin.enabled:
            admin = build_admin_app(
                storage=self.storage,
                token=self.admin_token,
                queues=AdminQueueControl(self.manager),
                clock=self.clock,
                ready=self.is_ready,
                counters=self.metrics.dashboard_counters,
                verifier=self.admin_verifier,
                server_name=self.settings.server_name,
            )
        return [
            *build_listeners(self.settings, admin, self.registry, self.signing_key, self.clock),
            *worker_listeners(self.settings, self.synapse, self.registry),
        ]

    def is_ready(self) -> bool:
        """Started, and connected to replication when a transport is configured."""
        if not self.ready:
            return False
        return self.replication is None or self.replication.connected.is_set()

    async def stop(self, deadline_s: float | None = None) -> None:
        """Stop intake, let in-flight transactions finish within ``deadline_s``
        (default ``shutdown_deadline_s``), then release everything in reverse order."""
        self.ready = False
        if deadline_s is not None:
            self.stop_deadline_s = deadline_s
        await self.resources.aclose()
        self.servers.clear()
        self.listening.clear()
        log.info("worker %s stopped", self.settings.instance_name)


def catchup_at_start_line(behind: list[str]) -> str:
    """The start's INFO line: how many destinations start in catch-up, five named."""
    named = f": {', '.join(behind[:5])}{', …' if len(behind) > 5 else ''}" if behind else ""
    return (
        f"destinations in catch-up at start: {len(behind)} (events owed to them were "
        f"recorded before the last stop){named}"
    )
