"""The admin HTTP application: Synapse's federation destinations API and extras.

Routes (all under ``/_synapse/admin/v1/federation`` need the bearer token):

* ``GET destinations`` — Synapse's list: ``from``, ``limit``, ``destination``
  (substring), ``order_by``, ``dir``; ``total`` and ``next_token``.
* ``GET destinations/{destination}`` — one destination; 404 when unknown.
* ``GET destinations/{destination}/rooms`` — its rooms, paginated.
* ``POST destinations/{destination}/reset_connection`` — clear backoff and wake the
  queue; 400 when it is not backing off.
* Extensions: ``GET destinations/{destination}/transactions`` (the transaction log),
  ``GET summary`` (counts for the dashboard), and a ``queue`` object with live queue
  state on every destination.

``GET /_synapse/admin/v1/server_version`` answers ``{"server_version": ...}`` without a
token, as Synapse does (synapse-admin asks it on its login page). For synapse-admin's
login with an access token: ``GET /_matrix/client/versions`` (open) and
``GET /_matrix/client/v3/account/whoami`` (the token's user id; 401 as Synapse's).

Open routes: ``/health`` (the process answers), ``/ready`` (the readiness check passed
in), ``/openapi.json`` (the API description, checked against the routes in a test)
and ``/dashboard`` (a static page; it asks for the token and calls the API).

The app holds no state of its own: every read goes to the database or to the
:class:`QueueControl`, so it can be rebuilt or served twice without coordination.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from functools import cache
from importlib import resources
from typing import Any

from aiohttp import web

from federation_sender.admin import handlers
from federation_sender.admin.handlers import (
    CLOCK,
    COUNTERS,
    QUEUES,
    READY,
    STORAGE,
    CounterSource,
    ReadinessCheck,
)
from federation_sender.admin.middleware import USER_ID, error_middleware, make_auth_middleware
from federation_sender.admin.protocols import QueueControl, TokenVerifier
from federation_sender.clock import Clock
from federation_sender.storage.protocols import Backend

API = "/_synapse/admin/v1/federation"


def _always_ready() -> bool:
    return True


@cache
def openapi_document() -> dict[str, Any]:
    text = resources.files("federation_sender.admin").joinpath("openapi.json").read_text("utf-8")
    doc: dict[str, Any] = json.loads(text)
    return doc


def _csp_hash(body: str) -> str:
    digest = hashlib.sha256(body.encode("utf-8")).digest()
    return "'sha256-" + base64.b64encode(digest).decode("ascii") + "'"


@cache
def dashboard_page() -> tuple[bytes, str]:
    """The dashboard HTML and a Content-Security-Policy allowing exactly its inline
    script and style (by hash) and requests to this origin only."""
    html = resources.files("federation_sender.admin").joinpath("dashboard.html").read_text(
        "utf-8")
    scripts = [_csp_hash(s) for s in re.findall(r"<script>(.*?)</script>", html, re.S)]
    styles = [_csp_hash(s) for s in re.findall(r"<style>(.*?)</style>", html, re.S)]
    csp = "; ".join([
        "default-src 'none'",
        "script-src " + " ".join(scripts or ["'none'"]),
        "style-src " + " ".join(styles or ["'none'"]),
        "connect-src 'self'",
        "img-src 'self' data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ])
    return html.encode("utf-8"), csp


def server_version() -> str:
    """What ``/_synapse/admin/v1/server_version`` reports: our own name and version,
    not Synapse's (we cannot know which Synapse release runs beside us, and a client
    that shows it should not mistake this listener for Synapse)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"federation-sender {version('federation-sender')}"
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "federation-sender (not installed)"


async def _server_version(request: web.Request) -> web.Response:
    return web.json_response({"server_version": server_version()})


CLIENT_VERSIONS = ("r0.6.1", *(f"v1.{minor}" for minor in range(1, 13)))
"""The Matrix client-server spec versions ``/_matrix/client/versions`` lists (those
Synapse lists from r0.6.1 on): synapse-admin checks the server answers before
it asks ``whoami``. Only ``whoami`` of the client API is served here."""


async def _client_versions(request: web.Request) -> web.Response:
    return web.json_response({"versions": list(CLIENT_VERSIONS), "unstable_features": {}})


async def _whoami(request: web.Request) -> web.Response:
    """Synapse's answer for the token's user (no device: the admin token has none)."""
    return web.json_response({"user_id": request[USER_ID], "is_guest": False})


def admin_user_id(server_name: str) -> str:
    """The user id ``whoami`` gives the static admin token: a name no Synapse user is
    likely to have, on our server name."""
    return f"@{ADMIN_LOCALPART}:{server_name}"


ADMIN_LOCALPART = "federation-sender-admin"


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


async def _dashboard(request: web.Request) -> web.Response:
    body, csp = dashboard_page()
    return web.Response(body=body, content_type="text/html", charset="utf-8", headers={
        "Content-Security-Policy": csp,
        "Referrer-Policy": "no-referrer",
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-store",
    })


def build_admin_app(
    *,
    storage: Backend,
    token: str,
    queues: QueueControl,
    clock: Clock,
    ready: ReadinessCheck | None = None,
    counters: CounterSource | None = None,
    verifier: TokenVerifier | None = None,
    server_name: str = "localhost",
) -> web.Application:
    """Build the admin application. ``token`` must be non-empty; ``ready`` returns
    (or resolves to) whether the worker is ready (``/ready`` answers 503 when not);
    ``counters`` gives the running totals the dashboard charts (``summary.counters``);
    ``verifier`` checks bearer tokens other than ``token`` (none: only ``token``);
    ``server_name`` is the server part of the user id ``whoami`` gives ``token``."""
    app = web.Application(middlewares=[
        error_middleware,
        make_auth_middleware(token, verifier, admin_user_id(server_name)),
    ])
    app[STORAGE] = storage
    app[QUEUES] = queues
    app[CLOCK] = clock
    app[READY] = ready if ready is not None else _always_ready
    app[COUNTERS] = counters if counters is not None else dict
    dest = API + "/destinations/{destination}"
    app.router.add_get(API + "/destinations", handlers.list_destinations)
    app.router.add_get(dest, handlers.get_destination)
    app.router.add_get(dest + "/rooms", handlers.destination_rooms)
    app.router.add_get(dest + "/transactions", handlers.destination_transactions)
    app.router.add_post(dest + "/reset_connection", handlers.reset_connection)
    app.router.add_get(API + "/summary", handlers.summary)
    app.router.add_get("/_synapse/admin/v1/server_version", _server_version)
    app.router.add_get("/_matrix/client/versions", _client_versions)
    app.router.add_get("/_matrix/client/v3/account/whoami", _whoami)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/ready", handlers.ready)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_get("/dashboard", _dashboard)
    return app
