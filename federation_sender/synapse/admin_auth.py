"""A Synapse server admin's access token accepted by our admin API.

:class:`SynapseAdminTokens` implements the admin API's
:class:`federation_sender.admin.protocols.TokenVerifier` over Synapse's own tables, so
synapse-admin (logged in to Synapse as a server admin) can call our federation admin
routes through a reverse proxy with the token it already has.

The checks follow Synapse's internal auth (``synapse.api.auth.internal`` and
``assert_requester_is_admin``), in its order, with its answers:

* The token is looked up in ``access_tokens`` joined with ``users`` on
  ``COALESCE(puppets_user_id, user_id)``: a token an admin got from
  ``POST /_synapse/admin/v1/users/<user>/login`` acts as the puppeted user, so it is an
  admin's token only if the *puppeted* user is an admin (the audit line names both).
  Unknown: 401 ``M_UNKNOWN_TOKEN`` "Invalid access token passed.".
* ``valid_until_ms`` in the past (refresh-token sessions): 401 ``M_UNKNOWN_TOKEN``
  "Access token has expired" with ``soft_logout: true``. A refresh token is not an
  access token (it lives in ``refresh_tokens``) and is unknown here, as in Synapse.
* ``users.locked``: 401 ``M_USER_LOCKED``; a guest: 403 ``M_GUEST_ACCESS_FORBIDDEN``.
* ``users.deactivated``: Synapse deletes a user's tokens when it deactivates them; a
  token left behind is answered as unknown.
* ``users.admin`` not set: 403 ``M_FORBIDDEN`` "You are not a server admin".

What we do not do: mark the token used (``access_tokens.used``; we never write
Synapse's auth tables, so a refresh session's previous token may stay refreshable a
little longer, never shorter), application-service tokens, guest macaroons, account
validity modules, or delegated auth (MSC3861 / MAS: tokens are not in
``access_tokens``; only the static admin token works there).

Caching: an accepted token is remembered for ``ttl_s`` (default 30 s) on the injected
clock, keyed by its SHA-256, so a page of synapse-admin costs one query, not one per
request. Revoking a token (logout, deactivation, lock, ``admin`` cleared) therefore
takes effect here within ``ttl_s``; its ``valid_until_ms`` is checked on every request.
Refusals are not cached: a token that becomes valid works at once.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.admin.errors import AdminError, Codes
from federation_sender.clock import Clock, time_ms
from federation_sender.storage.synapse.access_tokens import lookup_access_token

DEFAULT_TTL_S = 30.0
DEFAULT_MAX_ENTRIES = 1024

@dataclass(frozen=True)
class _Accepted:
    principal: str
    valid_until_ms: int | None
    cached_until_s: float


def _unknown() -> AdminError:
    return AdminError(401, Codes.UNKNOWN_TOKEN, "Invalid access token passed.",
                      {"soft_logout": False})


def _expired() -> AdminError:
    return AdminError(401, Codes.UNKNOWN_TOKEN, "Access token has expired",
                      {"soft_logout": True})


class SynapseAdminTokens:
    """Implements :class:`federation_sender.admin.protocols.TokenVerifier`."""

    def __init__(self, engine: AsyncEngine, clock: Clock, *, ttl_s: float = DEFAULT_TTL_S,
                 max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self._engine = engine
        self._clock = clock
        self.ttl_s = ttl_s
        self._max = max_entries
        self._accepted: OrderedDict[bytes, _Accepted] = OrderedDict()
        self.lookups = 0
        """Database lookups made (the cache's misses)."""

    async def verify(self, token: str) -> str:
        key = hashlib.sha256(token.encode("utf-8")).digest()
        hit = self._accepted.get(key)
        if hit is not None and self._clock.monotonic_s() < hit.cached_until_s:
            if hit.valid_until_ms is not None and hit.valid_until_ms < time_ms(self._clock):
                self._accepted.pop(key, None)
                raise _expired()
            return hit.principal
        self._accepted.pop(key, None)
        accepted = await self._lookup(token)
        self._accepted[key] = accepted
        while len(self._accepted) > self._max:
            self._accepted.popitem(last=False)
        return accepted.principal

    async def _lookup(self, token: str) -> _Accepted:
        self.lookups += 1
        row = await lookup_access_token(self._engine, token)
        if row is None:
            raise _unknown()
        user, owner, valid_until_ms, admin, deactivated, locked, guest = row
        if valid_until_ms is not None and valid_until_ms < time_ms(self._clock):
            raise _expired()
        if deactivated:
            raise _unknown()
        if locked:
            raise AdminError(401, Codes.USER_LOCKED, "User account has been locked",
                             {"soft_logout": True})
        if guest:
            raise AdminError(403, Codes.GUEST_ACCESS_FORBIDDEN, "Guest access not allowed")
        if not admin:
            raise AdminError(403, Codes.FORBIDDEN, "You are not a server admin")
        principal = f"Synapse admin {user}" if owner == user else (
            f"Synapse admin {owner} as {user}")
        return _Accepted(principal, valid_until_ms, self._clock.monotonic_s() + self.ttl_s)
