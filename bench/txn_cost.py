"""The cost of one transaction: CPU per transaction at one PDU per transaction, the
production path beside the signed bare loop, in one run.

Light traffic sends every event alone: one PDU per transaction to every destination.
For each round (``--rounds``, interleaved, medians printed): a fresh database, one room
joined by ``--dests`` destinations, a warm pool and one warm-up event, then ``--events``
events written first (the main process's cost is not ours) and announced **one at a
time**: the next is announced once every destination acknowledged the previous one, so
every transaction carries exactly one PDU. The production path's CPU (this process, all
threads: the queue engine, the intake's and group commit's database client work,
telemetry with the worker's default sampler, the built-in HTTP/1.1 client, the
signature) is divided by the transactions delivered.

The bare loop then sends the same transactions in the same waves (one event to every
destination at once, the next when all answered), over aiohttp with one request in
flight per destination, signing each request inside its clock, its bodies encoded
before it (``bench/common.py``'s bare loop, in waves). The ratio production / bare
loop is the cost target of issue #32 (<= 1.25); our CPU per transaction against
Synapse's (2.17 ms per PDU at one PDU per transaction in the race of issue #32;
``--synapse-ms`` takes the race's latest) is the other (<= 1/10), and the bare loop's
own ratio to Synapse's is printed too: the floor of a sender built this way.

The raw transport floor (``bench/transport_floor.py``, issue #46.1) sends the same
waves with no HTTP client: canonical JSON and the signature inside the clock, one
``PUT`` per kept-alive connection through a bare asyncio Protocol, the response read
back. The production path's ratio to it is issue #46's target (<= 1.5). The three are
interleaved in each round (the floors' order alternates), with each round's ratio.

The receivers answer plain HTTP unless ``--tls``: then they serve a throwaway CA's
leaf and both senders verify it, as every federation link does (the TLS records, the
per-request encryption and asyncio's TLS layer are then counted). ``--wave-gap-s``
pauses both senders between waves, as light traffic does (one message a second leaves
about 0.9 s idle): caches go cold and the idle process's timers run, and that CPU is
counted as in the race.

    .venv/bin/python bench/txn_cost.py [--dests 200] [--events 50] [--rounds 3] \
        [--senders production production-default-telemetry] [--tls] \
        [--wave-gap-s 0.9] [--synapse-ms 1.615]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from common import (
    BENCH_KEY,
    EXTRA_SENDERS,
    GC,
    ME,
    SENDERS,
    build_rooms,
    client_tls,
    databases,
    dest_name,
    load_average,
    loopback_tls,
    make_sender,
    receivers,
    report,
    url_for,
)
from transport_floor import raw_waves

from federation_sender.config import QueueSettings
from federation_sender.testing.certs import CertFiles
from federation_sender.testing.queue_writer import HomeserverWriter
from federation_sender.transport.encoding import canonical_json, signing_bytes
from federation_sender.transport.result import Transaction
from federation_sender.transport.signing import sign_request_bytes

FLOORS = ("bare signed", "raw transport")
"""The two baselines run on the production run's transactions: the signed aiohttp loop
and the transport floor (``bench/transport_floor.py``: no HTTP client at all)."""

SYNAPSE_MS_PER_TXN = 2.17
"""Synapse 1.163's sender at one PDU per transaction (issue #32's race, 1 msg/s)."""

PROFILE: Any = None
"""Something with ``enable()``/``disable()`` around the production window (profiling)."""


async def production(fresh_db: Any, kind: str, n: int, urls: list[str], events: int,
                     tls: CertFiles | None = None, gap_s: float = 0.0
                     ) -> tuple[float, float, list[Transaction]]:
    """Wall and CPU seconds of ``events`` one-PDU waves to ``n`` destinations, and the
    transactions sent (for the bare loop)."""
    async with fresh_db() as engine:
        rooms = await build_rooms(engine, n, 1)
        writer = await HomeserverWriter(engine, ME).init()
        bs = make_sender(kind, urls, tls=tls)
        await bs.start()
        await bs.warm_pool([dest_name(i) for i in range(n)])
        m = bs.manager(engine, QueueSettings(), attempt_deadline_s=60)
        await m.start()
        bs.counter.reset(n)
        await writer.message(rooms[0], f"@alice:{ME}")
        m.notify_new_events(writer.stream_ordering)
        await asyncio.wait_for(bs.counter.done.wait(), 120)
        start = writer.stream_ordering
        await writer.messages(rooms[0], f"@alice:{ME}", events)
        bs.counter.reset(n, keep=True)
        GC.settle()
        if PROFILE is not None:
            PROFILE.enable()
        t0, c0 = time.perf_counter(), time.process_time()
        for k in range(1, events + 1):
            bs.counter.target_pdus = k * n
            bs.counter.done.clear()
            m.notify_new_events(start + k)
            await asyncio.wait_for(bs.counter.done.wait(), 60)
            if gap_s and k < events:
                await asyncio.sleep(gap_s)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if PROFILE is not None:
            PROFILE.disable()
        GC.end()
        txns = list(bs.counter.sent)
        await m.stop(5)
        await bs.close()
    if any(len(t.pdus) != 1 for t in txns) or len(txns) != events * n:
        raise SystemExit(f"expected {events * n} one-PDU transactions, got {len(txns)} "
                         f"with {sum(len(t.pdus) for t in txns)} PDUs")
    return wall, cpu, txns


async def bare_waves(txns: Sequence[Transaction], url: Any, n: int,
                     tls: CertFiles | None = None, gap_s: float = 0.0) -> tuple[float, float]:
    """The signed bare loop in the production run's waves (``n`` transactions each, one
    per destination; over TLS with ``tls``, verified). Returns wall and CPU seconds."""
    waves: list[list[tuple[str, str, bytes]]] = []
    for i in range(0, len(txns), n):
        waves.append([
            (t.destination, t.txn_id, canonical_json({
                "origin": ME, "origin_server_ts": int(time.time() * 1000),
                "pdus": list(t.pdus), "edus": list(t.edus)}))
            for t in txns[i:i + n]])
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1000, limit_per_host=0, ssl=client_tls(tls))
    ) as session:

        async def put(dest: str, txn_id: str, body: bytes) -> None:
            path = f"/_matrix/federation/v1/send/bare{txn_id}"
            headers = {"Content-Type": "application/json", "Host": dest,
                       "Authorization": sign_request_bytes(
                           key=BENCH_KEY, origin=ME, destination=dest,
                           message=signing_bytes(content=body, destination=dest,
                                                 method="PUT", origin=ME, uri=path))}
            async with session.put(f"{url(dest)}{path}", data=body, headers=headers) as r:
                await r.read()
                assert r.status == 200, r.status

        empty = b'{"edus":[],"origin":"' + ME.encode() + b'","origin_server_ts":0,"pdus":[]}'
        await asyncio.gather(*(put(d, f"warm{d}", empty) for d, _, _ in waves[0]))
        GC.settle()
        t0, c0 = time.perf_counter(), time.process_time()
        for k, wave in enumerate(waves, 1):
            await asyncio.gather(*(put(d, i, b) for d, i, b in wave))
            if gap_s and k < len(waves):
                await asyncio.sleep(gap_s)
        GC.end()
        return time.perf_counter() - t0, time.process_time() - c0


async def profile(a: argparse.Namespace) -> None:
    global PROFILE
    from profile_fanout import PySpyWindow, summarise

    PROFILE = PySpyWindow(Path(a.profile), "raw", 250)
    with tls_files(a) as tls, receivers(1, tls) as urls:
        async with databases(a.db) as fresh_db:
            _, c, txns = await production(fresh_db, a.senders[0], a.dests, urls, a.events,
                                          tls)
    print(f"{a.senders[0]} under py-spy: {1000 * c / len(txns):.3f} ms CPU per txn")
    summarise(Path(a.profile), 40)


@contextlib.contextmanager
def tls_files(a: argparse.Namespace) -> Iterator[CertFiles | None]:
    """With ``--tls``, a throwaway CA and leaf for the receivers (None without)."""
    if not a.tls:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="txn-cost-tls-") as d:
        yield loopback_tls(Path(d), a.dests)


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="postgres", choices=["postgres", "sqlite"])
    ap.add_argument("--dests", type=int, default=200)
    ap.add_argument("--events", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--senders", nargs="+", default=["production"],
                    choices=[*SENDERS, *EXTRA_SENDERS])
    ap.add_argument("--synapse-ms", type=float, default=SYNAPSE_MS_PER_TXN,
                    help="Synapse's sender's CPU per PDU at one PDU per transaction to "
                         "compare with (default: issue #32's figure; the race, "
                         "bench/synapse_compare.py --loads light, measures it)")
    ap.add_argument("--wave-gap-s", type=float, default=0.0,
                    help="both senders pause this long after each wave (idle, as between "
                         "the messages of light traffic: the race's one a second leaves "
                         "about 0.9 s); the pauses' own CPU is counted. Default 0: "
                         "back to back")
    ap.add_argument("--tls", action="store_true",
                    help="the receivers serve TLS (a throwaway CA's leaf), verified by both "
                         "senders, as every federation link is; default plain HTTP")
    ap.add_argument("--event-loop", choices=["asyncio", "uvloop"], default="asyncio",
                    help="the loop the whole run is on (the production path and both "
                         "floors alike; the receivers are other processes)")
    ap.add_argument("--profile", metavar="RAW",
                    help="instead: one production run under py-spy, raw samples to RAW, "
                         "summarised as bench/profile_fanout.py does")
    return ap.parse_args()


async def main(a: argparse.Namespace) -> None:
    if a.profile:
        await profile(a)
        return
    load = load_average()
    cpu: dict[str, list[float]] = {k: [] for k in [*a.senders, *FLOORS]}
    rate: dict[str, list[float]] = {k: [] for k in cpu}
    with tls_files(a) as tls, receivers(1, tls) as urls:
        async with databases(a.db) as fresh_db:
            for r in range(a.rounds):
                kinds = a.senders[r % len(a.senders):] + a.senders[:r % len(a.senders)]
                replay: list[Transaction] = []
                floors = FLOORS if r % 2 == 0 else FLOORS[::-1]
                order = [*kinds, *floors] if r % 2 == 0 else [*floors, *kinds]
                for kind in order:
                    if kind in FLOORS:
                        if not replay:
                            _, _, replay = await production(fresh_db, a.senders[0], a.dests,
                                                            urls, a.events, tls)
                        waves = bare_waves if kind == "bare signed" else raw_waves
                        wall, c = await waves(replay, url_for(urls), a.dests, tls,
                                              a.wave_gap_s)
                        k = len(replay)
                    else:
                        wall, c, txns = await production(fresh_db, kind, a.dests, urls,
                                                         a.events, tls, a.wave_gap_s)
                        k = len(txns)
                        if kind == a.senders[0]:
                            replay = txns
                    cpu[kind].append(1000 * c / k)
                    rate[kind].append(k / wall)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    rows = [("load average at start / end (1/5/15 min)", f"{load} / {load_average()}"),
            ("transactions per run", f"{a.events * a.dests} ({a.events} events x "
                                     f"{a.dests} destinations, 1 PDU each)")]
    for k in cpu:
        runs = ", ".join(f"{x:.3f}" for x in cpu[k])
        rows.append((f"{k}: CPU ms per txn (runs) / txn/s",
                     f"{med[k]:.3f} ({runs}) / {statistics.median(rate[k]):.0f}"))
    bare = med["bare signed"]
    raw = med["raw transport"]
    for k in a.senders:
        per = ", ".join(f"{p / b:.2f}" for p, b in zip(cpu[k], cpu["raw transport"],
                                                        strict=False))
        rows.append((f"{k} / raw transport floor, CPU per txn (target <= 1.5)",
                     f"{med[k] / raw:.2f} (rounds: {per})"))
        per = ", ".join(f"{p / b:.2f}" for p, b in zip(cpu[k], cpu["bare signed"],
                                                        strict=False))
        rows.append((f"{k} / bare signed, CPU per txn (target <= 1.25)",
                     f"{med[k] / bare:.2f} (rounds: {per})"))
        rows.append((f"{k} / Synapse's {a.synapse_ms} ms (target <= 0.10)",
                     f"{med[k] / a.synapse_ms:.3f} (1/{a.synapse_ms / med[k]:.1f})"))
    rows.append(("bare signed / raw transport floor", f"{bare / raw:.2f}"))
    rows.append((f"bare signed / Synapse's {a.synapse_ms} ms",
                 f"{bare / a.synapse_ms:.3f} (1/{a.synapse_ms / bare:.1f})"))
    report(f"one PDU per transaction, {a.dests} destinations ({a.db}, {a.event_loop}, "
           f"{'TLS' if a.tls else 'plain HTTP'}, "
           f"{f'{a.wave_gap_s:g} s between waves' if a.wave_gap_s else 'waves back to back'}, "
           f"{a.rounds} interleaved round(s))", rows)


if __name__ == "__main__":
    args = arguments()
    factory = None
    if args.event_loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main(args))
