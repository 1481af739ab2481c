"""Synapse's ``access_tokens`` joined with ``users``, for the admin-token check
(:mod:`federation_sender.synapse.admin_auth`).

A token an admin got from ``POST /_synapse/admin/v1/users/<user>/login`` acts as the
puppeted user, so the user row is the one of ``COALESCE(puppets_user_id, user_id)``.
"""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

_LOOKUP = text(
    """
    SELECT u.name, t.user_id, t.valid_until_ms, u.admin, u.deactivated, u.locked,
           u.is_guest
    FROM access_tokens t
    JOIN users u ON u.name = COALESCE(t.puppets_user_id, t.user_id)
    WHERE t.token = :token
    """
)


class TokenOwner(NamedTuple):
    user: str
    """The user the token acts as (the puppeted user, if any)."""
    owner: str
    """The user the token was issued to."""
    valid_until_ms: int | None
    admin: bool
    deactivated: bool
    locked: bool
    guest: bool


async def lookup_access_token(engine: AsyncEngine, token: str) -> TokenOwner | None:
    async with engine.connect() as conn:
        row = (await conn.execute(_LOOKUP, {"token": token})).first()
    if row is None:
        return None
    user, owner, valid_until_ms, admin, deactivated, locked, guest = row
    return TokenOwner(
        str(user), str(owner), None if valid_until_ms is None else int(valid_until_ms),
        bool(admin), bool(deactivated), bool(locked), bool(guest),
    )
