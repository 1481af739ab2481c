"""The transport floor: what one transaction costs in Python with no HTTP client at all
(issue #46.1). ``bench/txn_cost.py`` runs it beside the production path and the signed
aiohttp loop, interleaved, and prints the production path's ratio to it.

Per transaction this does only what a correct sender must, inside the clock:

* canonical JSON of the transaction's content (``transport.encoding.canonical_json``:
  orjson, sorted keys);
* an ed25519 signature over the canonical request object (``sign_request_bytes``:
  PyNaCl), as the ``Authorization: X-Matrix`` header;
* one HTTP/1.1 ``PUT`` written on a kept-alive connection (TLS when the receivers serve
  it, verified against their CA) through ``bench/http_floor.py``'s bare
  :class:`asyncio.Protocol` (``Exchange``);
* the response read back to its end (status line, ``Content-Length`` body), so the
  connection can carry the next one.

No pooling, retries, deadlines, discovery, logging, metrics or spans: one connection per
destination, opened before the clock, one request in flight on each. The receivers are
``bench/common.py``'s, in another process. Run alone it prints CPU per transaction:

    .venv/bin/python bench/transport_floor.py [--dests 415] [--txns 20] [--tls]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ssl
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from common import GC, ME, dest_name, loopback_tls, receivers, url_for
from http_floor import Exchange, authorization

from federation_sender.testing.certs import CertFiles
from federation_sender.transport.encoding import canonical_json
from federation_sender.transport.result import Transaction


def request(dest: str, txn_id: str, content: dict[str, object]) -> bytes:
    """One transaction's whole request: canonical JSON and the signature."""
    body = canonical_json(content)
    path = f"/_matrix/federation/v1/send/raw{txn_id}"
    head = (f"PUT {path} HTTP/1.1\r\nHost: {dest}\r\n"
            f"Authorization: {authorization(dest, path, body)}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode("ascii") + body


async def raw_waves(txns: Sequence[Transaction], url: object, n: int,
                    tls: CertFiles | None = None, gap_s: float = 0.0) -> tuple[float, float]:
    """``txns`` in waves of ``n`` (one per destination; the production run's order),
    each wave's transactions concurrently, the next wave when all answered. Returns
    wall and CPU seconds of the clocked part (encoding and signing included)."""
    loop = asyncio.get_running_loop()
    ctx = None if tls is None else ssl.create_default_context(cafile=str(tls.ca_cert))
    dests = sorted({t.destination for t in txns})
    conns: dict[str, Exchange] = {}
    for d in dests:
        parts = urlsplit(url(d))  # type: ignore[operator]
        _, proto = await loop.create_connection(
            Exchange, parts.hostname, parts.port, ssl=ctx,
            server_hostname=parts.hostname if ctx is not None else None)
        conns[d] = proto
    try:
        warm = {"origin": ME, "origin_server_ts": 0, "pdus": [], "edus": []}
        await asyncio.gather(*(conns[d].put(request(d, f"warm{d}", warm)) for d in dests))
        GC.settle()

        async def send(t: Transaction) -> None:
            status = await conns[t.destination].put(request(t.destination, t.txn_id, {
                "origin": ME, "origin_server_ts": int(time.time() * 1000),
                "pdus": list(t.pdus), "edus": list(t.edus)}))
            assert status == 200, status

        t0, c0 = time.perf_counter(), time.process_time()
        waves = [txns[i:i + n] for i in range(0, len(txns), n)]
        for k, wave in enumerate(waves, 1):
            await asyncio.gather(*(send(t) for t in wave))
            if gap_s and k < len(waves):
                await asyncio.sleep(gap_s)
        GC.end()
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        for c in conns.values():
            if c.transport is not None:
                c.transport.close()


@contextlib.contextmanager
def _tls(enabled: bool, n: int) -> Iterator[CertFiles | None]:
    if not enabled:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="transport-floor-") as d:
        yield loopback_tls(Path(d), n)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dests", type=int, default=415)
    ap.add_argument("--txns", type=int, default=20, help="waves (transactions per destination)")
    ap.add_argument("--tls", action="store_true")
    a = ap.parse_args()
    pdu = {"type": "m.room.message", "room_id": "!r:" + ME, "sender": "@a:" + ME,
           "content": {"body": "x" * 40}, "origin_server_ts": 0, "depth": 1}
    txns = [Transaction(dest_name(i), f"{w}-{i}", (pdu,), ())  # type: ignore[arg-type]
            for w in range(a.txns) for i in range(a.dests)]
    with _tls(a.tls, a.dests) as tls, receivers(1, tls) as urls:
        wall, cpu = await raw_waves(txns, url_for(urls), a.dests, tls)
    print(f"raw transport floor: {1000 * cpu / len(txns):.3f} ms CPU per txn, "
          f"{len(txns) / wall:.0f} txn/s ({len(txns)} txns, {a.dests} destinations, "
          f"{'TLS' if a.tls else 'plain HTTP'})")


if __name__ == "__main__":
    asyncio.run(main())
