"""A minimal real :class:`TransactionSender`: PUTs unsigned JSON to loopback fake
homeservers, for the queue tests and benchmarks that need neither signatures nor
discovery (the worker sends with :class:`federation_sender.transport.client.FederationClient`).

``urls`` maps a destination to a base URL (or one base URL serves every destination,
told apart by the ``Host`` header). Every attempt has a timeout; responses and failures
are classified by the real client's own functions (``transport/classify.py``), so the
queue tests that use this sender exercise the real classification.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp.payload import BytesPayload
from yarl import URL

from federation_sender.clock import Clock, time_ms
from federation_sender.transport.classify import classify_exception, classify_response
from federation_sender.transport.result import Outcome, SendResult, Transaction

_COMPACT = json.JSONEncoder(separators=(",", ":"))


class HttpTransactionSender:
    def __init__(
        self,
        urls: Mapping[str, str] | Callable[[str], str] | str,
        origin: str,
        clock: Clock,
        *,
        timeout_s: float = 30.0,
        connection_limit: int = 1000,
    ) -> None:
        if isinstance(urls, str):
            base = urls
            self._url: Callable[[str], str] = lambda _d: base
        elif isinstance(urls, Mapping):
            mapping = dict(urls)
            self._url = mapping.__getitem__
        else:
            self._url = urls
        self.origin = origin
        self._head = b'{"origin":' + _COMPACT.encode(origin).encode() + b',"origin_server_ts":'
        self.clock = clock
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._limit = connection_limit
        self._session: aiohttp.ClientSession | None = None
        self._pdu_cache: dict[int, tuple[dict[str, Any], bytes]] = {}
        self._pdu_cache_size = 50_000
        self._bases: dict[str, URL] = {}
        self.on_success: Callable[[Transaction], None] | None = None
        """Called with every transaction answered 200 (benchmarks count them)."""
        self.sent = 0

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit, limit_per_host=0),
                timeout=self.timeout,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @staticmethod
    def body(origin: str, ts_ms: int, txn: Transaction) -> bytes:
        return json.dumps(
            {
                "origin": origin,
                "origin_server_ts": ts_ms,
                "pdus": list(txn.pdus),
                "edus": list(txn.edus),
            },
            separators=(",", ":"),
        ).encode()

    def _pdu_bytes(self, pdu: dict[str, Any]) -> bytes:
        # The queue engine shares one PDU object between every destination's
        # transactions: serialise it once, not once per destination.
        k = id(pdu)
        hit = self._pdu_cache.get(k)
        if hit is not None and hit[0] is pdu:
            return hit[1]
        b = _COMPACT.encode(pdu).encode()
        self._pdu_cache[k] = (pdu, b)
        if len(self._pdu_cache) > self._pdu_cache_size:
            del self._pdu_cache[next(iter(self._pdu_cache))]
        return b

    def encode(self, ts_ms: int, txn: Transaction) -> bytes:
        """The same bytes as :meth:`body`, assembled from cached PDU encodings."""
        # Per transaction only the timestamp and the EDUs are serialised; the envelope's
        # fixed part is encoded once (json.dumps with separators builds an encoder per
        # call, which cost more than the PDUs' cache lookups).
        cache = self._pdu_cache
        parts = []
        for p in txn.pdus:
            hit = cache.get(id(p))
            parts.append(hit[1] if hit is not None and hit[0] is p else self._pdu_bytes(p))
        edus = _COMPACT.encode(list(txn.edus)).encode() if txn.edus else b"[]"
        return b"".join(
            (
                self._head,
                str(ts_ms).encode(),
                b',"pdus":[',
                b",".join(parts),
                b'],"edus":',
                edus,
                b"}",
            )
        )

    def _request_url(self, destination: str, txn_id: str) -> URL:
        # Parsed once per base URL; per request only the path is added (as the real
        # client builds its URLs), not a whole URL string parsed again.
        base_s = self._url(destination)
        base = self._bases.get(base_s)
        if base is None:
            base = self._bases[base_s] = URL(base_s)
        return base.with_path(
            f"{base.raw_path.rstrip('/')}/_matrix/federation/v1/send/{quote(txn_id, safe='')}",
            encoded=True,
        )

    async def send_transaction(self, txn: Transaction) -> SendResult:
        body = self.encode(time_ms(self.clock), txn)
        url = self._request_url(txn.destination, txn.txn_id)
        t0 = self.clock.monotonic_s()
        self.sent += 1
        try:
            async with self._get_session().put(
                url,
                data=BytesPayload(body, content_type="application/json"),
                headers={"Host": txn.destination, "X-Destination": txn.destination},
            ) as resp:
                payload = await resp.read()
                result = classify_response(resp.status, resp.headers, payload)
        except (TimeoutError, asyncio.TimeoutError, aiohttp.ClientError) as e:  # noqa: UP041
            result = classify_exception(e)
        if result.outcome is Outcome.SUCCESS and self.on_success is not None:
            self.on_success(txn)
        return dataclasses.replace(
            result, request_bytes=len(body), duration_s=self.clock.monotonic_s() - t0
        )

    async def server_answers(self, destination: str) -> bool:
        """As the real client's: ``GET /_matrix/federation/v1/version`` answered with a
        status below 500 (:class:`~federation_sender.transport.result.ServerProbe`)."""
        base = URL(self._url(destination))
        url = base.with_path(f"{base.raw_path.rstrip('/')}/_matrix/federation/v1/version",
                             encoded=True)
        try:
            async with self._get_session().get(
                url, headers={"Host": destination, "X-Destination": destination},
            ) as resp:
                await resp.read()
                return resp.status < 500
        except (TimeoutError, asyncio.TimeoutError, aiohttp.ClientError):  # noqa: UP041
            return False
