"""Which worker instance sends to which destination, and fencing so that no two
instances send to one destination at once.

Modes (``sharding.mode``):

* ``single`` — this instance owns every destination; no database traffic.
* ``static`` — Synapse's rule: destination ``d`` belongs to
  ``instances[int.from_bytes(sha256(d), "little") % len(instances)]`` of the configured
  list. Changing the list needs a restart of every instance.
* ``dynamic`` — instances register in ``federation_sender_instances`` and heartbeat every
  ``heartbeat_interval_s``; an instance is live while its heartbeat is younger than
  ``lease_s``. ``d`` belongs to the live instance with the highest
  ``sha256(instance || 0x00 || d)`` (rendezvous hashing): when an instance joins or
  leaves, only the destinations it gains or loses move.

Leases (``static`` and ``dynamic``): ownership is a *view*, and two instances' views
differ for up to one heartbeat, so before sending to ``d`` the queue must hold its row
in ``destination_leases``. :meth:`ShardCoordinator.acquire_lease` takes a free or
expired lease (incrementing ``fencing_token``) and refuses one another instance holds
until ``lease_until_ts``. Heartbeats renew only leases of destinations the instance
still owns; a lease on a destination that moved away lapses within ``lease_s`` (or at
once when the queue calls :meth:`release` after its in-flight transaction), and only
then can the new owner take it. The holder stops trusting its lease at the same
expiry (:meth:`holds_lease`). Writes that must not happen after losing the lease
(marking a transaction sent) check :func:`lease_is_current` inside their own database
transaction: a paused old holder's late write is rejected by the token.

Assumptions and failure modes: wall clocks of instances agree to well within
``lease_s`` (NTP); a database outage stops heartbeats, so every lease lapses locally
and sending stops until the database returns; a crashed instance's destinations move
after ``lease_s``. Released leases keep their row (``lease_until_ts = 0``) so fencing
tokens never go backwards. The statements are in :mod:`federation_sender.storage.leases`.

The heartbeat is an ``every`` tick under the worker's
:class:`~federation_sender.supervisor.Supervisor` (a failed one, the database down as one
line, is retried the next interval); :meth:`ShardCoordinator.stop` stops it, after the
queues have drained, so leases are renewed while in-flight transactions finish.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from federation_sender.clock import Clock, time_ms
from federation_sender.config import ShardingSettings
from federation_sender.storage import leases as sql
from federation_sender.storage.engine import db_outage, is_sqlite, run_in_transaction
from federation_sender.storage.leases import lease_is_current
from federation_sender.supervisor import Supervisor

__all__ = [
    "HEARTBEAT", "REAP_AFTER_LEASES", "SINGLE_MODE_TOKEN", "ShardCoordinator", "lease_is_current",
    "rendezvous_owner", "static_owner",
]

log = logging.getLogger(__name__)

MembershipCallback = Callable[[frozenset[str]], Awaitable[None] | None]

SINGLE_MODE_TOKEN = 0
"""The fencing token :meth:`ShardCoordinator.acquire_lease` returns in ``single`` mode."""

HEARTBEAT = "shard heartbeat"
"""The heartbeat's task under the supervisor (and the subject of its log lines)."""

REAP_AFTER_LEASES = 10
"""Instance rows silent for this many lease periods are deleted (housekeeping only)."""


def static_owner(destination: str, instances: Sequence[str]) -> str:
    """Synapse's static sharding rule."""
    if not instances:
        raise ValueError("no instances")
    digest = hashlib.sha256(destination.encode("utf-8")).digest()
    return instances[int.from_bytes(digest, "little") % len(instances)]


def _score(instance: str, destination: str) -> bytes:
    return hashlib.sha256(instance.encode("utf-8") + b"\x00" + destination.encode("utf-8")
                          ).digest()


def rendezvous_owner(destination: str, instances: Iterable[str]) -> str:
    """The instance with the highest hash score for ``destination`` (ties impossible
    in practice; broken by name for determinism)."""
    best = max(instances, key=lambda i: (_score(i, destination), i), default=None)
    if best is None:
        raise ValueError("no instances")
    return best


class ShardCoordinator:
    """Membership, ownership and leases for one instance. See the module docstring."""

    def __init__(self, engine: AsyncEngine, instance_name: str, clock: Clock,
                 settings: ShardingSettings, *,
                 on_membership_change: MembershipCallback | None = None) -> None:
        self._engine = engine
        self.instance_name = instance_name
        self._clock = clock
        self._settings = settings
        self._mode = settings.mode
        self._lease_ms = int(settings.lease_s * 1000)
        self.on_membership_change = on_membership_change
        self._live: frozenset[str] = frozenset([instance_name])
        self._leases: dict[str, tuple[int, float]] = {}  # destination -> (token, until_s)
        self._supervisor: Supervisor | None = None
        if self._mode == "static" and instance_name not in settings.instances:
            raise ValueError("static sharding: instance_name must be in sharding.instances")

    # --- lifecycle ------------------------------------------------------------------

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def live_instances(self) -> frozenset[str]:
        return self._live

    async def start(self, supervisor: Supervisor | None = None) -> None:
        """Register and start heartbeating under ``supervisor`` (the worker's; without
        one, a supervisor of its own); a no-op in ``single`` mode."""
        if self._mode == "single":
            return
        if self._mode == "dynamic" and is_sqlite(self._engine):
            log.warning("dynamic sharding on SQLite: only instances sharing this file "
                        "on one host can coordinate; use PostgreSQL")
        await self.heartbeat_once()
        self._supervisor = supervisor or Supervisor(self._clock)
        # A failed heartbeat is retried next interval; leases lapse locally meanwhile,
        # which stops sending.
        self._supervisor.every(HEARTBEAT, self._settings.heartbeat_interval_s,
                               self.heartbeat_once, db_outage=db_outage, logger=log)

    async def stop(self) -> None:
        """Stop heartbeating, release every lease and deregister, so the others take
        over at their next heartbeat rather than after ``lease_s``."""
        if self._supervisor is not None:
            await self._supervisor.stop(HEARTBEAT)
            self._supervisor = None
        if self._mode == "single":
            return

        async def leave(conn: AsyncConnection) -> None:
            await sql.leave(conn, self.instance_name)

        await run_in_transaction(self._engine, leave)
        self._leases.clear()

    # --- membership -----------------------------------------------------------------

    async def heartbeat_once(self) -> frozenset[str]:
        """Record our heartbeat, read the live set, renew leases of destinations we
        still own, and notice leases lost. Returns the live set."""
        now_ms = time_ms(self._clock)
        until_ms = now_ms + self._lease_ms

        async def beat(conn: AsyncConnection) -> tuple[frozenset[str], dict[str, int]]:
            live = await sql.heartbeat(
                conn, self.instance_name, now_ms, now_ms - self._lease_ms,
                now_ms - REAP_AFTER_LEASES * self._lease_ms,
            )
            keep = [d for d in self._leases if self._owner(d, live) == self.instance_name]
            await sql.renew_leases(conn, self.instance_name, keep, until_ms)
            return live, await sql.held_leases(conn, self.instance_name)

        live, held = await run_in_transaction(self._engine, beat)
        for destination, (token, until_s) in list(self._leases.items()):
            if held.get(destination) != token:
                del self._leases[destination]  # taken over (or released) elsewhere
            elif self._owner(destination, live) == self.instance_name:
                self._leases[destination] = (token, until_ms / 1000.0)
            else:
                self._leases[destination] = (token, until_s)  # left to lapse
        if live != self._live:
            log.info("federation sender instances now %s", sorted(live))
            self._live = live
            await self._notify(live)
        return live

    async def _notify(self, live: frozenset[str]) -> None:
        if self.on_membership_change is None:
            return
        result = self.on_membership_change(live)
        if inspect.isawaitable(result):
            await result

    def _owner(self, destination: str, live: Iterable[str]) -> str:
        if self._mode == "static":
            return static_owner(destination, self._settings.instances)
        return rendezvous_owner(destination, live)

    def owns(self, destination: str) -> bool:
        """Whether this instance should send to ``destination`` (by the current view)."""
        if self._mode == "single":
            return True
        return self._owner(destination, self._live) == self.instance_name

    # --- leases ---------------------------------------------------------------------

    async def acquire_lease(self, destination: str) -> int | None:
        """Take or renew the lease on an owned destination. Returns its fencing token,
        or ``None`` when we do not own it or another instance's lease has not expired."""
        if self._mode == "single":
            return SINGLE_MODE_TOKEN
        if not self.owns(destination):
            return None
        now_ms = time_ms(self._clock)
        until_ms = now_ms + self._lease_ms

        async def take(conn: AsyncConnection) -> int | None:
            return await sql.take_lease(conn, destination, self.instance_name, now_ms, until_ms)

        token = await run_in_transaction(self._engine, take)
        if token is None:
            self._leases.pop(destination, None)
        else:
            self._leases[destination] = (token, until_ms / 1000.0)
        return token

    def holds_lease(self, destination: str, fencing_token: int | None = None) -> bool:
        """Whether our lease (optionally: with this token) is unexpired by our clock."""
        if self._mode == "single":
            return fencing_token in (None, SINGLE_MODE_TOKEN)
        held = self._leases.get(destination)
        if held is None or (fencing_token is not None and held[0] != fencing_token):
            return False
        return self._clock.time_s() < held[1]

    def held_destinations(self) -> list[str]:
        return [d for d in self._leases if self.holds_lease(d)]

    async def release(self, destination: str) -> None:
        """Give the lease up now (after the destination's in-flight transaction)."""
        held = self._leases.pop(destination, None)
        if self._mode == "single" or held is None:
            return
        token = held[0]

        async def give_up(conn: AsyncConnection) -> None:
            await sql.release_lease(conn, destination, self.instance_name, token)

        await run_in_transaction(self._engine, give_up)
