"""The receiving side of a fake remote homeserver, shared by both front-ends.

Theory of operation
-------------------
A :class:`Receiver` answers ``PUT /_matrix/federation/v1/send/{txn_id}`` for any number
of destination names. It does not listen itself: a front-end owns the sockets and says
which destination a request is for.

* :class:`~federation_sender.testing.fake_homeserver.FakeHomeserver`: every destination
  on one port, chosen by the ``Host`` header; unsigned by default; used by the queue
  and worker tests and by the benchmarks at thousands of destinations.
* :class:`~federation_sender.sim.remotes.FakeRemote`: one server name per port (so
  "down" can close a listener), X-Matrix verified; the simulator, the demo, chaos.

A request goes through, in order:

1. random faults from the destination's :class:`~federation_sender.testing.faults.FaultProfile`
   and its seeded ``random.Random``: 413 before reading, reset while reading, 500, hang;
2. the body is read; the scripted :class:`Behaviour` may hang (until :meth:`release`)
   or delay; a body that is not JSON gets 400 ``M_NOT_JSON``;
3. X-Matrix authentication when a ``lookup_key`` was given (401 ``M_UNAUTHORIZED``);
4. the scripted status: 413 above a body size, a status for the next N requests, or a
   refusal of transactions holding given event ids, EDU types or to-device message ids;
5. Synapse's transaction rules: 400 over 50 PDUs or 100 EDUs; a txn id already answered
   for ``(destination, origin)`` gets the same answer without being processed again
   (counted as a retransmit, recorded as a duplicate); with ``one_in_flight`` the same
   id in progress waits for that answer and a different one from a busy origin gets 429;
6. processing (after the profile's ``slow`` delay): each PDU named by ``event_id_of``
   and recorded with every EDU in the destination's :class:`RemoteRecord`;
7. answer faults after processing (cut-off response, garbage body).

With ``record=False`` (the benchmarks) only counts are kept: no per-event recording,
no signature check, nothing per request beyond a JSON parse and a few dict updates.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import struct
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from aiohttp import web

from federation_sender.clock import Clock, SystemClock
from federation_sender.testing.faults import Fault, FaultProfile, choose_fault
from federation_sender.testing.remote_records import Behaviour, ReceivedTxn, RemoteRecord
from federation_sender.transport.signing import (
    AuthenticationError,
    VerifyKeyLookup,
    verify_request,
)

SEND_PREFIX = "/_matrix/federation/v1/send/"
SEND_PATH = SEND_PREFIX + "{txn_id}"
MAX_PDUS = 50
MAX_EDUS = 100
CLIENT_MAX_SIZE = 64 * 1024 * 1024

Answer = tuple[int, dict[str, Any]]
_NO_PDU_RESULTS: dict[str, Any] = {"pdus": {}}


class Dropped(Exception):
    """The connection was reset on purpose; no response. The message is the outcome."""


def abort(request: web.Request) -> None:
    """Reset the connection (RST, not FIN) so the client sees a hard failure."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def error(status: int, errcode: str, message: str) -> web.Response:
    return web.json_response({"errcode": errcode, "error": message}, status=status)


def event_id_field(pdu: dict[str, Any]) -> str:
    return str(pdu.get("event_id"))


class Receiver:
    """The receiving side for many destination names (see the module docstring)."""

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        lookup_key: VerifyKeyLookup | None = None,
        event_id_of: Callable[[dict[str, Any]], str] = event_id_field,
        one_in_flight: bool = False,
        record: bool = True,
    ) -> None:
        self.clock: Clock = clock or SystemClock()
        self.lookup_key = lookup_key
        self.event_id_of = event_id_of
        self.one_in_flight = one_in_flight
        self.record = record
        self.default = Behaviour()
        self.behaviours: dict[str, Behaviour] = {}
        self.faults: dict[str, tuple[FaultProfile, random.Random]] = {}
        self.records: defaultdict[str, RemoteRecord] = defaultdict(RemoteRecord)
        self.attempts: defaultdict[str, list[ReceivedTxn]] = defaultdict(list)
        self.txn_counts: defaultdict[str, int] = defaultdict(int)
        self.pdu_counts: defaultdict[str, int] = defaultdict(int)
        """destination -> PDUs processed (a count, kept even without recording)."""
        self.requests = 0
        self.in_progress = 0
        self.changed = asyncio.Event()
        self._handling: defaultdict[str, int] = defaultdict(int)
        self._answered: dict[tuple[str, str, str], Answer] = {}
        self._pending: dict[tuple[str, str, str], asyncio.Future[Answer]] = {}
        self._active: dict[tuple[str, str], str] = {}
        self._release = asyncio.Event()
        self._closed = False

    # --- control ---------------------------------------------------------------

    def behave(self, destination: str | None = None, **kwargs: Any) -> Behaviour:
        """Replace the behaviour of ``destination`` (or the default) with one built from
        ``kwargs``; ``behave(dest)`` restores normal service."""
        b = Behaviour(**kwargs)
        if destination is None:
            self.default = b
        else:
            self.behaviours[destination] = b
        return b

    def set_faults(self, destination: str, profile: FaultProfile, rng: random.Random) -> None:
        self.faults[destination] = (profile, rng)

    def release(self) -> None:
        """Let hung requests answer (with the then-current behaviour)."""
        self._release.set()
        self._release = asyncio.Event()

    def release_all(self) -> None:
        """Release every hang and delay, now and later (on close)."""
        self._closed = True
        self._release.set()

    async def wait_released(self, seconds: float | None) -> None:
        """Until :meth:`release` or :meth:`release_all`, or ``seconds`` on the clock."""
        if self._closed:
            return
        waiter = asyncio.ensure_future(self._release.wait())
        sleeper = asyncio.ensure_future(
            self.clock.sleep(seconds) if seconds is not None else asyncio.Event().wait()
        )
        try:
            await asyncio.wait({waiter, sleeper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            sleeper.cancel()

    # --- the request -----------------------------------------------------------

    async def receive(self, request: web.Request, destination: str) -> web.StreamResponse:
        """Answer one ``/send`` for ``destination``, counting its outcome."""
        self.requests += 1
        self.in_progress += 1
        self._handling[destination] += 1
        rec = self.records[destination]
        rec.max_concurrent = max(rec.max_concurrent, self._handling[destination])
        try:
            response, outcome = await self._answer(request, destination, rec)
        except Dropped as e:
            rec.outcomes[str(e)] += 1
            return web.Response()
        finally:
            self.in_progress -= 1
            self._handling[destination] -= 1
            self.changed.set()
        rec.outcomes[outcome] += 1
        return response

    async def _answer(
        self, request: web.Request, dest: str, rec: RemoteRecord
    ) -> tuple[web.StreamResponse, str]:
        faulty = self.faults.get(dest)
        fault = Fault.NONE
        if faulty is not None:
            fault = choose_fault(faulty[0], faulty[1], request.content_length)
            early = await self._before_reading(request, fault, faulty[0])
            if early is not None:
                return early
        raw = await request.read()
        b = self.behaviours.get(dest, self.default)
        if b.hang or b.delay_s > 0:
            b = await self._scripted_wait(dest)
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return error(400, "M_NOT_JSON", "Content not JSON."), "400"
        if not isinstance(body, dict):
            return error(400, "M_BAD_JSON", "Transaction is not an object"), "400"
        origin = str(body.get("origin", ""))
        if self.lookup_key is not None:
            try:
                origin = verify_request(
                    authorization=request.headers.getall("Authorization", []),
                    method=request.method,
                    uri=request.raw_path,
                    our_server_name=dest,
                    content=body,
                    lookup_key=self.lookup_key,
                )
            except AuthenticationError as e:
                return error(401, "M_UNAUTHORIZED", e.message), "401"
            if body.get("origin", origin) != origin:
                return error(400, "M_FORBIDDEN", "origin does not match the signer"), "400"
        limit = faulty[0].max_body_bytes if faulty is not None else None
        if limit is not None and len(raw) > limit:
            return error(413, "M_TOO_LARGE", "Request body too large"), "413"
        txn_id = request.match_info["txn_id"]
        status, answer, _ = await self._transaction(dest, origin, txn_id, body, b, raw)
        if status == 200 and fault is Fault.RESET_AFTER:
            await _cut_off(request, answer)
        if status == 200 and fault is Fault.GARBAGE:
            return web.Response(status=200, text="<html>502 Bad Gateway</html>"), "garbage"
        return web.json_response(answer, status=status), str(status)

    async def _before_reading(
        self, request: web.Request, fault: Fault, profile: FaultProfile
    ) -> tuple[web.StreamResponse, str] | None:
        """The answer of a fault that strikes before the body is read (or
        :class:`Dropped`); None: read on."""
        if fault is Fault.TOO_LARGE:
            return error(413, "M_TOO_LARGE", "Request body too large"), "413"
        if fault is Fault.RESET:
            await request.content.read(512)
            abort(request)
            raise Dropped("reset")
        if fault is Fault.ERROR:
            return error(500, "M_UNKNOWN", "Internal server error"), "500"
        if fault is Fault.HANG:
            await self.wait_released(profile.hang_s)
            abort(request)
            raise Dropped("hang")
        return None

    async def _scripted_wait(self, dest: str) -> Behaviour:
        b = self.behaviours.get(dest, self.default)
        if b.hang:
            await self.wait_released(None)
            b = self.behaviours.get(dest, self.default)
        if b.delay_s > 0:
            await self.wait_released(b.delay_s)
        return b

    def _scripted_status(self, dest: str, b: Behaviour, size: int, body: dict[str, Any]) -> int:
        """The status ``b`` answers (counting down ``times``, then normal service)."""
        if b.max_body_bytes is not None and size > b.max_body_bytes:
            return 413
        if b.status != 200:
            if b.times is not None:
                b.times -= 1
                if b.times <= 0:
                    self.behaviours[dest] = b.after_times()
            return b.status
        pdus = body.get("pdus") or ()
        edus = body.get("edus") or ()
        if any(isinstance(p, dict) and p.get("event_id") in b.reject_event_ids for p in pdus):
            return b.reject_status
        for e in edus:
            if isinstance(e, dict) and (
                e.get("edu_type") in b.reject_edu_types
                or (e.get("content") or {}).get("message_id") in b.reject_message_ids
            ):
                return b.reject_status
        return 200

    async def _transaction(
        self, dest: str, origin: str, txn_id: str, body: dict[str, Any], b: Behaviour, raw: bytes
    ) -> tuple[int, dict[str, Any], bool]:
        """Status, answer and whether it was a retransmit of an answered txn id."""
        status = 200 if b.plain else self._scripted_status(dest, b, len(raw), body)
        if status != 200:
            self._attempt(dest, txn_id, origin, body, len(raw), status)
            return status, {"errcode": "M_UNKNOWN", "error": f"fake {status}"}, False
        key = (dest, origin, txn_id)
        cached = self._answered.get(key)
        pending = self._pending.get(key)
        if cached is not None or pending is not None:
            self.records[dest].retransmits += 1
        if cached is None and pending is not None:
            cached = await asyncio.shield(pending)
        if cached is not None:
            self._attempt(dest, txn_id, origin, body, len(raw), cached[0], duplicate=True)
            return cached[0], cached[1], True
        pdus, edus = body.get("pdus", []), body.get("edus", [])
        if not isinstance(pdus, list) or not isinstance(edus, list):
            return 400, {"errcode": "M_BAD_JSON", "error": "pdus and edus must be lists"}, False
        if len(pdus) > MAX_PDUS or len(edus) > MAX_EDUS:
            return 400, {}, False
        if self.one_in_flight and (dest, origin) in self._active:
            return 429, {"errcode": "M_UNKNOWN", "error": "Too many concurrent transactions"}, False
        faulty = self.faults.get(dest)
        if faulty is None or not faulty[0].slow_s:
            # Processing does not await: nothing can overlap it, no window to guard.
            answer = self._process(key, pdus, edus, len(raw))
            self._answered[key] = (200, answer)
            return 200, answer, False
        return 200, await self._run(key, faulty[0].slow_s, pdus, edus, len(raw)), False

    async def _run(
        self,
        key: tuple[str, str, str],
        slow_s: float,
        pdus: list[Any],
        edus: list[Any],
        body_bytes: int,
    ) -> dict[str, Any]:
        """Process a new transaction after ``slow_s``, inside its "in progress" window."""
        dest, origin, _ = key
        self._active[(dest, origin)] = key[2]
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._pending[key] = fut
        try:
            await self.wait_released(slow_s)
            answer = self._process(key, pdus, edus, body_bytes)
            self._answered[key] = (200, answer)
            fut.set_result((200, answer))
            return answer
        finally:
            del self._active[(dest, origin)]
            del self._pending[key]
            if not fut.done():
                fut.cancel()

    def _process(
        self, key: tuple[str, str, str], pdus: list[Any], edus: list[Any], body_bytes: int
    ) -> dict[str, Any]:
        dest, origin, txn_id = key
        self.txn_counts[dest] += 1
        self.pdu_counts[dest] += len(pdus)
        if not self.record:
            return _NO_PDU_RESULTS  # the benchmarks' receiver: as little work as can be
        good = [p for p in pdus if isinstance(p, dict)]
        ids = [self.event_id_of(p) for p in good]
        rec = self.records[dest]
        for pdu, event_id in zip(good, ids, strict=True):
            rec.pdu_counts[event_id] += 1
            rec.pdu_rooms[event_id] = str(pdu.get("room_id"))
        good_edus = [e for e in edus if isinstance(e, dict)]
        rec.edus.extend(good_edus)
        txn = ReceivedTxn(
            dest,
            txn_id,
            origin,
            good,
            good_edus,
            body_bytes,
            200,
            received_ts_s=self.clock.time_s(),
            pdu_event_ids=tuple(ids),
        )
        rec.txns.append(txn)
        self.attempts[dest].append(txn)
        return {"pdus": {event_id: {} for event_id in ids}}

    def _attempt(
        self,
        dest: str,
        txn_id: str,
        origin: str,
        body: dict[str, Any],
        body_bytes: int,
        status: int,
        duplicate: bool = False,
    ) -> None:
        """Record an attempt that was not processed (refused, or a retransmit)."""
        if not self.record:
            return
        pdus = [p for p in body.get("pdus") or () if isinstance(p, dict)]
        edus = [e for e in body.get("edus") or () if isinstance(e, dict)]
        ids = tuple(self.event_id_of(p) for p in pdus)
        self.attempts[dest].append(
            ReceivedTxn(
                dest,
                txn_id,
                origin,
                pdus,
                edus,
                body_bytes,
                status,
                duplicate,
                self.clock.time_s(),
                ids,
            )
        )


async def _cut_off(request: web.Request, answer: dict[str, Any]) -> None:
    """Send half of a 200 answer, then reset: the remote has the transaction, the
    sender does not know it."""
    payload = json.dumps(answer).encode()
    resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
    resp.content_length = len(payload)
    await resp.prepare(request)
    await resp.write(payload[: len(payload) // 2])
    abort(request)
    raise Dropped("reset_after")
