"""Shared pieces of the queue benchmarks: receivers in separate processes, a database,
a world of rooms and remote servers, a recording sender, the bare aiohttp baseline, RSS.

Receivers are FakeHomeservers (recording off) in child processes, so their CPU is not
charged to the sender; every benchmark that compares against the bare loop sends the
same bodies to the same receivers.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from federation_sender.clock import SystemClock
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.fake_homeserver import FakeHomeserver
from federation_sender.testing.http_sender import HttpTransactionSender
from federation_sender.testing.postgres import ephemeral_cluster
from federation_sender.transport.result import Transaction

ME = "local.bench"

# Runtime tuning a worker's entry point should apply too: with hundreds of thousands of
# long-lived small objects, the default thresholds run the cyclic collector constantly.
# BENCH_DEFAULT_GC=1 keeps Python's defaults (700, 10, 10), to measure the difference.
if not os.environ.get("BENCH_DEFAULT_GC"):
    gc.set_threshold(100_000, 50, 100)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _serve(port_q: Any, stop_ev: Any) -> None:
    async def main() -> None:
        fh = FakeHomeserver(record=False)
        await fh.start()
        port_q.put(fh.port)
        while not stop_ev.is_set():  # noqa: ASYNC110 - a multiprocessing event
            await asyncio.sleep(0.2)
        await fh.close()

    asyncio.run(main())


@contextlib.contextmanager
def receivers(n: int = 1) -> Iterator[list[str]]:
    """``n`` receiver processes; yields their base URLs."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    stop = ctx.Event()
    procs = [ctx.Process(target=_serve, args=(q, stop), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    urls = [f"http://127.0.0.1:{q.get(timeout=60)}" for _ in procs]
    try:
        yield urls
    finally:
        stop.set()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()


@contextlib.asynccontextmanager
async def database(kind: str) -> AsyncIterator[Any]:
    if kind == "sqlite":
        d = tempfile.mkdtemp(prefix="fsbench-")
        eng = create_engine(f"sqlite:///{d}/bench.db")
        await upgrade(eng)
        try:
            yield eng
        finally:
            await eng.dispose()
        return
    with ephemeral_cluster() as cluster:
        # Benchmarks measure the engine, not fsync: relax durability like a tuned dev box.
        cluster.psql("ALTER SYSTEM SET synchronous_commit = off")
        cluster.psql("SELECT pg_reload_conf()")
        url = cluster.create_database("bench")
        eng = create_engine(url, pool_size=20)
        await upgrade(eng)
        try:
            yield eng
        finally:
            await eng.dispose()


def dest_name(i: int) -> str:
    return f"r{i}.bench"


def url_for(urls: Sequence[str]) -> Any:
    def f(dest: str) -> str:
        return urls[hash(dest) % len(urls)]

    return f


@dataclass
class RecordingSender:
    """Counts (and with ``keep``, keeps for the bare-loop replay) every transaction
    ``inner`` delivers, through its ``on_success`` hook: a wrapping coroutine would add
    a frame per transaction to the engine's measured cost. Give the engine ``inner``."""

    inner: HttpTransactionSender
    keep: bool = True
    sent: list[Transaction] = field(default_factory=list)
    ok_txns: int = 0
    ok_pdus: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    target_pdus: int = 0

    def __post_init__(self) -> None:
        self.inner.on_success = self._delivered

    def _delivered(self, txn: Transaction) -> None:
        self.ok_txns += 1
        self.ok_pdus += len(txn.pdus)
        if self.keep:
            self.sent.append(txn)
        if self.target_pdus and self.ok_pdus >= self.target_pdus:
            self.done.set()


async def bare_loop(txns: Sequence[Transaction], url: Any, concurrency: int,
                    connection_limit: int = 1000) -> tuple[float, float]:
    """Send ``txns`` like the simplest correct sender: per destination one at a time,
    in order; destinations concurrently, at most ``concurrency`` requests in flight.
    Bodies are encoded before the clock starts (the strictest baseline: no
    serialisation cost at all). Returns wall and CPU seconds, both from that clock."""
    by_dest: dict[str, list[tuple[str, bytes]]] = {}
    for t in txns:
        body = json.dumps({"origin": ME, "origin_server_ts": int(time.time() * 1000),
                           "pdus": list(t.pdus), "edus": list(t.edus)},
                          separators=(",", ":")).encode()
        by_dest.setdefault(t.destination, []).append((t.txn_id, body))
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connection_limit, limit_per_host=0)
    ) as session:

        async def one_dest(dest: str, items: list[tuple[str, bytes]]) -> None:
            for txn_id, body in items:
                async with sem, session.put(
                    f"{url(dest)}/_matrix/federation/v1/send/bare{txn_id}",
                    data=body,
                    headers={"Content-Type": "application/json", "Host": dest,
                             "X-Destination": dest},
                ) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status

        t0 = time.perf_counter()
        c0 = time.process_time()
        await asyncio.gather(*(one_dest(d, items) for d, items in by_dest.items()))
        return time.perf_counter() - t0, time.process_time() - c0


async def build_rooms(engine: Any, n_dests: int, n_rooms: int, dests_per_room: int | None = None,
                      seed: int = 1) -> list[str]:
    """Rooms each joined by alice and remote users; every destination in at least one."""
    from federation_sender.testing.queue_writer import HomeserverWriter

    w = HomeserverWriter(engine, ME)
    await w.init()
    rng = random.Random(seed)
    rooms = [f"!room{i}:{ME}" for i in range(n_rooms)]
    per = dests_per_room or n_dests
    for i, room in enumerate(rooms):
        if per >= n_dests:
            members = range(n_dests)
        else:
            members = sorted({(i * per + k) % n_dests for k in range(per)}
                             | set(rng.sample(range(n_dests), 0)))
        await w.bulk_joins(room, [f"@alice:{ME}"] + [f"@u:{dest_name(j)}" for j in members])
    return rooms


def clock() -> SystemClock:
    return SystemClock()


def report(title: str, rows: list[tuple[str, str]]) -> None:
    print(f"\n== {title}")
    for k, v in rows:
        print(f"  {k:<44} {v}")


def pid() -> int:
    return os.getpid()
