"""A/B of runtime choices, each pair measured interleaved in one run (A B B A ...), so
the load of other jobs on the machine falls on both alike.

``encoders``: canonical JSON and request preparation, per call, on Synapse-shaped PDUs
(prev/auth events, hashes, signatures, unicode bodies):

* one PDU: ``canonicaljson.encode_canonical_json`` against the checked orjson path
  (``transport.encoding.canonical_json``: one type walk, then orjson);
* one transaction of 50 PDUs to one of 200 destinations sharing them, as the client
  prepared it before (the body encoded by ``encode_canonical_json``, then the request
  object encoded again inside ``signedjson.sign_json`` and signed) against now
  (``RequestBuilder.prepare``: PDU encodings shared, body assembled, signed over the
  same bytes); and the ed25519 signature alone over such a body, the floor.

``signing``: the event loop thread's CPU per signature at body sizes from 2 to 42 KB,
signed inline against handed to a signing thread (``run_in_executor``, 50 concurrent
tasks). OpenSSL signs without the GIL, and the loop thread's own CPU falls above 8 KB;
but handing bodies of 8 KB or more to a signing thread inside the engine made the spike
slower (32.6-32.9 s against 29.6-29.9 s, process CPU 32.4-32.7 s against 26.9-27.0 s,
alternating runs): the hand-overs' thread switches cost more than the signatures, so
the worker signs inline. Kept to show why.

``signers``: one ed25519 signature by libsodium (PyNaCl's ``crypto_sign``) against
OpenSSL (``cryptography``) at sizes from a request without a body (GET) to 42 KB:
``SigningKey.sign_bytes`` takes libsodium below ``LIBSODIUM_BELOW_BYTES`` (its fixed
cost is lower), OpenSSL above (its SHA-512 is faster). The third figure is
``SigningKey.sign_split`` with a head shared by many messages (all but a 100-byte tail:
``RequestBuilder``'s transactions of one content to many destinations), where only the
tail is hashed for the nonce.

``shared``: ``RequestBuilder.prepare`` (body, request object, signature, header) for
one content of 50 PDUs sent to ``--dests`` destinations, as a big room's drain sends
it, with contents shared (the default) against ``share_contents_ms=0`` (each built and
signed whole), interleaved; and at 1 and 11 PDUs (light load and the spike's mean),
which are below the sharing threshold and must not change.

``loop``: the fan-out engine phase (``fanout.py``, production sender) with the default
asyncio event loop against uvloop, both for the sender's process (receivers unchanged),
with a fresh database per run.

    .venv/bin/python bench/runtime_ab.py [encoders] [signing] [signers] [shared] [loop] \
        [--rounds 4] \
        [--dests 200] [--events 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from common import bench_cluster, fresh_db_factory, load_average, receivers, report

from federation_sender.clock import SystemClock
from federation_sender.transport.encoding import canonical_json, stdlib_canonical_json
from federation_sender.transport.prepare import (
    SEND_PATH,
    SHARED_CONTENT_MAX_AGE_MS,
    RequestBuilder,
)
from federation_sender.transport.result import Transaction
from federation_sender.transport.signing import (
    LIBSODIUM_BELOW_BYTES,
    SigningKey,
    sign_request,
)

KEY = SigningKey.generate("a_ab")


def synapse_like_pdu(i: int) -> dict[str, Any]:
    room = "!OGEhHVWSdvArJzumhm:matrix.org"
    return {
        "auth_events": [f"$auth{k}{i % 7}xZ3vQW1c2n9dK8sL0pQ4rT6uY8iO0pA2sD4fG6hJ8k"
                        for k in range(4)],
        "content": {"body": f"Nachricht {i}: héllo wörld ✓ — 你好 {'x' * (i % 40)}",
                    "msgtype": "m.text", "m.mentions": {}},
        "depth": 123_456 + i,
        "hashes": {"sha256": "o4Zo3Lq8yqT9bQ2rR3j5XQb7mBkRfPZ0n9Hh2zE1ZxQ"},
        "origin": "matrix.org",
        "origin_server_ts": 1_700_000_000_000 + i,
        "prev_events": [f"$prev{i}Ab3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY3zA5bC7dE9"],
        "room_id": room,
        "sender": "@someone:matrix.org",
        "signatures": {"matrix.org": {"ed25519:a_RXGa": "Nf1RdkbZ5B9s0pvJ4kLmZ1Q3vYw8J"
                                      "xL2n4Pq6Rs8Tu0Vw2Xy4Za6Bc8De0Fg2Hi4Jk6Lm8No0Pq2Rs4Tu"
                                      "6Vw8Xy0Za2Bc4De6Fg8Hi0Jk2Lm4No6Pq8Rs0Tu"}},
        "type": "m.room.message",
        "unsigned": {"age_ts": 1_700_000_000_000 + i},
    }


def _per_call_us(fn: Callable[[], Any], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - t0) / calls


def _old_prepare(txn: Transaction, ts: int) -> tuple[bytes, str]:
    """The client before this change: body encoded, then encoded again to sign."""
    content = {"origin": "local.bench", "origin_server_ts": ts, "pdus": list(txn.pdus),
               "edus": list(txn.edus)}
    path = SEND_PATH + txn.txn_id
    auth = sign_request(key=KEY, origin="local.bench", destination=txn.destination,
                        method="PUT", uri=path, content=content)
    return stdlib_canonical_json(content), auth


def encoders(rounds: int) -> None:
    pdus = [synapse_like_pdu(i) for i in range(50)]
    pdu = pdus[7]
    assert canonical_json(pdu) == stdlib_canonical_json(pdu)
    txns = [Transaction(f"r{d}.bench", f"t{d}", pdus, []) for d in range(200)]
    results: dict[str, list[float]] = {k: [] for k in (
        "PDU: canonicaljson", "PDU: checked orjson",
        "txn: before (encode + re-encode to sign)", "txn: now (RequestBuilder.prepare)",
        "txn: ed25519 signature alone, libsodium (PyNaCl)",
        "txn: ed25519 signature alone, OpenSSL (SigningKey.sign_bytes)")}
    body = stdlib_canonical_json({"pdus": pdus})

    def new_round() -> float:
        builder = RequestBuilder(origin="local.bench", key=KEY, clock=SystemClock())
        t0 = time.perf_counter()
        for t in txns:
            builder.prepare(t)
        return 1e6 * (time.perf_counter() - t0) / len(txns)

    def old_round() -> float:
        t0 = time.perf_counter()
        for t in txns:
            _old_prepare(t, 1)
        return 1e6 * (time.perf_counter() - t0) / len(txns)

    for r in range(rounds):
        pair = [("PDU: canonicaljson", lambda: stdlib_canonical_json(pdu)),
                ("PDU: checked orjson", lambda: canonical_json(pdu))]
        for name, fn in (pair if r % 2 == 0 else pair[::-1]):
            results[name].append(_per_call_us(fn, 20_000))
        txn_pair = [("txn: before (encode + re-encode to sign)", old_round),
                    ("txn: now (RequestBuilder.prepare)", new_round)]
        for name, fn2 in (txn_pair if r % 2 == 0 else txn_pair[::-1]):
            results[name].append(fn2())
        sig_pair = [("txn: ed25519 signature alone, libsodium (PyNaCl)",
                     lambda: KEY.raw.sign(body)),
                    ("txn: ed25519 signature alone, OpenSSL (SigningKey.sign_bytes)",
                     lambda: KEY.sign_bytes(body))]
        for name, fn in (sig_pair if r % 2 == 0 else sig_pair[::-1]):
            results[name].append(_per_call_us(fn, 500))
    rows = [("load average (1/5/15 min)", load_average()),
            ("PDU size (canonical JSON)", f"{len(canonical_json(pdu))} bytes"),
            ("transaction body (50 PDUs)", f"{len(body)} bytes")]
    for name, xs in results.items():
        rows.append((f"{name}: median µs (runs)",
                     f"{statistics.median(xs):.1f} ({', '.join(f'{x:.1f}' for x in xs)})"))
    pdu_gain = (statistics.median(results["PDU: canonicaljson"])
                / statistics.median(results["PDU: checked orjson"]))
    txn_gain = (statistics.median(results["txn: before (encode + re-encode to sign)"])
                / statistics.median(results["txn: now (RequestBuilder.prepare)"]))
    rows += [("PDU: canonicaljson / checked orjson", f"{pdu_gain:.2f}x"),
             ("txn: before / now", f"{txn_gain:.2f}x")]
    report(f"encoders ({rounds} interleaved rounds)", rows)


def loop(rounds: int, dests: int, events: int) -> None:
    import fanout
    import uvloop

    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in factories}
    load = load_average()
    with receivers(1) as urls, bench_cluster() as cluster:
        fresh = fresh_db_factory(cluster)
        for r in range(rounds):
            order = list(factories) if r % 2 == 0 else list(factories)[::-1]
            for name in order:
                with asyncio.Runner(loop_factory=factories[name]) as runner:
                    res = runner.run(fanout.engine_run(fresh, "production", dests, urls,
                                                       events, 5, "clock"))
                k = len(res["txns"])
                results[name].append((k / res["s"], 1000 * res["cpu"] / k))
    rows = [("load average at start / end (1/5/15 min)", f"{load} / {load_average()}")]
    for name, xs in results.items():
        rows.append((f"{name}: txn/s (runs) / CPU ms per txn",
                     f"{statistics.median(x[0] for x in xs):.0f} "
                     f"({', '.join(f'{x[0]:.0f}' for x in xs)}) / "
                     f"{statistics.median(x[1] for x in xs):.3f}"))
    gain = (statistics.median(x[0] for x in results["uvloop"])
            / statistics.median(x[0] for x in results["asyncio"]))
    cpu_gain = (statistics.median(x[1] for x in results["asyncio"])
                / statistics.median(x[1] for x in results["uvloop"]))
    rows += [("uvloop / asyncio txn/s", f"{gain:.2f}"),
             ("asyncio / uvloop CPU per txn", f"{cpu_gain:.2f}")]
    report(f"event loop: fan-out to {dests} destinations, {events} events, production "
           f"sender ({rounds} interleaved rounds)", rows)


def signing(rounds: int) -> None:
    """Loop-thread CPU per signature: inline against offloaded, interleaved."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    async def run() -> list[tuple[str, str]]:
        pool = ThreadPoolExecutor(1, thread_name_prefix="federation-sign")
        loop = asyncio.get_running_loop()
        rows: list[tuple[str, str]] = [("load average (1/5/15 min)", load_average())]
        n = 1000
        for size in (2_000, 4_000, 8_000, 16_000, 42_000):
            msg = os.urandom(size)
            got: dict[str, list[float]] = {"inline": [], "offloaded": []}

            async def inline(msg: bytes = msg) -> None:
                for _ in range(n):
                    KEY.sign_bytes(msg)

            async def offloaded(msg: bytes = msg) -> None:
                async def one(k: int) -> None:
                    for _ in range(k):
                        await loop.run_in_executor(pool, KEY.sign_bytes, msg)
                await asyncio.gather(*(one(n // 50) for _ in range(50)))

            for r in range(rounds):
                pair = [("inline", inline), ("offloaded", offloaded)]
                for name, fn in (pair if r % 2 == 0 else pair[::-1]):
                    t0 = time.thread_time()
                    await fn()
                    got[name].append(1e6 * (time.thread_time() - t0) / n)
            rows.append((f"{size:,} bytes: loop-thread µs per signature, inline / offloaded",
                         f"{statistics.median(got['inline']):.1f} / "
                         f"{statistics.median(got['offloaded']):.1f}"))
        pool.shutdown()
        return rows

    report(f"signing on the event loop or the signing thread ({rounds} rounds)",
           asyncio.run(run()))


def signers(rounds: int) -> None:
    """µs per signature, libsodium against OpenSSL against a split signature over a
    shared head, interleaved per size."""
    import os

    from nacl.bindings import crypto_sign

    sodium_key = bytes(KEY.raw) + bytes(KEY.raw.verify_key)
    openssl = KEY._openssl
    rows: list[tuple[str, str]] = [("load average (1/5/15 min)", load_average()),
                                   ("sign_bytes switches at", f"{LIBSODIUM_BELOW_BYTES:,} bytes")]
    n = 2000
    for size in (150, 1_000, 2_000, 4_000, 8_000, 16_000, 25_000, 42_000):
        msg = os.urandom(size)

        def sodium(msg: bytes = msg) -> bytes:
            return bytes(crypto_sign(msg, sodium_key))

        def ossl(msg: bytes = msg) -> bytes:
            return openssl.sign(msg)

        head = KEY.head(msg[:-100])

        def split(msg: bytes = msg, head: Any = head) -> bytes:
            return KEY.sign_split(head, msg[-100:])

        assert split() == ossl() == sodium()[:64]
        trio: list[tuple[str, Callable[[], Any]]] = [
            ("libsodium", sodium), ("OpenSSL", ossl), ("split", split)]
        got: dict[str, list[float]] = {name: [] for name, _ in trio}
        for r in range(rounds):
            for name, fn in (trio if r % 2 == 0 else trio[::-1]):
                got[name].append(_per_call_us(fn, n))
        rows.append((f"{size:,} bytes: µs per signature, libsodium / OpenSSL / split",
                     " / ".join(f"{statistics.median(got[name]):.1f}" for name, _ in trio)))
    report(f"ed25519 signers ({rounds} interleaved rounds)", rows)


def shared(rounds: int, dests: int) -> None:
    """µs per prepared transaction, contents shared against built whole, interleaved."""
    rows: list[tuple[str, str]] = [("load average (1/5/15 min)", load_average())]
    for n_pdus in (50, 11, 1):
        pdus = [synapse_like_pdu(i) for i in range(n_pdus)]
        encoded = [canonical_json(p) for p in pdus]
        got: dict[int, list[float]] = {SHARED_CONTENT_MAX_AGE_MS: [], 0: []}
        sides = list(got)
        for r in range(rounds):
            for share in (sides if r % 2 == 0 else sides[::-1]):
                builder = RequestBuilder(origin="local.bench", key=KEY, clock=SystemClock(),
                                         share_contents_ms=share)
                txns = [Transaction(f"d{i}.bench", f"m{r}.{i}", pdus, (), pdu_bytes=encoded)
                        for i in range(dests)]
                t0 = time.perf_counter()
                for t in txns:
                    builder.prepare(t)
                got[share].append(1e6 * (time.perf_counter() - t0) / dests)
        size = len(RequestBuilder(origin="local.bench", key=KEY, clock=SystemClock()).prepare(
            Transaction("x.bench", "x", pdus, (), pdu_bytes=encoded)).body)
        on, off = (statistics.median(got[k]) for k in sides)
        rows.append((f"{n_pdus} PDUs ({size:,} bytes): µs per transaction, shared / whole",
                     f"{on:.1f} / {off:.1f} ({off / on:.2f}x)"))
    report(f"one content to {dests} destinations ({rounds} interleaved rounds)", rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="*", default=["encoders", "signing", "loop"],
                    choices=["encoders", "signing", "signers", "shared", "loop"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dests", type=int, default=200)
    ap.add_argument("--events", type=int, default=200)
    a = ap.parse_args()
    if "encoders" in a.what:
        encoders(a.rounds)
    if "signing" in a.what:
        signing(a.rounds)
    if "signers" in a.what:
        signers(a.rounds)
    if "shared" in a.what:
        shared(a.rounds, a.dests)
    if "loop" in a.what:
        loop(a.rounds, a.dests, a.events)


if __name__ == "__main__":
    main()
