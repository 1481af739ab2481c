"""A 10,000-server room: ``--events`` events (1,000) in one room joined by ``--dests``
servers (10,000), drained on the production path; targets (issue #32): drained in
<= 60 s, peak RSS of the worker <= 300 MB, nothing lost.

Each destination is a server of its own, as in a real room: destination ``i`` is
overridden to its own loopback address (``127.0.x.y``, one per destination) on one
port, so the worker's HTTP/1.1 client keeps a pool (and a connection) per destination,
with the worker's default pool limits (``federation.pool_total`` 1,000 in use,
``federation.pool_per_host`` 4), not one shared pool. The peers are ``--peers`` child
processes, each listening on its share of the addresses (one socket per address, the
same port): a minimal HTTP/1.1 receiver that parses each body (orjson), counts the PDUs
of each new transaction id per destination (a retransmit is answered and not counted)
and answers ``200 {"pdus": {}}``. It is lighter than ``FakeHomeserver`` (aiohttp's
server), which on this machine would need more CPU than the worker to receive 10
million PDUs. Both processes raise their open-file limit to the hard limit, as the
worker does (``runtime.raise_open_file_limit``).

The worker's side is ``bench/common.py``'s production sender (the real
``FederationClient`` and ``TelemetryObserver``, the default queue settings) in this
process; the main process's writes (the room, the events) come before the clock, then
the engine is poked once, and timed until every destination holds every event. At the
end every destination's count is checked: exactly ``--events`` PDUs each (plus the
warm-up event).

``--senders N`` runs N worker processes instead, sharded as Synapse's
``federation_sender_instances`` (its static rule, ``sharding.static_owner``), each the
same production path for its destinations over the shared database; this process then
only writes, as the main process does. The drain runs from the first poke to the last
delivery of any of them; RSS is each process's own.

    .venv/bin/python bench/big_room.py [--dests 10000] [--events 1000] [--peers 2] \
        [--port 35500] [--senders 1]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from common import (
    BENCH_KEY,
    GC,
    ME,
    BenchSender,
    CountingClient,
    Deliveries,
    build_rooms,
    clock,
    databases,
    dest_name,
    load_average,
    production_observer,
    report,
    rss_mb,
)

from federation_sender.config import FederationSettings, QueueSettings
from federation_sender.queue.manager import QueueManager
from federation_sender.runtime import loop_factory, raise_open_file_limit
from federation_sender.sharding import static_owner
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.engine import create_engine
from federation_sender.testing.queue_writer import HomeserverWriter

_OK = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n"
       b'{"pdus":{}}')
_EVENT_ANSWERS = {
    # GET /event: the event is held (a Synapse receiver that keeps up: pacing confirms).
    "held": (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
             b"\r\n{}"),
    # A receiver without the endpoint: pacing turns itself off for the destination.
    "unsupported": (b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n"
                    b'Content-Length: 30\r\n\r\n{"errcode":"M_UNRECOGNIZED"}  '),
}


def address(i: int) -> str:
    """Destination ``i``'s own loopback address (127.0.1.1 on, 250 per /24)."""
    return f"127.0.{1 + i // 250}.{1 + i % 250}"


def _header(head: bytes, name: bytes) -> bytes:
    """A header's value in a lower-cased head ending in CRLF (b"" if absent)."""
    at = head.find(b"\r\n" + name + b":")
    if at < 0:
        return b""
    return head[at + len(name) + 3:head.index(b"\r\n", at + 2)].strip()


class _Peer(asyncio.Protocol):
    """One connection to a fake peer: HTTP/1.1 requests with a Content-Length body."""

    def __init__(self, counts: Counter[str], seen: set[tuple[str, bytes]],
                 event_answer: bytes) -> None:
        self.counts, self.seen, self.event_answer = counts, seen, event_answer
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.counts["connections"] += 1

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]) + b"\r\n"
            lower = head.lower()
            length = int(_header(lower, b"content-length") or 0)
            if len(buf) < end + 4 + length:
                return
            body = bytes(buf[end + 4:end + 4 + length])
            del buf[:end + 4 + length]
            assert self.transport is not None
            method, txn, _ = head.split(b" ", 2)
            if method == b"GET":
                self.counts["GET /event"] += 1
                self.transport.write(self.event_answer)
                continue
            host = _header(lower, b"host").decode()
            if (host, txn) not in self.seen:
                self.seen.add((host, txn))
                self.counts[host] += len(orjson.loads(body).get("pdus") or ())
            self.transport.write(_OK)


def _serve(addresses: Sequence[str], port: int, event_answer: bytes, ready: Any, results: Any,
           stop: Any) -> None:
    raise_open_file_limit()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        counts: Counter[str] = Counter()
        seen: set[tuple[str, bytes]] = set()
        server = await loop.create_server(lambda: _Peer(counts, seen, event_answer),
                                          host=list(addresses), port=port,
                                          reuse_address=True, backlog=1024)
        ready.put(len(addresses))
        while not stop.is_set():  # noqa: ASYNC110 - a multiprocessing event
            await asyncio.sleep(0.2)
        server.close()
        counts["cpu_ms"] = int(1000 * time.process_time())
        results.put(dict(counts))

    asyncio.run(main())


class PeerProcesses:
    """``n`` peer processes sharing ``addresses``; ``counts()`` gathers their tallies."""

    def __init__(self, addresses: Sequence[str], port: int, n: int, event_get: str) -> None:
        ctx = mp.get_context("spawn")
        self.ready, self.results, self.stop = ctx.Queue(), ctx.Queue(), ctx.Event()
        answer = _EVENT_ANSWERS[event_get]
        self.procs = [ctx.Process(target=_serve, args=(addresses[k::n], port, answer,
                                                       self.ready, self.results, self.stop),
                                  daemon=True)
                      for k in range(n)]

    def __enter__(self) -> PeerProcesses:
        for p in self.procs:
            p.start()
        for _ in self.procs:
            self.ready.get(timeout=300)
        return self

    def counts(self) -> Counter[str]:
        self.stop.set()
        total: Counter[str] = Counter()
        for _ in self.procs:
            total.update(self.results.get(timeout=120))
        return total

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


class OwnAddresses(Mapping[str, str]):
    """Destination ``r{i}.bench`` to ``127.0.x.y:port``, its own address."""

    def __init__(self, port: int) -> None:
        self.port = port

    def __getitem__(self, dest: str) -> str:
        return f"{address(int(dest[1:].split('.', 1)[0]))}:{self.port}"

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def production_sender(port: int) -> BenchSender:
    """``common.make_sender("production")`` with the worker's default pool limits and
    each destination on its own address."""
    fed = FederationSettings()
    counter = Deliveries()
    client = CountingClient(
        counter, server_name=ME, signing_key=BENCH_KEY, clock=clock(),
        attempt_timeout_s=fed.request_timeout_s, connect_timeout_s=fed.connect_timeout_s,
        max_connections=fed.pool_total, max_connections_per_host=fed.pool_per_host,
        ip_allow_list=("127.0.0.0/8",), destination_overrides=OwnAddresses(port),
        plain_http=True)
    observer, provider, metrics = production_observer()
    client.tracer = observer.tracing.tracer
    client.request_counter = metrics
    return BenchSender("production", client, counter, observer, provider)


class GcByGeneration:
    """Collections and their seconds per generation, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.runs: Counter[int] = Counter()
        self.seconds: dict[int, float] = {}
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: Mapping[str, Any]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.runs[info["generation"]] += 1
            g = info["generation"]
            self.seconds[g] = self.seconds.get(g, 0.0) + time.perf_counter() - self._t0

    def __str__(self) -> str:
        return ", ".join(f"gen{g}: {self.runs[g]} ({self.seconds[g]:.2f} s)"
                         for g in sorted(self.runs)) or "none"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@dataclass(frozen=True)
class DrainWindow:
    t0: float
    t1: float
    """The poke and the end, on the system-wide monotonic clock (comparable across
    the ``--senders`` processes)."""
    cpu_s: float
    peak_rss: float


async def watch_drain(counter: Deliveries, poke: Callable[[], None], timeout_s: float,
                      every_2s: Callable[[], None] | None = None) -> DrainWindow:
    """Poke the engine, then sample RSS every 0.25 s (and call ``every_2s`` every eight
    samples) until ``counter`` is done or ``timeout_s`` has passed."""
    peak = rss_mb()
    t0, c0 = time.monotonic(), time.process_time()
    poke()
    ticks = 0
    while not counter.done.is_set():
        await asyncio.sleep(0.25)
        peak = max(peak, rss_mb())
        ticks += 1
        if every_2s is not None and ticks % 8 == 0:
            every_2s()
        if time.monotonic() - t0 > timeout_s:
            break
    return DrainWindow(t0, time.monotonic(), time.process_time() - c0, peak)


async def run(a: argparse.Namespace, peers: PeerProcesses) -> list[tuple[str, str]]:
    async with databases(a.db) as fresh_db, fresh_db() as engine:
        rooms = await build_rooms(engine, a.dests, 1)
        writer = await HomeserverWriter(engine, ME).init()
        bs = production_sender(a.port)
        await bs.start()
        m = bs.manager(engine, QueueSettings(), attempt_deadline_s=60)
        await m.start()
        # Warm-up: one event, so that queues and connections exist as in a live room.
        bs.counter.reset(a.dests)
        t_warm, c_warm = time.perf_counter(), time.process_time()
        await writer.message(rooms[0], f"@alice:{ME}")
        m.notify_new_events(writer.stream_ordering)
        await asyncio.wait_for(bs.counter.done.wait(), 600)
        warm_s, warm_cpu = time.perf_counter() - t_warm, time.process_time() - c_warm
        # The queues' first reads (gathered: QueuePersistence.bootstrap_gathered).
        first_reads = getattr(m.store, "gathered_reads", None)
        await writer.messages(rooms[0], f"@alice:{ME}", a.events)
        bs.counter.reset(a.events * a.dests)
        GC.settle()
        load = load_average()
        before = peak = rss_mb()
        fds = peak_fds = open_fds()
        gens = GcByGeneration()
        gens.on = True

        def fds_tick() -> None:
            nonlocal peak_fds
            peak_fds = max(peak_fds, open_fds())

        # Listing 10,000 descriptors is this bench's own CPU, in the measured process
        # (2 % of it when done every 0.25 s): every 2 s is enough.
        w = await watch_drain(bs.counter, lambda: m.notify_new_events(writer.stream_ordering),
                              a.timeout_s, fds_tick)
        elapsed, cpu, peak = w.t1 - w.t0, w.cpu_s, max(peak, w.peak_rss)
        builder = getattr(bs.sender, "requests", None)
        shared = getattr(builder, "shared", None)
        GC.end()
        gens.on = False
        await m.stop(5)
        await bs.close()
    c = bs.counter
    counts = peers.counts()
    want = a.events + 1
    short = {d: n for i in range(a.dests) if (n := counts.get(d := dest_name(i), 0)) < want}
    gets = counts.pop("GET /event", 0)
    connections = counts.pop("connections", 0)
    peers_cpu = counts.pop("cpu_ms", 0) / 1000
    extra = {d: n for d, n in counts.items() if n > want}
    return [
        ("load average at start / end (1/5/15 min)", f"{load} / {load_average()}"),
        ("warm-up event to every destination (new queues, new connections)",
         f"{warm_s:.1f} s, worker CPU {warm_cpu:.1f} s"),
        ("the new queues' first reads (database transactions)",
         "one per queue" if first_reads is None else f"{first_reads}"),
        ("PDUs delivered (sender's count)", f"{c.ok_pdus} of {a.events * a.dests}"),
        ("destinations holding all events (peers' count)",
         f"{a.dests - len(short)} of {a.dests}"
         + (f"; short: {dict(list(short.items())[:5])}" if short else "")
         + (f"; over: {len(extra)}" if extra else "")),
        ("transactions", f"{c.ok_txns} ({c.ok_pdus / max(1, c.ok_txns):.1f} PDUs each)"),
        (f"pacing's GET /event (peers answer {a.event_get})", f"{gets}"),
        ("signatures over another destination's content (RequestBuilder.shared)",
         "not counted" if shared is None else f"{shared}"),
        ("drain time (target <= 60 s)", f"{elapsed:.1f} s"),
        ("worker CPU (all threads)", f"{cpu:.1f} s ({1000 * cpu / max(1, c.ok_txns):.3f} ms "
                                     f"per txn)"),
        ("RSS before the poke / peak (target <= 300 MB)", f"{before:.0f} / {peak:.0f} MB"),
        ("open files before / peak", f"{fds} / {peak_fds}"),
        ("connections the peers accepted (warm-up included)", f"{connections}"),
        ("the peers' CPU, all of the run (both processes)", f"{peers_cpu:.1f} s"),
        ("GC runs in the window (s)", f"{GC.collections} ({GC.gc_s:.2f} s): {gens}"),
    ]


def _shard_main(url: str, names: list[str], name: str, a: argparse.Namespace,
                conn: Any) -> None:
    """One of ``--senders`` worker processes: instance ``name`` of ``names``, owning the
    destinations Synapse's static rule gives it (``sharding.static_owner``), over the
    shared database; it acts on the parent's commands (see :func:`run_sharded`)."""
    raise_open_file_limit()

    async def main() -> None:
        engine = create_engine(url, pool_size=20)
        mine = sum(static_owner(dest_name(i), names) == name for i in range(a.dests))
        bs = production_sender(a.port)
        await bs.start()
        m = QueueManager(NativeBackend(engine), bs.sender, QueueSettings(), ME, name, clock(),
                         random.Random(1), lambda d: static_owner(d, names) == name,
                         bs.observer, attempt_deadline_s=60)
        await m.start()
        conn.send(mine)
        _, warm_pos = await asyncio.to_thread(conn.recv)
        bs.counter.reset(mine)
        m.notify_new_events(warm_pos)
        await asyncio.wait_for(bs.counter.done.wait(), 600)
        conn.send("warm")
        _, pos = await asyncio.to_thread(conn.recv)
        bs.counter.reset(a.events * mine)
        GC.settle()
        before = rss_mb()
        w = await watch_drain(bs.counter, lambda: m.notify_new_events(pos), a.timeout_s)
        GC.end()
        await m.stop(5)
        await bs.close()
        await engine.dispose()
        c = bs.counter
        conn.send({"name": name, "mine": mine, "t0": w.t0, "t1": w.t1, "cpu": w.cpu_s,
                   "before": before, "peak": max(before, w.peak_rss), "pdus": c.ok_pdus,
                   "txns": c.ok_txns})

    with asyncio.Runner(loop_factory=loop_factory(a.event_loop)) as runner:
        runner.run(main())


async def run_sharded(a: argparse.Namespace, peers: PeerProcesses) -> list[tuple[str, str]]:
    """``--senders N``: N worker processes, sharded as Synapse's
    ``federation_sender_instances`` shards (its static rule), each the production path
    of :func:`run` for its destinations. This process writes as the main process does;
    the drain runs from the first process's poke to the last one's last delivery (the
    system-wide monotonic clock); RSS is per process."""
    names = [f"fed{k + 1}" for k in range(a.senders)]
    ctx = mp.get_context("spawn")
    async with databases(a.db) as fresh_db, fresh_db() as engine:
        rooms = await build_rooms(engine, a.dests, 1)
        writer = await HomeserverWriter(engine, ME).init()
        url = engine.url.render_as_string(hide_password=False)
        pipes = [ctx.Pipe() for _ in names]
        procs = [ctx.Process(target=_shard_main, args=(url, names, n, a, child), daemon=True)
                 for n, (_, child) in zip(names, pipes, strict=True)]
        for proc in procs:
            proc.start()
        try:
            conns = [parent for parent, _ in pipes]
            owned = [await asyncio.to_thread(c.recv) for c in conns]
            await writer.message(rooms[0], f"@alice:{ME}")
            for c in conns:
                c.send(("warm", writer.stream_ordering))
            for c in conns:
                await asyncio.to_thread(c.recv)
            await writer.messages(rooms[0], f"@alice:{ME}", a.events)
            load = load_average()
            for c in conns:
                c.send(("go", writer.stream_ordering))
            done = [await asyncio.to_thread(c.recv) for c in conns]
        finally:
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    counts = peers.counts()
    want = a.events + 1
    short = [d for i in range(a.dests) if counts.get(d := dest_name(i), 0) < want]
    drain = max(r["t1"] for r in done) - min(r["t0"] for r in done)
    pdus, txns = sum(r["pdus"] for r in done), sum(r["txns"] for r in done)
    cpu = sum(r["cpu"] for r in done)
    return [
        ("load average at start / end (1/5/15 min)", f"{load} / {load_average()}"),
        ("worker processes (destinations each)", ", ".join(
            f"{n}: {k}" for n, k in zip(names, owned, strict=True))),
        ("PDUs delivered (the workers' count)", f"{pdus} of {a.events * a.dests}"),
        ("destinations holding all events (peers' count)",
         f"{a.dests - len(short)} of {a.dests}" + (f"; short: {short[:5]}" if short else "")),
        ("transactions", f"{txns} ({pdus / max(1, txns):.1f} PDUs each)"),
        ("drain time, first poke to last delivery (target <= 60 s)", f"{drain:.1f} s"),
        ("each worker's own drain", ", ".join(
            f"{r['name']}: {r['t1'] - r['t0']:.1f} s" for r in done)),
        ("workers' CPU (all processes)", f"{cpu:.1f} s ({1000 * cpu / max(1, txns):.3f} ms "
                                         f"per txn)"),
        ("RSS before the poke / peak, per worker (target <= 300 MB)", ", ".join(
            f"{r['name']}: {r['before']:.0f} / {r['peak']:.0f} MB" for r in done)),
        ("the peers' CPU, all of the run (both processes)",
         f"{counts.get('cpu_ms', 0) / 1000:.1f} s"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="postgres", choices=["postgres", "sqlite"])
    ap.add_argument("--dests", type=int, default=10_000)
    ap.add_argument("--events", type=int, default=1000)
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--port", type=int, default=35500)
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--event-get", default="held", choices=sorted(_EVENT_ANSWERS),
                    help="what the peers answer to pacing's GET /event")
    ap.add_argument("--event-loop", default="asyncio", choices=["asyncio", "uvloop"],
                    help="the worker's --event-loop (uvloop: the uvloop extra)")
    ap.add_argument("--senders", type=int, default=1,
                    help="worker processes, sharded by Synapse's static rule "
                         "(federation_sender_instances); 1: the worker in this process")
    a = ap.parse_args()
    if a.dests > 250 * 254:
        raise SystemExit("at most 63,500 destinations (one 127.0.x.y address each)")
    raise_open_file_limit()
    with (PeerProcesses([address(i) for i in range(a.dests)], a.port, a.peers,
                        a.event_get) as peers,
          asyncio.Runner(loop_factory=loop_factory(a.event_loop)) as runner):
        rows = runner.run(run(a, peers) if a.senders == 1 else run_sharded(a, peers))
    workers = "" if a.senders == 1 else f"{a.senders} sharded worker processes, "
    report(f"a {a.dests}-server room: {a.events} events, production path ({a.db}, "
           f"{workers}{a.peers} peer processes, {a.event_loop})", rows)


if __name__ == "__main__":
    main()
