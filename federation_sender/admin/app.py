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
token, as Synapse does (synapse-admin asks it on its login page).

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
from federation_sender.admin.middleware import error_middleware, make_auth_middleware
from federation_sender.admin.protocols import QueueControl, TokenVerifier
from federation_sender.clock import Clock
from federation_sender.storage.protocols import Backend

API = "/_synapse/admin/v1/federation"

OPEN_PATHS = ("/health", "/ready", "/openapi.json", "/dashboard")


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
) -> web.Application:
    """Build the admin application. ``token`` must be non-empty; ``ready`` returns
    (or resolves to) whether the worker is ready (``/ready`` answers 503 when not);
    ``counters`` gives the running totals the dashboard charts (``summary.counters``);
    ``verifier`` checks bearer tokens other than ``token`` (none: only ``token``)."""
    app = web.Application(
        middlewares=[error_middleware, make_auth_middleware(token, verifier)])
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
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/ready", handlers.ready)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_get("/dashboard", _dashboard)
    return app
