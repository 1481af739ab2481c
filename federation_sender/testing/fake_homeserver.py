"""A fake remote homeserver for any number of destination names on one port.

A real aiohttp app on loopback that accepts ``PUT /_matrix/federation/v1/send/{txn_id}``
for every destination (chosen by the ``Host`` header, or ``X-Destination``), records
what it received, and misbehaves on demand. The receiving side (parsing, the optional
X-Matrix check, dedup by txn id, scripted behaviours, seeded random faults, recording)
is the shared :class:`~federation_sender.testing.remote_core.Receiver`; this is only the
single-port, Host-routed front-end, used by the queue and worker tests and the
benchmarks (``record=False``: counts only). Signatures are not checked unless a
``lookup_key`` is given.
"""

from __future__ import annotations

import ssl
from typing import Any

from aiohttp import web

from federation_sender.testing.remote_core import (
    CLIENT_MAX_SIZE,
    SEND_PATH,
    SEND_PREFIX,
    Receiver,
)
from federation_sender.testing.remote_records import Behaviour, ReceivedTxn
from federation_sender.transport.client import VERSION_PATH
from federation_sender.transport.signing import VerifyKeyLookup

__all__ = ["SEND_PREFIX", "Behaviour", "FakeHomeserver", "ReceivedTxn"]


class FakeHomeserver(Receiver):
    def __init__(
        self,
        *,
        record: bool = True,
        host: str = "127.0.0.1",
        lookup_key: VerifyKeyLookup | None = None,
    ) -> None:
        super().__init__(record=record, lookup_key=lookup_key)
        self.host = host
        self.port = 0
        self._scheme = "http"
        self._runner: web.AppRunner | None = None
        self.version_requests: dict[str, int] = {}
        """``GET /_matrix/federation/v1/version`` requests per destination."""

    # --- lifecycle ------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=CLIENT_MAX_SIZE)
        app.router.add_put(SEND_PATH, self._send)
        app.router.add_get(VERSION_PATH, self._version)
        app.router.add_get("/_stats", self._stats)
        return app

    async def start(self, port: int = 0, ssl_context: ssl.SSLContext | None = None) -> None:
        """Listen on ``port`` (0: any free one); over TLS with ``ssl_context``."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, port, reuse_address=True,
                           ssl_context=ssl_context)
        await site.start()
        self.port = site.port
        self._scheme = "http" if ssl_context is None else "https"

    async def close(self) -> None:
        self.release_all()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"{self._scheme}://{self.host}:{self.port}"

    # --- what was received ------------------------------------------------------------------

    def accepted(self, destination: str) -> list[ReceivedTxn]:
        return self.records[destination].txns

    def received_event_ids(self, destination: str) -> list[str]:
        return [e for t in self.accepted(destination) for e in t.event_ids]

    def received_edus(self, destination: str) -> list[dict[str, Any]]:
        return self.records[destination].edus

    # --- handlers ---------------------------------------------------------------------------

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "requests": self.requests,
                "pdus": sum(self.pdu_counts.values()),
                "txns": sum(self.txn_counts.values()),
                "destinations": len(self.txn_counts),
            }
        )

    async def _version(self, request: web.Request) -> web.Response:
        """A destination told to answer /send with a 5xx answers this with it too (it
        is down); otherwise its version. Counted in ``version_requests``."""
        dest = request.headers.get(
            "X-Destination", request.host.split(":")[0] if request.host else "")
        self.version_requests[dest] = self.version_requests.get(dest, 0) + 1
        status = self.behaviours.get(dest, self.default).status
        if status >= 500:
            return web.Response(status=status)
        return web.json_response({"server": {"name": "fake-homeserver", "version": "0"}})

    async def _send(self, request: web.Request) -> web.StreamResponse:
        dest = request.host.split(":")[0] if request.host else ""
        return await self.receive(request, request.headers.get("X-Destination", dest))
