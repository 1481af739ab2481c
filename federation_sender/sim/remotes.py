"""Fake remote homeservers: loopback aiohttp servers that answer ``/send`` like Synapse.

Theory of operation
-------------------
Each :class:`FakeRemote` is one server name with its own listening port, so "down"
can mean what it means on the internet: the listener is closed (new connections are
refused) and open connections are reset. A request to
``PUT /_matrix/federation/v1/send/{txn_id}`` goes through, in order:

1. infrastructure faults from the :class:`~.faults.FaultProfile`: down (reset), 413
   for a body over the size limit, reset while reading, 500, hang;
2. X-Matrix authentication with :func:`~federation_sender.transport.signing.verify_request`
   against the origin's verify key, given up front (no key fetching): 401
   ``M_UNAUTHORIZED`` if missing, malformed, for another destination, or forged;
3. Synapse's transaction rules: 400 ``{}`` over 50 PDUs or 100 EDUs; a transaction
   id already answered gets the same answer again without being reprocessed (the
   spec's idempotence); the same id still in progress waits for that answer; a
   *different* transaction from an origin that has one in progress gets 429;
4. processing: every PDU is named by its reference hash (see :mod:`.pdu`) and
   recorded with every EDU in :class:`RemoteRecord`; the optional ``slow`` delay is
   spent here, inside the "in progress" window, as a busy Synapse would;
5. answer faults that strike after processing (cut-off response, garbage body), which
   make the sender retry a transaction the remote already has.

All timing (down windows, delays, hangs) goes through the injected clock and all
chance through the remote's own ``random.Random``. :class:`~.fleet.RemoteFleet` (``fleet.py``)
starts and stops many remotes and gives the worker its ``destination_overrides``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from federation_sender.clock import Clock
from federation_sender.sim.faults import Fault, FaultProfile, choose_fault
from federation_sender.sim.pdu import reference_event_id
from federation_sender.transport.signing import (
    AuthenticationError,
    VerifyKeyLookup,
    verify_request,
)

log = logging.getLogger(__name__)

SEND_PATH = "/_matrix/federation/v1/send/{txn_id}"
MAX_PDUS = 50
MAX_EDUS = 100
_CLIENT_MAX_SIZE = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ReceivedTxn:
    txn_id: str
    origin: str
    received_ts_s: float
    pdu_event_ids: tuple[str, ...]
    edu_types: tuple[str, ...]
    body_bytes: int


@dataclass(slots=True)
class RemoteRecord:
    """What one remote saw. Counters are keyed by outcome names, e.g. ``"200"``."""

    txns: list[ReceivedTxn] = field(default_factory=list)
    pdu_counts: Counter[str] = field(default_factory=Counter)
    """event id -> how many processed transactions carried it (>1 is a duplicate)."""
    pdu_rooms: dict[str, str] = field(default_factory=dict)
    edus: list[dict[str, Any]] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    retransmits: int = 0
    """Requests for an already-answered transaction id (answered from the cache)."""
    bytes_received: int = 0
    max_concurrent: int = 0
    """The most requests this remote was handling at once (``one in flight`` ≤ 1)."""

    @property
    def pdus_received(self) -> int:
        return sum(self.pdu_counts.values())


class _Dropped(Exception):
    """The connection was reset on purpose; no response."""


def _abort(request: web.Request) -> None:
    """Reset the connection (RST, not FIN) so the client sees a hard failure."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _error(status: int, errcode: str, error: str) -> web.Response:
    return web.json_response({"errcode": errcode, "error": error}, status=status)


class FakeRemote:
    """One fake homeserver named ``server_name`` on a loopback port."""

    def __init__(
        self,
        server_name: str,
        *,
        lookup_key: VerifyKeyLookup,
        clock: Clock,
        rng: random.Random,
        faults: FaultProfile | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.server_name = server_name
        self.faults = faults or FaultProfile()
        self.record = RemoteRecord()
        self.down = False
        self._lookup_key = lookup_key
        self._clock = clock
        self._rng = rng
        self._host = host
        self._port = port
        self._answered: dict[tuple[str, str], tuple[int, dict[str, Any]]] = {}
        self._in_progress: dict[tuple[str, str], asyncio.Future[tuple[int, dict[str, Any]]]] = {}
        self._active: dict[str, str] = {}
        self._handling = 0
        self._stopping = asyncio.Event()
        self._started_mono_s = 0.0
        self._schedule: asyncio.Task[None] | None = None
        self._site: web.TCPSite | None = None
        self.app = web.Application(client_max_size=_CLIENT_MAX_SIZE)
        self.app.router.add_put(SEND_PATH, self._on_send)
        self.app.router.add_get("/_matrix/federation/v1/version", self._on_version)
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=1.0)

    # --- lifecycle -------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        """``host:port``, for the worker's ``destination_overrides``."""
        return f"{self._host}:{self._port}"

    async def start(self) -> None:
        await self._runner.setup()
        self._started_mono_s = self._clock.monotonic_s()
        await self._listen()
        if self.faults.down:
            self._schedule = asyncio.create_task(
                self._run_down_schedule(), name=f"fake-remote-schedule-{self.server_name}"
            )

    async def stop(self) -> None:
        self._stopping.set()
        if self._schedule is not None:
            self._schedule.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._schedule
        await self._runner.cleanup()

    async def _listen(self) -> None:
        site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
        await site.start()
        self._port = site.port
        self._site = site

    async def go_down(self) -> None:
        """Refuse new connections and reset open ones."""
        if self.down:
            return
        self.down = True
        if self._site is not None:
            await self._site.stop()
            self._site = None
        server = self._runner.server
        for handler in server.connections if server is not None else []:
            if handler.transport is not None:
                handler.transport.abort()
        log.info("fake remote %s is down", self.server_name)

    async def come_up(self) -> None:
        if not self.down:
            return
        await self._listen()
        self.down = False
        log.info("fake remote %s is up again", self.server_name)

    async def _run_down_schedule(self) -> None:
        for start_s, end_s in sorted(self.faults.down):
            await self._sleep_until(start_s)
            await self.go_down()
            await self._sleep_until(end_s)
            await self.come_up()

    async def _sleep_until(self, elapsed_s: float) -> None:
        delay = self._started_mono_s + elapsed_s - self._clock.monotonic_s()
        if delay > 0:
            await self._clock.sleep(delay)

    async def _sleep_unless_stopping(self, seconds: float) -> None:
        sleeper = asyncio.ensure_future(self._clock.sleep(seconds))
        stopper = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            stopper.cancel()

    # --- handlers --------------------------------------------------------------

    async def _on_version(self, request: web.Request) -> web.StreamResponse:
        if self.down:
            _abort(request)
            return web.Response()
        return web.json_response({"server": {"name": "federation-sender-sim", "version": "0"}})

    async def _on_send(self, request: web.Request) -> web.StreamResponse:
        self._handling += 1
        self.record.max_concurrent = max(self.record.max_concurrent, self._handling)
        try:
            response, outcome = await self._handle_send(request)
        except _Dropped as e:
            self.record.outcomes[str(e)] += 1
            return web.Response()
        finally:
            self._handling -= 1
        self.record.outcomes[outcome] += 1
        return response

    async def _handle_send(self, request: web.Request) -> tuple[web.StreamResponse, str]:
        """The response and the outcome name to count it under."""
        if self.down:
            _abort(request)
            raise _Dropped("down")
        fault = choose_fault(self.faults, self._rng, request.content_length)
        if fault is Fault.TOO_LARGE:
            return _error(413, "M_TOO_LARGE", "Request body too large"), "413"
        if fault is Fault.RESET:
            await request.content.read(512)
            _abort(request)
            raise _Dropped("reset")
        if fault is Fault.ERROR:
            return _error(500, "M_UNKNOWN", "Internal server error"), "500"
        if fault is Fault.HANG:
            await self._sleep_unless_stopping(self.faults.hang_s)
            _abort(request)
            raise _Dropped("hang")

        raw = await request.read()
        self.record.bytes_received += len(raw)
        limit = self.faults.max_body_bytes
        if limit is not None and len(raw) > limit:
            return _error(413, "M_TOO_LARGE", "Request body too large"), "413"
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return _error(400, "M_NOT_JSON", "Content not JSON."), "400"
        try:
            origin = verify_request(
                authorization=request.headers.getall("Authorization", []),
                method=request.method,
                uri=request.raw_path,
                our_server_name=self.server_name,
                content=body,
                lookup_key=self._lookup_key,
            )
        except AuthenticationError as e:
            return _error(401, "M_UNAUTHORIZED", e.message), "401"

        status, answer = await self._transaction(
            origin, request.match_info["txn_id"], body, len(raw)
        )

        if status == 200 and fault is Fault.RESET_AFTER:
            payload = json.dumps(answer).encode()
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            resp.content_length = len(payload)
            await resp.prepare(request)
            await resp.write(payload[: len(payload) // 2])
            _abort(request)
            raise _Dropped("reset_after")
        if status == 200 and fault is Fault.GARBAGE:
            return web.Response(status=200, text="<html>502 Bad Gateway</html>"), "garbage"
        return web.json_response(answer, status=status), str(status)

    async def _transaction(
        self, origin: str, txn_id: str, body: Any, body_bytes: int
    ) -> tuple[int, dict[str, Any]]:
        key = (origin, txn_id)
        if key in self._answered:
            self.record.retransmits += 1
            return self._answered[key]
        pending = self._in_progress.get(key)
        if pending is not None:
            self.record.retransmits += 1
            return await asyncio.shield(pending)
        if not isinstance(body, dict):
            return 400, {"errcode": "M_BAD_JSON", "error": "Transaction is not an object"}
        pdus = body.get("pdus", [])
        edus = body.get("edus", [])
        if not isinstance(pdus, list) or not isinstance(edus, list):
            return 400, {"errcode": "M_BAD_JSON", "error": "pdus and edus must be lists"}
        if len(pdus) > MAX_PDUS or len(edus) > MAX_EDUS:
            return 400, {}
        if body.get("origin", origin) != origin:
            return 400, {"errcode": "M_FORBIDDEN", "error": "origin does not match the signer"}
        active = self._active.get(origin)
        if active is not None:
            return 429, {"errcode": "M_UNKNOWN", "error": "Too many concurrent transactions"}
        self._active[origin] = txn_id
        fut: asyncio.Future[tuple[int, dict[str, Any]]] = asyncio.get_running_loop().create_future()
        self._in_progress[key] = fut
        try:
            if self.faults.slow_s:
                await self._sleep_unless_stopping(self.faults.slow_s)
            result = 200, self._process(origin, txn_id, pdus, edus, body_bytes)
            self._answered[key] = result
            fut.set_result(result)
            return result
        finally:
            del self._active[origin]
            del self._in_progress[key]
            if not fut.done():
                fut.cancel()

    def _process(
        self, origin: str, txn_id: str, pdus: list[Any], edus: list[Any], body_bytes: int
    ) -> dict[str, Any]:
        answers: dict[str, Any] = {}
        event_ids: list[str] = []
        for pdu in pdus:
            if not isinstance(pdu, dict):
                continue
            event_id = reference_event_id(pdu)
            event_ids.append(event_id)
            self.record.pdu_counts[event_id] += 1
            self.record.pdu_rooms[event_id] = str(pdu.get("room_id"))
            answers[event_id] = {}
        edu_types: list[str] = []
        for edu in edus:
            if isinstance(edu, dict):
                self.record.edus.append(edu)
                edu_types.append(str(edu.get("edu_type")))
        self.record.txns.append(
            ReceivedTxn(
                txn_id,
                origin,
                self._clock.time_s(),
                tuple(event_ids),
                tuple(edu_types),
                body_bytes,
            )
        )
        return {"pdus": answers}
