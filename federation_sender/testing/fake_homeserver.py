"""A fake remote homeserver: a real aiohttp app on loopback that accepts
``PUT /_matrix/federation/v1/send/{txn_id}`` for any number of destination names
(chosen by the ``Host`` header), records what it received, and misbehaves on demand.

Behaviour is set per destination (or as the default): answer a status code (for the
next N requests or always), delay, hang until released, answer 413 above a body size,
or refuse (400/500) any transaction that contains a given event id or EDU type. Like a
real homeserver, a txn id already accepted is answered 200 without processing again.
Signatures are not checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

SEND_PREFIX = "/_matrix/federation/v1/send/"


@dataclass
class Behaviour:
    status: int = 200
    """Answer this status ..."""
    times: int | None = None
    """... for the next ``times`` requests (None: until changed)."""
    delay_s: float = 0.0
    hang: bool = False
    """Never answer (until :meth:`FakeHomeserver.release` or close)."""
    max_body_bytes: int | None = None
    """Answer 413 to bodies larger than this."""
    reject_event_ids: set[str] = field(default_factory=set)
    reject_edu_types: set[str] = field(default_factory=set)
    reject_message_ids: set[str] = field(default_factory=set)
    """Refuse a transaction holding a to-device EDU with one of these ``message_id``s."""
    reject_status: int = 400


@dataclass(frozen=True)
class ReceivedTxn:
    destination: str
    txn_id: str
    origin: str
    pdus: list[dict[str, Any]]
    edus: list[dict[str, Any]]
    body_bytes: int
    status: int
    duplicate: bool = False

    @property
    def event_ids(self) -> list[str]:
        return [str(p.get("event_id")) for p in self.pdus]

    @property
    def edu_types(self) -> list[str]:
        return [str(e.get("edu_type")) for e in self.edus]


class FakeHomeserver:
    def __init__(self, *, record: bool = True, host: str = "127.0.0.1") -> None:
        self.record = record
        self.host = host
        self.port = 0
        self.default = Behaviour()
        self.behaviours: dict[str, Behaviour] = {}
        self.attempts: dict[str, list[ReceivedTxn]] = defaultdict(list)
        self.accepted_ids: dict[str, set[str]] = defaultdict(set)
        self.pdu_counts: dict[str, int] = defaultdict(int)
        self.txn_counts: dict[str, int] = defaultdict(int)
        self.requests = 0
        self.in_progress = 0
        self._release = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.changed = asyncio.Event()

    # --- lifecycle ------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_put(SEND_PREFIX + "{txn_id}", self._send)
        app.router.add_get("/_stats", self._stats)
        return app

    async def start(self, port: int = 0) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, port, reuse_address=True)
        await site.start()
        server = site._server
        assert server is not None
        sockets = getattr(server, "sockets", None)
        assert sockets
        self.port = int(sockets[0].getsockname()[1])

    async def close(self) -> None:
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # --- control ----------------------------------------------------------------------------

    def behave(self, destination: str | None = None, **kwargs: Any) -> Behaviour:
        """Replace the behaviour of ``destination`` (or the default) with one built from
        ``kwargs``; ``behave(dest)`` restores normal service."""
        b = Behaviour(**kwargs)
        if destination is None:
            self.default = b
        else:
            self.behaviours[destination] = b
        return b

    def release(self) -> None:
        """Let hung requests answer (with the then-current behaviour)."""
        self._release.set()
        self._release = asyncio.Event()

    def accepted(self, destination: str) -> list[ReceivedTxn]:
        return [t for t in self.attempts[destination] if t.status == 200 and not t.duplicate]

    def received_event_ids(self, destination: str) -> list[str]:
        return [e for t in self.accepted(destination) for e in t.event_ids]

    def received_edus(self, destination: str) -> list[dict[str, Any]]:
        return [e for t in self.accepted(destination) for e in t.edus]

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

    async def _send(self, request: web.Request) -> web.Response:
        self.requests += 1
        dest = request.host.split(":")[0] if request.host else ""
        dest = request.headers.get("X-Destination", dest)
        txn_id = request.match_info["txn_id"]
        raw = await request.read()
        self.in_progress += 1
        try:
            return await self._handle(dest, txn_id, raw)
        finally:
            self.in_progress -= 1
            self.changed.set()

    async def _handle(self, dest: str, txn_id: str, raw: bytes) -> web.Response:
        b = self.behaviours.get(dest, self.default)
        if b.hang:
            await self._release.wait()
            b = self.behaviours.get(dest, self.default)
        if b.delay_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._release.wait(), b.delay_s)
        if (
            not self.record
            and b.status == 200
            and b.max_body_bytes is None
            and not (b.reject_event_ids or b.reject_edu_types or b.reject_message_ids)
        ):
            body = json.loads(raw)
            self.txn_counts[dest] += 1
            self.pdu_counts[dest] += len(body.get("pdus", ()))
            return web.json_response({"pdus": {}})
        body = json.loads(raw)
        pdus = list(body.get("pdus", []))
        edus = list(body.get("edus", []))
        status = self._status(dest, b, len(raw), pdus, edus)
        duplicate = status == 200 and txn_id in self.accepted_ids[dest]
        if status == 200:
            self.accepted_ids[dest].add(txn_id)
            if not duplicate:
                self.txn_counts[dest] += 1
                self.pdu_counts[dest] += len(pdus)
        if self.record:
            self.attempts[dest].append(
                ReceivedTxn(
                    dest,
                    txn_id,
                    str(body.get("origin", "")),
                    pdus,
                    edus,
                    len(raw),
                    status,
                    duplicate,
                )
            )
        if status == 200:
            return web.json_response({"pdus": {str(p.get("event_id")): {} for p in pdus}})
        return web.json_response({"errcode": "M_UNKNOWN", "error": f"fake {status}"}, status=status)

    def _status(
        self,
        dest: str,
        b: Behaviour,
        size: int,
        pdus: list[dict[str, Any]],
        edus: list[dict[str, Any]],
    ) -> int:
        """The status ``b`` answers (counting down ``times``, then normal service)."""
        if b.max_body_bytes is not None and size > b.max_body_bytes:
            return 413
        if b.status != 200:
            if b.times is not None:
                b.times -= 1
                if b.times <= 0:
                    self.behaviours[dest] = Behaviour(
                        max_body_bytes=b.max_body_bytes,
                        reject_event_ids=b.reject_event_ids,
                        reject_edu_types=b.reject_edu_types,
                        reject_message_ids=b.reject_message_ids,
                        reject_status=b.reject_status,
                    )
            return b.status
        if any(p.get("event_id") in b.reject_event_ids for p in pdus) or any(
            e.get("edu_type") in b.reject_edu_types
            or (e.get("content") or {}).get("message_id") in b.reject_message_ids
            for e in edus
        ):
            return b.reject_status
        return 200
