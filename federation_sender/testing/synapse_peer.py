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
verify: it accepts only what a real server would (the routes a peer serves are
:mod:`.peer_inbound`'s). Accepted transactions are recorded
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
from federation_sender.testing.peer_inbound import REQUEST_TIMEOUT_S, PeerInbound
from federation_sender.testing.peer_records import (
    FederationPeer,
    JoinedRoom,
    PeerRequestError,
    ReceivedTransaction,
)
from federation_sender.testing.peer_rooms import ROOM_VERSION as HOSTED_ROOM_VERSION
from federation_sender.testing.peer_rooms import HostedRoom
from federation_sender.testing.signed_events import SUPPORTED_ROOM_VERSIONS, hash_and_sign
from federation_sender.transport.signing import SigningKey, sign_request

__all__ = [
    "FederationPeer",
    "JoinedRoom",
    "PeerNetwork",
    "PeerRequestError",
    "ReceivedTransaction",
]

T = TypeVar("T")
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
        self._room_versions: dict[str, str] = {}
        self._inbound = PeerInbound(
            self._clock, self._cond, self._room_versions, self._http,
            reuse_event_ids=reuse_event_ids, keep_pdus=keep_pdus,
        )  # fmt: skip
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
            server = runner.server
            open_ = [h.transport for h in server.connections] if server is not None else []
            await runner.cleanup()
            # cleanup() closes each TLS connection by asking the peer (Synapse) to
            # confirm, and our loop closes right after: abort what is still open rather
            # than leave its socket to the garbage collector.
            for transport in open_:
                if transport is not None:
                    transport.abort()
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
        runner = web.AppRunner(self._inbound.application(peer), access_log=None)
        await runner.setup()
        for sock in sockets:
            await web.SockSite(runner, sock, ssl_context=self._certs.server_context()).start()
        self._runners.append(runner)
        with self._cond:
            self.peers.append(peer)
        return peer

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
        self._inbound.record(lambda: peer.rooms.__setitem__(room_id, joined))
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
