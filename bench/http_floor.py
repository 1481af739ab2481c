"""The HTTP exchange's floor: what one signed transaction costs the sender's CPU with
aiohttp's client (the bare loop of ``fanout.py``) and with a minimal HTTP/1.1 exchange
on asyncio's protocol layer (pre-built headers, one keep-alive connection per
destination, a ``Content-Length`` response read in place), side by side in one run.

This measures how much of the fan-out's per-transaction CPU a leaner client could
take away (docs/benchmarks.md, "What is left: the fan-out ratio"). The minimal
exchange is a measuring stick, not a client: it has no TLS, no chunked responses, no
limits, no timeouts, no address policy, and it is never used by the worker.

Both loops send the same pre-encoded bodies (``--pdus`` PDUs of about ``--pdu-bytes``
each), sign every request (X-Matrix over the canonical request object) inside the
clock, keep one request in flight per destination and open their connections before
it. ``--rounds`` alternate the two loops; medians are printed.

    .venv/bin/python bench/http_floor.py [--dests 200] [--txns 20] [--pdus 50] \
        [--pdu-bytes 500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import cast
from urllib.parse import urlsplit

import aiohttp
from common import BENCH_KEY, ME, dest_name, load_average, receivers, report, url_for

from federation_sender.transport.encoding import canonical_json, signing_bytes
from federation_sender.transport.signing import sign_request_bytes

Bodies = dict[str, list[tuple[str, bytes]]]
Put = Callable[[str, str, bytes], Awaitable[None]]


def bodies(dests: int, txns: int, pdus: int, pdu_bytes: int, tag: str) -> Bodies:
    pad = "x" * max(0, pdu_bytes - 200)
    out: Bodies = {}
    for d in range(dests):
        dest = dest_name(d)
        out[dest] = [
            (f"{tag}{d}.{t}", canonical_json({
                "origin": ME, "origin_server_ts": 1, "edus": [],
                "pdus": [{"event_id": f"${tag}{d}.{t}.{i}", "room_id": f"!r:{ME}",
                          "sender": f"@a:{ME}", "type": "m.room.message",
                          "content": {"body": pad}} for i in range(pdus)],
            }))
            for t in range(txns)
        ]
    return out


def authorization(dest: str, path: str, body: bytes) -> str:
    return sign_request_bytes(
        key=BENCH_KEY, origin=ME, destination=dest,
        message=signing_bytes(content=body, destination=dest, method="PUT", origin=ME,
                              uri=path))


class Exchange(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: a request written whole, its response read
    up to ``Content-Length``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport; uvloop's TLS one is not a subclass of asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(buf[:end]).lower() + b"\r\n"
        at = head.find(b"\r\ncontent-length:")
        length = int(head[at + 17:head.index(b"\r\n", at + 2)]) if at >= 0 else 0
        if len(buf) < end + 4 + length:
            return
        status = int(head[9:12])
        del buf[:end + 4 + length]
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(status)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc or ConnectionError("closed"))

    async def put(self, request: bytes) -> int:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.waiter


async def _timed(work: Bodies, put: Put) -> tuple[float, float]:
    async def one_dest(dest: str, items: list[tuple[str, bytes]]) -> None:
        for txn_id, body in items:
            await put(dest, txn_id, body)

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one_dest(d, items) for d, items in work.items()))
    return time.perf_counter() - t0, time.process_time() - c0


async def aiohttp_loop(work: Bodies, url: Callable[[str], str]) -> tuple[float, float]:
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1000, limit_per_host=0)
    ) as session:
        async def put(dest: str, txn_id: str, body: bytes) -> None:
            path = f"/_matrix/federation/v1/send/{txn_id}"
            headers = {"Content-Type": "application/json", "Host": dest,
                       "Authorization": authorization(dest, path, body)}
            async with session.put(f"{url(dest)}{path}", data=body, headers=headers) as r:
                await r.read()
                assert r.status == 200, r.status

        await asyncio.gather(*(put(d, f"warm-a-{d}", b'{"pdus":[],"edus":[]}')
                               for d in work))
        return await _timed(work, put)


async def minimal_loop(work: Bodies, url: Callable[[str], str]) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    conns: dict[str, Exchange] = {}
    for dest in work:
        u = urlsplit(url(dest))
        assert u.hostname is not None and u.port is not None
        _t, conns[dest] = await loop.create_connection(Exchange, u.hostname, u.port)

    async def put(dest: str, txn_id: str, body: bytes) -> None:
        path = f"/_matrix/federation/v1/send/{txn_id}"
        head = (f"PUT {path} HTTP/1.1\r\nHost: {dest}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n"
                f"Authorization: {authorization(dest, path, body)}\r\n\r\n").encode()
        status = await conns[dest].put(head + body)
        assert status == 200, status

    try:
        await asyncio.gather(*(put(d, f"warm-m-{d}", b'{"pdus":[],"edus":[]}')
                               for d in work))
        return await _timed(work, put)
    finally:
        for c in conns.values():
            if c.transport is not None:
                c.transport.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dests", type=int, default=200)
    ap.add_argument("--txns", type=int, default=20, help="transactions per destination")
    ap.add_argument("--pdus", type=int, default=50)
    ap.add_argument("--pdu-bytes", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    load = load_average()
    cpu: dict[str, list[float]] = {"aiohttp": [], "minimal": []}
    rate: dict[str, list[float]] = {"aiohttp": [], "minimal": []}
    n = a.dests * a.txns
    with receivers(1) as urls:
        for r in range(a.rounds):
            order = ["aiohttp", "minimal"] if r % 2 == 0 else ["minimal", "aiohttp"]
            for kind in order:
                work = bodies(a.dests, a.txns, a.pdus, a.pdu_bytes, f"{kind[0]}{r}-")
                run = aiohttp_loop if kind == "aiohttp" else minimal_loop
                wall, c = asyncio.run(run(work, url_for(urls)))
                cpu[kind].append(1000 * c / n)
                rate[kind].append(n / wall)
    size = len(bodies(1, 1, a.pdus, a.pdu_bytes, "s")["r0.bench"][0][1])
    rows = [("load average at start", load),
            ("transactions per loop", f"{n} ({a.dests} destinations, body {size} bytes)")]
    for kind in ("aiohttp", "minimal"):
        rows.append((f"{kind}: txn/s / CPU ms per txn (median of {a.rounds})",
                     f"{statistics.median(rate[kind]):.0f} / "
                     f"{statistics.median(cpu[kind]):.3f}"))
    rows.append(("CPU per txn, minimal / aiohttp",
                 f"{statistics.median(cpu['minimal']) / statistics.median(cpu['aiohttp']):.2f}"))
    report("the HTTP exchange's floor (signed, loopback, no TLS)", rows)


if __name__ == "__main__":
    main()
