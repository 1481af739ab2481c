"""Composing the worker beside Synapse: storage, the EDU fan-outs' arguments, the key.

Used by :mod:`federation_sender.app` only; kept apart so the composition root stays
one screen per backend.

* :func:`open_synapse_storage`: on an engine on Synapse's database (our schema first on
  the search path), Synapse's schema version checked, our schema migrated (only ours;
  with ``auto_migrate`` off, checked), Synapse's Redis external cache, and the
  :class:`SynapseBackend`.
* :func:`synapse_edus`: the EDU fan-outs' settings (:class:`SynapseEdus`) from the
  backend's ``edu_rooms`` capability and Synapse's configuration.

What the backend says on replication (cache invalidations, ``REMOTE_SERVER_UP``,
``POSITION caches``) is its ``signals`` capability
(:mod:`federation_sender.storage.synapse.signals`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.clock import Clock
from federation_sender.config import Settings
from federation_sender.edus.presence import PresenceFanout, PresenceSink
from federation_sender.storage.capabilities import EduRooms
from federation_sender.storage.synapse.backend import SynapseBackend
from federation_sender.storage.synapse.database import (
    check_own_schema,
    check_synapse,
    upgrade_own_schema,
)
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


@dataclass(frozen=True, slots=True)
class SynapseEdus:
    """What the EDU fan-outs take from Synapse (:func:`synapse_edus`)."""

    rooms: EduRooms
    """Rooms and hosts as Synapse reads them for typing and receipts (the backend's
    ``edu_rooms``, partial-state approximation included)."""
    receipt_max_delay_s: float
    """The receipt pacing, from ``federation_rr_transactions_per_room_per_second``."""
    presence: PresenceFanout | None
    """The presence fan-out when Synapse has presence enabled."""


def synapse_edus(
    rooms: EduRooms | None, syn: SynapseConfig | None, sink: PresenceSink, clock: Clock
) -> SynapseEdus | None:
    """The EDU fan-outs' settings beside Synapse; None without Synapse (or without the
    backend's rooms): the fan-outs then read rooms through the storage Protocols, at the
    default pacing, without presence."""
    if rooms is None or syn is None:
        return None
    presence = None
    if syn.presence_enabled:
        presence = PresenceFanout(
            syn.server_name,
            rooms,
            sink,
            clock,
            last_active_granularity_ms=syn.presence_last_active_granularity_ms,
            excluded_rooms=syn.rooms_to_exclude_from_presence,
        )
    return SynapseEdus(
        rooms, 1.0 / syn.federation_rr_transactions_per_room_per_second, presence
    )
