"""``federation_sender_instances`` (heartbeats) and ``destination_leases`` (fenced
ownership): the SQL of :mod:`federation_sender.sharding`, which owns the rules.

These are project-only tables on every backend (on Synapse's database they live in our
own schema), so they need no Protocol of their own. Every function takes the caller's
connection; the caller chooses the transaction.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import Table, delete, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.storage.schema import destination_leases, federation_sender_instances

_L = destination_leases.c
_I = federation_sender_instances.c


def _insert(conn: AsyncConnection, table: Table) -> Any:
    # Both dialects' INSERT support on_conflict_do_nothing(); their types differ.
    return pg_insert(table) if conn.dialect.name == "postgresql" else sqlite_insert(table)


async def lease_is_current(
    conn: AsyncConnection, destination: str, instance_name: str, fencing_token: int
) -> bool:
    """Inside the caller's transaction: does ``instance_name`` still hold the lease
    with ``fencing_token``? Locks the lease row on PostgreSQL so a takeover waits for
    the caller's commit."""
    stmt = select(_L.fencing_token).where(
        _L.destination == destination, _L.instance_name == instance_name,
        _L.fencing_token == fencing_token)
    if conn.dialect.name == "postgresql":
        stmt = stmt.with_for_update()
    return (await conn.execute(stmt)).first() is not None


async def leave(conn: AsyncConnection, instance_name: str) -> None:
    """Release every lease of the instance (rows kept: tokens never go backwards) and
    deregister it."""
    await conn.execute(update(destination_leases)
                       .where(_L.instance_name == instance_name)
                       .values(lease_until_ts=0))
    await conn.execute(delete(federation_sender_instances)
                       .where(_I.instance_name == instance_name))


async def heartbeat(
    conn: AsyncConnection, instance_name: str, now_ms: int, live_after_ms: int,
    reap_before_ms: int,
) -> frozenset[str]:
    """Record the instance's heartbeat, delete instances silent since before
    ``reap_before_ms``, and return the instances heard from since ``live_after_ms``
    (this one included)."""
    updated = await conn.execute(
        update(federation_sender_instances)
        .where(_I.instance_name == instance_name).values(heartbeat_ts=now_ms))
    if updated.rowcount == 0:
        await conn.execute(_insert(conn, federation_sender_instances).values(
            instance_name=instance_name, started_ts=now_ms, heartbeat_ts=now_ms,
        ).on_conflict_do_nothing())
    await conn.execute(delete(federation_sender_instances).where(
        _I.heartbeat_ts < reap_before_ms))
    rows = await conn.execute(select(_I.instance_name).where(_I.heartbeat_ts >= live_after_ms))
    return frozenset(str(r[0]) for r in rows) | {instance_name}


async def renew_leases(
    conn: AsyncConnection, instance_name: str, destinations: Collection[str], until_ms: int
) -> None:
    if destinations:
        await conn.execute(update(destination_leases).where(
            _L.instance_name == instance_name, _L.destination.in_(list(destinations)),
        ).values(lease_until_ts=until_ms))


async def held_leases(conn: AsyncConnection, instance_name: str) -> dict[str, int]:
    """destination -> fencing token of the unreleased leases the instance holds."""
    held = await conn.execute(select(_L.destination, _L.fencing_token).where(
        _L.instance_name == instance_name, _L.lease_until_ts > 0))
    return {str(d): int(t) for d, t in held}


async def take_lease(
    conn: AsyncConnection, destination: str, instance_name: str, now_ms: int, until_ms: int
) -> int | None:
    """Take a free or expired lease (a new fencing token) or renew our own; None while
    another instance's lease has not expired."""
    stmt = select(_L.instance_name, _L.lease_until_ts, _L.fencing_token).where(
        _L.destination == destination)
    if conn.dialect.name == "postgresql":
        stmt = stmt.with_for_update()
    row = (await conn.execute(stmt)).first()
    if row is None:
        inserted = await conn.execute(_insert(conn, destination_leases).values(
            destination=destination, instance_name=instance_name,
            lease_until_ts=until_ms, fencing_token=1).on_conflict_do_nothing())
        if inserted.rowcount == 1:
            return 1
        row = (await conn.execute(stmt)).one()
    holder, lease_until, token = row
    if holder == instance_name and lease_until > 0:
        await conn.execute(update(destination_leases).where(
            _L.destination == destination).values(lease_until_ts=until_ms))
        return int(token)
    if lease_until > now_ms:
        return None
    new_token = int(token) + 1
    await conn.execute(update(destination_leases).where(
        _L.destination == destination, _L.fencing_token == token,
    ).values(instance_name=instance_name, lease_until_ts=until_ms,
             fencing_token=new_token))
    return new_token


async def release_lease(
    conn: AsyncConnection, destination: str, instance_name: str, fencing_token: int
) -> None:
    await conn.execute(update(destination_leases).where(
        _L.destination == destination, _L.instance_name == instance_name,
        _L.fencing_token == fencing_token).values(lease_until_ts=0))
