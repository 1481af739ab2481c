"""Fake remote homeservers on loopback that join Synapse's rooms over federation.

Theory of operation
-------------------
A :class:`PeerNetwork` runs any number of :class:`FederationPeer` servers on one
event loop in a background thread, so they outlive individual tests (and their event
loops) and serve a module's rooms throughout. Its API is blocking and thread-safe;
async tests call it through ``asyncio.to_thread``.

Each peer is a real homeserver as far as the wire goes: it is named
``localhost:<port>``, serves HTTPS with a certificate from the test CA (Synapse
trusts that CA through ``federation_custom_ca_list``), publishes its ed25519 key at
``/_matrix/key/v2/server`` and signs every request it makes with the X-Matrix scheme
(:mod:`federation_sender.transport.signing`). :meth:`PeerNetwork.join` joins a room
as Synapse's own remote servers do: ``make_join`` for a template, a content hash and
signature under the room version's redaction rules, ``send_join`` (v2).

A peer answers ``make_leave`` and ``send_leave`` for the rooms given a template in
``peer.leave_templates`` (a local user rejecting its invite: Synapse then stores the
leave as an out-of-band membership), and 404 for others.

A peer verifies the X-Matrix signature of every ``/send`` against the origin's key,
fetched over HTTPS from the origin's server name, and answers 401 when it does not
verify: it accepts only what a real server would. Accepted transactions are recorded
once per ``(origin, txn_id)`` (a retried id is counted, not recorded twice, as
Synapse deduplicates), with the event id of each PDU computed from its reference
hash. Tests wait on :meth:`PeerNetwork.wait_for` with a predicate over what was
recorded; every recording wakes the waiters, so nothing sleeps.

``peer.send_status`` makes a peer refuse transactions (for backoff scenarios);
:meth:`PeerNetwork.send_transaction` sends one signed transaction to a server (for
instance to main, which is how a destination that came back "contacts main").
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from canonicaljson import encode_canonical_json
from yarl import URL

from federation_sender.clock import SystemClock, time_ms
from federation_sender.testing.certs import CertFiles, LoopbackCA
from federation_sender.testing.peer_records import (
    FederationPeer,
    JoinedRoom,
    PeerRequestError,
    ReceivedTransaction,
)
from federation_sender.testing.peer_rooms import ROOM_VERSION as HOSTED_ROOM_VERSION
from federation_sender.testing.peer_rooms import HostedRoom
from federation_sender.testing.signed_events import SUPPORTED_ROOM_VERSIONS, event_id, hash_and_sign
from federation_sender.transport.keyserver import (
    SERVER_KEYS_PATH,
    add_key_routes,
    parse_server_keys,
)
from federation_sender.transport.signing import (
    AuthenticationError,
    SigningKey,
    parse_x_matrix,
    sign_request,
    verify_request,
)

__all__ = [
    "FederationPeer",
    "JoinedRoom",
    "PeerNetwork",
    "PeerRequestError",
    "ReceivedTransaction",
]

T = TypeVar("T")
REQUEST_TIMEOUT_S = 30.0
DEFAULT_WAIT_S = 30.0


class PeerNetwork:
    """Peers on a background event loop; see the module docstring."""

    def __init__(
        self,
        ca: LoopbackCA,
        directory: Path,
        *,
        reuse_event_ids: bool = False,
        keep_pdus: bool = True,
    ) -> None:
        """``reuse_event_ids``: an event id, once computed, is reused for a PDU of the
        same room with the same content hash, origin_server_ts and prev_events, rather
        than computed again for every peer that receives it. ``keep_pdus=False``: a
        recorded transaction keeps its event ids, EDUs and arrival time but not the PDU
        bodies (``pdus`` is empty; a million deliveries would hold gigabytes). Both for
        benchmarks with hundreds of peers in this one thread; tests keep the defaults."""
        self._certs: CertFiles = ca.issue(directory, ["localhost", "127.0.0.1", "::1"])
        self._client_ssl = ssl.create_default_context(cafile=str(ca.cert_path))
        self._clock = SystemClock()
        self._cond = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="peers", daemon=True)
        self._runners: list[web.AppRunner] = []
        self._session: aiohttp.ClientSession | None = None
        self._keys: dict[str, dict[str, Any]] = {}
        self._room_versions: dict[str, str] = {}
        self._reuse_event_ids = reuse_event_ids
        self._keep_pdus = keep_pdus
        self._event_ids: dict[tuple[str, ...], str] = {}
        self.peers: list[FederationPeer] = []

    # -- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> PeerNetwork:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self._run(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 2 * REQUEST_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # -- peers --------------------------------------------------------------------------
    def add_peer(self) -> FederationPeer:
        """A new peer, listening before this returns."""
        return self._run(self._add_peer())

    def add_peers(self, n: int) -> list[FederationPeer]:
        return [self.add_peer() for _ in range(n)]

    async def _add_peer(self) -> FederationPeer:
        sockets = _bind_loopback()
        port = sockets[0].getsockname()[1]
        peer = FederationPeer(f"localhost:{port}", SigningKey.generate(), sockets)
        app = web.Application()
        add_key_routes(app, server_name=peer.server_name, signing_key=peer.key, clock=self._clock)
        app.router.add_put(
            "/_matrix/federation/v1/send/{txn_id}", self._handler(peer, self._on_send)
        )
        app.router.add_get(
            "/_matrix/federation/v1/user/devices/{user_id}", self._handler(peer, self._on_devices)
        )
        app.router.add_get(
            "/_matrix/federation/v1/make_join/{room_id}/{user_id}",
            self._handler(peer, self._on_make_join),
        )
        app.router.add_put(
            "/_matrix/federation/v2/send_join/{room_id}/{event_id}",
            self._handler(peer, self._on_send_join),
        )
        app.router.add_get(
            "/_matrix/federation/v1/make_leave/{room_id}/{user_id}",
            self._handler(peer, self._on_make_leave),
        )
        app.router.add_put(
            "/_matrix/federation/v2/send_leave/{room_id}/{event_id}",
            self._handler(peer, self._on_send_leave),
        )
        app.router.add_get("/_matrix/federation/v1/version", _on_version)
        app.router.add_route("*", "/{tail:.*}", self._handler(peer, self._on_other))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for sock in sockets:
            await web.SockSite(runner, sock, ssl_context=self._certs.server_context()).start()
        self._runners.append(runner)
        with self._cond:
            self.peers.append(peer)
        return peer

    def _handler(
        self,
        peer: FederationPeer,
        fn: Callable[[FederationPeer, web.Request], Coroutine[Any, Any, web.Response]],
    ) -> Callable[[web.Request], Coroutine[Any, Any, web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            return await fn(peer, request)

        return handle

    # -- waiting ------------------------------------------------------------------------
    def wait_for(
        self, predicate: Callable[[], bool], timeout_s: float = DEFAULT_WAIT_S, what: str = ""
    ) -> None:
        """Block until ``predicate()`` holds (checked on every recording)."""
        with self._cond:
            if not self._cond.wait_for(predicate, timeout_s):
                raise TimeoutError(f"not within {timeout_s:.0f} s: {what or predicate}")

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the lock the peers' records are written under (to read them at rest)."""
        with self._cond:
            yield

    def _record(self, update: Callable[[], object]) -> None:
        with self._cond:
            update()
            self._cond.notify_all()

    # -- inbound ------------------------------------------------------------------------
    async def _on_send(self, peer: FederationPeer, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            origin = await self._authenticate(peer, request, body)
        except AuthenticationError as e:
            reason = str(e)
            self._record(lambda: peer.rejected.append(reason))
            return web.json_response({"errcode": "M_UNAUTHORIZED", "error": reason}, status=401)
        if peer.send_status != 200:
            self._record(
                lambda: setattr(peer, "refused_transactions", peer.refused_transactions + 1)
            )
            return web.json_response(
                {"errcode": "M_UNKNOWN", "error": "refused"}, status=peer.send_status
            )
        txn_id = request.match_info["txn_id"]
        pdus = tuple(body.get("pdus", ()))
        ids = tuple(self._event_id(p) for p in pdus)
        txn = ReceivedTransaction(
            origin, txn_id, pdus if self._keep_pdus else (), tuple(body.get("edus", ())), ids,
            self._clock.monotonic_s(),
        )

        self._record(lambda: peer.record_transaction(txn))
        return web.json_response({"pdus": {eid: {} for eid in ids}})

    def _event_id(self, pdu: dict[str, Any]) -> str:
        room_id = str(pdu.get("room_id"))
        version = self._room_versions.get(room_id, "12")
        if not self._reuse_event_ids:
            return event_id(pdu, version)
        hashes = pdu.get("hashes")
        key = (room_id, str(hashes.get("sha256") if isinstance(hashes, dict) else None),
               str(pdu.get("origin_server_ts")), str(pdu.get("prev_events")))
        eid = self._event_ids.get(key)
        if eid is None:
            if len(self._event_ids) >= 200_000:
                self._event_ids.clear()
            eid = self._event_ids[key] = event_id(pdu, version)
        return eid

    def host_room(
        self,
        peer: FederationPeer,
        extra_servers: Sequence[str] = (),
        members: Sequence[FederationPeer] = (),
    ) -> str:
        """Create a room on ``peer``; Synapse's users join it over federation. A joiner
        that omits members is told ``extra_servers`` are in the room too; a user of each
        of ``members`` joins first, kept in that answer but its server not named."""
        now = time_ms(self._clock)
        room = HostedRoom.create(peer.server_name, peer.key, now, list(extra_servers))
        for m in members:
            room.add_member(m.user_id(), m.key, now)
        with self._cond:
            peer.hosted[room.room_id] = room
            self._room_versions[room.room_id] = HOSTED_ROOM_VERSION
        return room.room_id

    async def _on_make_join(self, peer: FederationPeer, request: web.Request) -> web.Response:
        room = peer.hosted.get(request.match_info["room_id"])
        if room is None:
            return web.json_response({"errcode": "M_NOT_FOUND", "error": "no room"}, status=404)
        body = room.make_join(request.match_info["user_id"], time_ms(self._clock))
        return web.json_response(body)

    async def _on_send_join(self, peer: FederationPeer, request: web.Request) -> web.Response:
        room = peer.hosted.get(request.match_info["room_id"])
        if room is None:
            return web.json_response({"errcode": "M_NOT_FOUND", "error": "no room"}, status=404)
        event = await request.json()
        omit = request.query.get("omit_members", "false").lower() == "true"
        with self._cond:
            answer = room.send_join(event, omit_members=omit)
            self._cond.notify_all()
        return web.json_response(answer)

    async def _on_make_leave(self, peer: FederationPeer, request: web.Request) -> web.Response:
        template = peer.leave_templates.get(request.match_info["room_id"])
        if template is None:
            return web.json_response({"errcode": "M_NOT_FOUND", "error": "no room"}, status=404)
        user_id = request.match_info["user_id"]
        version = str(template.get("room_version", "10"))
        event = {
            "type": "m.room.member", "room_id": request.match_info["room_id"],
            "sender": user_id, "state_key": user_id, "content": {"membership": "leave"},
            "origin_server_ts": time_ms(self._clock),
            **{k: v for k, v in template.items() if k != "room_version"},
        }  # fmt: skip
        if version not in ("11", "12"):
            event["origin"] = peer.server_name
        return web.json_response({"room_version": version, "event": event})

    async def _on_send_leave(self, peer: FederationPeer, request: web.Request) -> web.Response:
        if request.match_info["room_id"] not in peer.leave_templates:
            return web.json_response({"errcode": "M_NOT_FOUND", "error": "no room"}, status=404)
        event = await request.json()
        self._record(lambda: peer.leaves.append(event))
        return web.json_response({})

    async def _on_devices(self, peer: FederationPeer, request: web.Request) -> web.Response:
        user_id = request.match_info["user_id"]
        return web.json_response({"user_id": user_id, "stream_id": 0, "devices": []})

    async def _on_other(self, peer: FederationPeer, request: web.Request) -> web.Response:
        line = f"{request.method} {request.raw_path}"
        self._record(lambda: peer.other_requests.append(line))
        return web.json_response({"errcode": "M_UNRECOGNIZED", "error": "not here"}, status=404)

    async def _authenticate(self, peer: FederationPeer, request: web.Request, body: Any) -> str:
        headers = request.headers.getall("Authorization", [])
        auths = [parse_x_matrix(h) for h in headers if h[:8].lower() == "x-matrix"]
        if not auths:
            raise AuthenticationError("missing X-Matrix Authorization header")
        origin = auths[0].origin
        if not any(a.key_id in self._keys.get(origin, {}) for a in auths):
            await self._fetch_keys(origin)
        return verify_request(
            authorization=headers,
            method=request.method,
            uri=request.raw_path,
            our_server_name=peer.server_name,
            content=body,
            lookup_key=lambda o, k: self._keys.get(o, {}).get(k),
        )

    async def _fetch_keys(self, origin: str) -> None:
        try:
            async with self._http().get(
                f"https://{origin}{SERVER_KEYS_PATH}",
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            ) as r:
                doc = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise AuthenticationError(f"cannot fetch keys of {origin}: {e!r}") from None
        self._keys[origin] = parse_server_keys(doc, server_name=origin, now_ms=time_ms(self._clock))

    # -- outbound -----------------------------------------------------------------------
    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._client_ssl)
            )
        return self._session

    async def _request(
        self, peer: FederationPeer, destination: str, method: str, uri: str, content: Any = None
    ) -> Any:
        """A signed federation request; ``uri`` is already percent-encoded."""
        auth = sign_request(
            key=peer.key,
            origin=peer.server_name,
            destination=destination,
            method=method,
            uri=uri,
            content=content,
        )
        headers = {"Authorization": auth}
        data = None
        if content is not None:
            data = encode_canonical_json(content)
            headers["Content-Type"] = "application/json"
        url = URL(f"https://{destination}{uri}", encoded=True)
        async with self._http().request(
            method, url, data=data, headers=headers,
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        ) as r:  # fmt: skip
            text = await r.text()
            if r.status != 200:
                raise PeerRequestError(
                    f"{peer.server_name} {method} {uri}: {r.status} {text[:300]}"
                )
            return await r.json(content_type=None)

    def join(
        self, peer: FederationPeer, room_id: str, via: str, localpart: str = "peer"
    ) -> JoinedRoom:
        """Join ``room_id`` through server ``via`` (make_join, then send_join v2)."""
        return self._run(self._join(peer, room_id, via, peer.user_id(localpart)))

    async def _join(self, peer: FederationPeer, room_id: str, via: str, user_id: str) -> JoinedRoom:
        room = urllib.parse.quote(room_id, safe="")
        user = urllib.parse.quote(user_id, safe="")
        query = urllib.parse.urlencode([("ver", v) for v in SUPPORTED_ROOM_VERSIONS])
        made = await self._request(
            peer, via, "GET", f"/_matrix/federation/v1/make_join/{room}/{user}?{query}"
        )
        version = str(made.get("room_version", "1"))
        template = dict(made["event"])
        template["origin_server_ts"] = time_ms(self._clock)
        if version not in ("11", "12"):
            template["origin"] = peer.server_name
        eid, event = hash_and_sign(template, peer.key, peer.server_name, version)
        with self._cond:
            self._room_versions[room_id] = version
        path = f"/_matrix/federation/v2/send_join/{room}/{urllib.parse.quote(eid, safe='')}"
        answer = await self._request(peer, via, "PUT", path, event)
        joined = JoinedRoom(room_id, version, eid, via, len(answer.get("state", ())))
        self._record(lambda: peer.rooms.__setitem__(room_id, joined))
        return joined

    def sign_event(
        self, peer: FederationPeer, template: dict[str, Any], room_version: str
    ) -> tuple[str, dict[str, Any]]:
        """``(event_id, pdu)``: ``template`` (type, room_id, sender, content, prev_events,
        auth_events, depth, ...) as ``peer`` would send it: ``origin_server_ts`` now,
        ``origin`` before room version 11, content hash and ``peer``'s signature."""
        event = dict(template)
        event["origin_server_ts"] = time_ms(self._clock)
        if room_version not in ("11", "12"):
            event["origin"] = peer.server_name
        with self._cond:
            self._room_versions[str(event.get("room_id"))] = room_version
        return hash_and_sign(event, peer.key, peer.server_name, room_version)

    def invite(
        self,
        peer: FederationPeer,
        destination: str,
        template: dict[str, Any],
        room_version: str,
        invite_room_state: Sequence[dict[str, Any]] = (),
    ) -> str:
        """Invite a user of ``destination`` (``PUT /_matrix/federation/v2/invite``) with
        ``template`` (an ``m.room.member`` invite, signed here as ``peer``); returns the
        event id. The invitee's server signs it and answers 200, or this raises."""
        eid, event = self.sign_event(peer, template, room_version)
        event["unsigned"] = {"invite_room_state": list(invite_room_state)}
        room = urllib.parse.quote(str(template["room_id"]), safe="")
        path = f"/_matrix/federation/v2/invite/{room}/{urllib.parse.quote(eid, safe='')}"
        body = {
            "event": event,
            "room_version": room_version,
            "invite_room_state": list(invite_room_state),
        }
        self._run(self._request(peer, destination, "PUT", path, body))
        return eid

    def send_transaction(
        self,
        peer: FederationPeer,
        destination: str,
        pdus: Iterable[dict[str, Any]] = (),
        edus: Iterable[dict[str, Any]] = (),
        txn_id: str | None = None,
    ) -> dict[str, Any]:
        """PUT one signed transaction to ``destination``; returns its answer."""
        body = {
            "origin": peer.server_name,
            "origin_server_ts": time_ms(self._clock),
            "pdus": list(pdus),
            "edus": list(edus),
        }
        uri = f"/_matrix/federation/v1/send/{txn_id or uuid.uuid4().hex}"
        result: dict[str, Any] = self._run(self._request(peer, destination, "PUT", uri, body))
        return result


async def _on_version(_request: web.Request) -> web.Response:
    return web.json_response({"server": {"name": "federation-sender test peer", "version": "0"}})


def _bind_loopback() -> list[socket.socket]:
    """A listening socket on 127.0.0.1 (free port) and, where possible, ::1 (same port):
    ``localhost`` may resolve to either."""
    v4 = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    v4.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    v4.bind(("127.0.0.1", 0))
    sockets = [v4]
    with contextlib.suppress(OSError):
        v6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        try:
            v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            v6.bind(("::1", v4.getsockname()[1]))
        except OSError:
            v6.close()
            raise
        sockets.append(v6)
    for s in sockets:
        s.listen(128)
        s.setblocking(False)
    return sockets
