"""Composing the worker beside Synapse: storage, signals to other processes, the key.

Used by :mod:`federation_sender.app` only; kept apart so the composition root stays
one screen per backend.

* :func:`open_synapse_storage`: on an engine on Synapse's database (our schema first on
  the search path), Synapse's schema version checked, our schema migrated (only ours;
  with ``auto_migrate`` off, checked), Synapse's Redis external cache, and the
  :class:`SynapseBackend`.
* :class:`ReplicationSignals`: what a Synapse process says on replication about the
  streams it writes. After each commit that invalidated retry timings it publishes
  ``RDATA caches <instance> <id> ["get_destination_retry_timings", [dest], ts]``, and
  ``REMOTE_SERVER_UP <dest>`` for a destination that came back; after connecting and in
  answer to every ``REPLICATE`` it sends ``POSITION caches <instance> <id> <id>``, so a
  reader that missed rows while we were disconnected fetches them from
  ``cache_invalidation_stream_by_instance`` (Synapse's readers do).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.clock import Clock
from federation_sender.config import Settings
from federation_sender.replication import commands as c
from federation_sender.storage.synapse.backend import SynapseBackend
from federation_sender.storage.synapse.database import (
    check_own_schema,
    check_synapse,
    upgrade_own_schema,
)
from federation_sender.storage.synapse.destinations import PendingSignals
from federation_sender.storage.synapse.hosts import RedisExternalCache
from federation_sender.synapse.config import SynapseConfig
from federation_sender.transport.signing import SigningKey, load_signing_key

log = logging.getLogger(__name__)


async def open_synapse_storage(
    engine: AsyncEngine,
    settings: Settings,
    syn: SynapseConfig,
    clock: Clock,
    resources: contextlib.AsyncExitStack,
    *,
    auto_migrate: bool = True,
) -> SynapseBackend:
    """The backend on ``engine`` (from :func:`create_synapse_engine`): Synapse's schema
    checked, ours migrated (or, without ``auto_migrate``, checked). The Redis client of
    the external cache is closed by ``resources``."""
    await check_synapse(engine)
    if auto_migrate:
        await upgrade_own_schema(engine)
    else:
        await check_own_schema(engine)
    import redis.asyncio as aioredis

    # Bounded: a lookup runs inside the intake's database transaction, and an
    # unreachable Redis must read as a miss (the database answers), not hold it open.
    client: Any = aioredis.Redis.from_url(
        settings.replication.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0
    )
    resources.push_async_callback(client.aclose)
    backend = SynapseBackend(
        engine, syn, settings.instance_name, clock, external=RedisExternalCache(client)
    )
    await backend.load_caches_position()
    return backend


def load_synapse_signing_key(path: str) -> SigningKey:
    """Synapse's own key file, as Synapse wrote it (0644 is accepted with a warning)."""
    return load_signing_key(path, others_may_read=True)


class ReplicationSignals:
    """Publishes the backend's signals on a replication client (see the module doc)."""

    def __init__(self, backend: SynapseBackend, instance_name: str) -> None:
        self._backend = backend
        self._instance = instance_name
        self._send: Callable[[c.Command], bool] | None = None
        self.dropped = 0
        backend.on_signals = self.emit

    def attach(self, send: Callable[[c.Command], bool]) -> None:
        self._send = send

    def emit(self, signals: PendingSignals) -> None:
        commands: list[c.Command] = [
            c.RdataCommand("caches", self._instance, stream_id, [func, keys, ts])
            for stream_id, func, keys, ts in signals.invalidations
        ]
        commands.extend(c.RemoteServerUpCommand(d) for d in signals.servers_up)
        for command in commands:
            if self._send is None or not self._send(command):
                # Disconnected: the POSITION sent on reconnecting makes readers fetch
                # the invalidations from the database.
                self.dropped += 1

    def announce(self) -> Sequence[c.Command]:
        pos = self._backend.caches_position
        return [c.PositionCommand("caches", self._instance, pos, pos)]
