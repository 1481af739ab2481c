"""Request middleware: Matrix-style errors, bearer-token auth, CORS.

Auth: every path under ``/_synapse/admin/`` and ``/_matrix/client/`` (only ``whoami``
is served there, and the open ``versions``) needs ``Authorization: Bearer <token>``,
compared in constant time. The token is never read from the query string (URLs end
up in access logs and browser history). A token that is not the static one goes to
the :class:`TokenVerifier`, when there is one (beside Synapse: a server admin's access
token); without one it is refused. Other paths (``/health``, ``/ready``,
``/openapi.json``, ``/dashboard``) and ``/_synapse/admin/v1/server_version`` (open in
Synapse too) are open: they carry no destination data.

CORS: browser-based admin tools (synapse-admin and the like) call the API from
another origin. Allowing any origin is safe here because credentials are a bearer
header, never cookies, so a foreign page cannot borrow an operator's session.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from federation_sender.admin.errors import AdminError, Codes, error_response
from federation_sender.admin.protocols import TokenVerifier

log = logging.getLogger(__name__)
audit = logging.getLogger("federation_sender.admin.audit")
"""One line per admin action (every request that is not a read): who, what, result."""

PRINCIPAL = web.RequestKey("admin_principal", str)
"""Who made the request, as the audit line names them (never the token itself)."""
USER_ID = web.RequestKey("admin_user_id", str)
"""The Matrix user id the token stands for (``whoami``): the static token's
configured one, or the Synapse admin the verifier accepted (the puppeted user)."""

ADMIN_PREFIX = "/_synapse/admin/"
CLIENT_PREFIX = "/_matrix/client/"
"""The two client-API routes synapse-admin asks to log in (``versions``, ``whoami``)."""
OPEN_ADMIN_PATHS = frozenset({"/_synapse/admin/v1/server_version",
                              "/_matrix/client/versions"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_CORS_HEADERS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
    "Access-Control-Allow-Headers": "Authorization, Content-Type",
}


def token_matches(presented: str, expected: str) -> bool:
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


def _api_path(path: str) -> bool:
    return path.startswith(ADMIN_PREFIX) or path.startswith(CLIENT_PREFIX)


def acting_user(principal: str) -> str:
    """The user a verifier's principal acts as: its last ``@user:server`` word
    (``Synapse admin @ops:hs``, ``Synapse admin @ops:hs as @other:hs``)."""
    words = [w for w in principal.split() if w.startswith("@")]
    return words[-1] if words else principal


def make_auth_middleware(token: str, verifier: TokenVerifier | None = None,
                         user_id: str = "") -> Middleware:
    """``user_id``: what ``whoami`` answers for the static token."""
    if not token:
        raise ValueError("the admin token must not be empty")

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (request.method == "OPTIONS" or not _api_path(request.path)
                or request.path in OPEN_ADMIN_PATHS):
            return await handler(request)
        header = request.headers.get("Authorization")
        if header is None:
            raise AdminError(401, Codes.MISSING_TOKEN, "Missing access token.")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented:
            raise AdminError(401, Codes.MISSING_TOKEN, "Invalid Authorization header.")
        presented = presented.strip()
        if token_matches(presented, token):
            request[PRINCIPAL] = "admin token"
            request[USER_ID] = user_id
        elif verifier is not None:
            request[PRINCIPAL] = principal = await verifier.verify(presented)
            request[USER_ID] = acting_user(principal)
        else:
            raise AdminError(401, Codes.UNKNOWN_TOKEN, "Unrecognised access token.")
        return await handler(request)

    return auth_middleware


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: turn every failure into JSON and add CORS headers to API replies."""
    if request.method == "OPTIONS" and _api_path(request.path):
        return web.Response(status=204, headers=_CORS_HEADERS)
    try:
        response = await handler(request)
    except AdminError as e:
        response = e.response()
    except web.HTTPMethodNotAllowed as e:
        response = error_response(405, Codes.UNRECOGNIZED, "Unrecognized request")
        response.headers["Allow"] = ", ".join(sorted(e.allowed_methods))  # RFC 9110 15.5.6
    except web.HTTPNotFound:
        response = error_response(404, Codes.UNRECOGNIZED, "Unrecognized request")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        response = error_response(e.status, Codes.UNKNOWN, e.reason)
    except Exception:
        # The top of a request: log with context and answer 500 rather than drop it.
        log.exception("admin request %s %s failed", request.method, request.path)
        response = error_response(500, Codes.UNKNOWN, "Internal server error")
    if _api_path(request.path):
        if not response.prepared:
            response.headers.update(_CORS_HEADERS)
        if request.method not in ("GET", "HEAD"):
            _audit(request, response.status)
    return response


def _audit(request: web.Request, status: int) -> None:
    who = request.get(PRINCIPAL, "unauthenticated")
    result = "ok" if status < 400 else "refused" if status < 500 else "failed"
    audit.info("admin action by %s from %s: %s %s -> %d %s", who, request.remote,
               request.method, request.path, status, result)
