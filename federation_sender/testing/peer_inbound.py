"""What each fake remote homeserver of :class:`~.synapse_peer.PeerNetwork` answers.

A peer verifies the X-Matrix signature of every ``/send`` against the origin's key,
fetched over HTTPS from the origin's server name, and answers 401 when it does not
verify. Accepted transactions are recorded once per ``(origin, txn_id)``, with the
event id of each PDU computed from its reference hash; every recording is made under
the network's condition and wakes its waiters. ``make_join``/``send_join`` serve the
rooms a peer hosts, ``make_leave``/``send_leave`` the rooms given a template in
``peer.leave_templates``; anything else is recorded and answered 404.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
from aiohttp import web

from federation_sender.clock import Clock, time_ms
from federation_sender.testing.peer_records import FederationPeer, ReceivedTransaction
from federation_sender.testing.signed_events import event_id
from federation_sender.transport.keyserver import (
    SERVER_KEYS_PATH,
    add_key_routes,
    parse_server_keys,
)
from federation_sender.transport.signing import (
    AuthenticationError,
    parse_x_matrix,
    verify_request,
)

REQUEST_TIMEOUT_S = 30.0

Handler = Callable[[FederationPeer, web.Request], Coroutine[Any, Any, web.Response]]


class PeerInbound:
    """The routes every peer serves, over the records the network shares with them."""

    def __init__(
        self,
        clock: Clock,
        cond: threading.Condition,
        room_versions: dict[str, str],
        http: Callable[[], aiohttp.ClientSession],
        *,
        reuse_event_ids: bool,
        keep_pdus: bool,
    ) -> None:
        """``cond``: the lock the records are written under; ``room_versions``: room id
        -> version, also written by the network as it joins and signs; ``http``: the
        network's client session (to fetch the origins' keys). For ``reuse_event_ids``
        and ``keep_pdus`` see :class:`~.synapse_peer.PeerNetwork`."""
        self._clock = clock
        self._cond = cond
        self._room_versions = room_versions
        self._http = http
        self._keys: dict[str, dict[str, Any]] = {}
        self._reuse_event_ids = reuse_event_ids
        self._keep_pdus = keep_pdus
        self._event_ids: dict[tuple[str, ...], str] = {}

    def application(self, peer: FederationPeer) -> web.Application:
        """``peer``'s routes: its keys, ``/send``, devices, joins, leaves, the rest 404."""
        app = web.Application()
        add_key_routes(app, server_name=peer.server_name, signing_key=peer.key, clock=self._clock)
        routes: list[tuple[str, str, Handler]] = [
            ("PUT", "/_matrix/federation/v1/send/{txn_id}", self._on_send),
            ("GET", "/_matrix/federation/v1/user/devices/{user_id}", self._on_devices),
            ("GET", "/_matrix/federation/v1/make_join/{room_id}/{user_id}", self._on_make_join),
            ("PUT", "/_matrix/federation/v2/send_join/{room_id}/{event_id}", self._on_send_join),
            ("GET", "/_matrix/federation/v1/make_leave/{room_id}/{user_id}", self._on_make_leave),
            ("PUT", "/_matrix/federation/v2/send_leave/{room_id}/{event_id}",
             self._on_send_leave),
        ]  # fmt: skip
        for method, path, fn in routes:
            app.router.add_route(method, path, _bound(peer, fn))
        app.router.add_get("/_matrix/federation/v1/version", _on_version)
        app.router.add_route("*", "/{tail:.*}", _bound(peer, self._on_other))
        return app

    def record(self, update: Callable[[], object]) -> None:
        """Apply ``update`` to the records under the lock, and wake the waiters."""
        with self._cond:
            update()
            self._cond.notify_all()

    async def _on_send(self, peer: FederationPeer, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            origin = await self._authenticate(peer, request, body)
        except AuthenticationError as e:
            reason = str(e)
            self.record(lambda: peer.rejected.append(reason))
            return web.json_response({"errcode": "M_UNAUTHORIZED", "error": reason}, status=401)
        if peer.send_status != 200:
            self.record(
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

        self.record(lambda: peer.record_transaction(txn))
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
        self.record(lambda: peer.leaves.append(event))
        return web.json_response({})

    async def _on_devices(self, peer: FederationPeer, request: web.Request) -> web.Response:
        user_id = request.match_info["user_id"]
        return web.json_response({"user_id": user_id, "stream_id": 0, "devices": []})

    async def _on_other(self, peer: FederationPeer, request: web.Request) -> web.Response:
        line = f"{request.method} {request.raw_path}"
        self.record(lambda: peer.other_requests.append(line))
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


def _bound(
    peer: FederationPeer, fn: Handler
) -> Callable[[web.Request], Coroutine[Any, Any, web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        return await fn(peer, request)

    return handle


async def _on_version(_request: web.Request) -> web.Response:
    return web.json_response({"server": {"name": "federation-sender test peer", "version": "0"}})
