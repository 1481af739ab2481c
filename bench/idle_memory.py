"""Memory with 100,000 known idle destinations: at most 150 MB resident, with the
production sender.

Phase 1: 100,000 destinations in the database (each with a ``destination_rooms`` row,
caught up), written and migrated by the parent process, as the main process writes them
and an operator migrates once; the worker started on it (its schema check at head leaves
alembic unloaded), a wake-up sweep run: nothing may be held per destination.
Phase 2: every destination gets one EDU, a real transaction over loopback HTTP to the
receiver process, a wave of ``--wave`` destinations at a time, then goes idle; after
the idle TTL (2 s here) the queues are dropped, and the worker's memory trimmer
(``runtime.MemoryTrimmer``, as ``app.py`` runs it) hands freed heap back. RSS is sampled
throughout. The RSS before the worker starts is the interpreter with its libraries.

Senders (``--senders``, see ``common.py``): ``production`` (the real FederationClient
with signing and the telemetry observer), ``stand-in`` (the unsigned test sender), and
``instant`` (no HTTP at all: answers 200 at once, the figure of earlier versions).
Memory is per process, so each sender runs in a child process of its own, one after
the other, and the figures are printed side by side.

    .venv/bin/python bench/idle_memory.py [--db postgres|sqlite] [--dests 100000] \
        [--senders production stand-in instant]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import replace
from typing import Any

from common import (
    ME,
    SENDERS,
    BenchSender,
    Deliveries,
    bench_cluster,
    clock,
    dest_name,
    load_average,
    make_sender,
    receivers,
    report,
    rss_mb,
)

from federation_sender.config import QueueSettings
from federation_sender.runtime import MemoryTrimmer
from federation_sender.storage import destinations as dst
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import check_schema, upgrade
from federation_sender.transport.result import Outcome, SendResult, Transaction


class InstantSender:
    def __init__(self, counter: Deliveries) -> None:
        self.counter = counter

    async def send_transaction(self, txn: Transaction) -> SendResult:
        self.counter.delivered(txn)
        return SendResult(Outcome.SUCCESS, status=200)

    async def close(self) -> None:
        pass


async def seed(url: str, dests: int) -> None:
    """Migrate and fill the database, in the parent: the main process writes these rows
    and an operator migrates once, so neither the inserts' garbage nor alembic's modules
    belong in the worker's figure."""
    engine = create_engine(url)
    try:
        await upgrade(engine)
        names = [dest_name(i) for i in range(dests)]
        async with engine.begin() as conn:
            await dst.upsert_destination_rooms(conn, [(n, f"!r{i % 500}:{ME}", 1)
                                                      for i, n in enumerate(names)])
            await dst.set_last_successful_many(conn, [(n, 1) for n in names])
    finally:
        await engine.dispose()


def pymalloc_stats(a: argparse.Namespace, when: str) -> None:
    """With ``--pymalloc-stats``: CPython's allocator statistics (its arenas, and the
    bytes in use in them) on stderr, to tell live objects from arenas kept by a few."""
    if a.pymalloc_stats:
        print(f"-- pymalloc {when} (see '# arenas allocated current'):", file=sys.stderr,
              flush=True)
        sys._debugmallocstats()


async def measure(a: argparse.Namespace, urls: list[str]) -> list[tuple[str, str]]:
    engine = create_engine(a.db_url, pool_size=20)
    try:
        await check_schema(engine)  # as the worker starts: at head, alembic stays unloaded
        gc.collect()
        base = rss_mb()
        if a.sender == "instant":
            counter = Deliveries()
            bs = BenchSender("instant", InstantSender(counter), counter)
        else:
            bs = make_sender(a.sender, urls)
        await bs.start()
        m = bs.manager(engine, replace(QueueSettings(), idle_queue_ttl_s=2.0))
        await m.start()
        # As the worker runs it (app.py): gives freed heap back once queues go idle.
        trimmer = MemoryTrimmer(lambda: m.active_queues, clock())
        trim_task = asyncio.create_task(trimmer.run())
        woken = await m.wake_due_destinations()
        gc.collect()
        phase1 = rss_mb()
        pymalloc_stats(a, "after phase 1")
        snap1 = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None
        t0 = time.perf_counter()
        peak = phase1
        live = 0
        for start in range(0, a.dests, a.wave):
            # Destinations become active a wave at a time, as traffic moves around.
            for i in range(start, min(a.dests, start + a.wave)):
                m.enqueue_edu(dest_name(i), "m.bench", {"i": i})
            while bs.counter.ok_txns < min(a.dests, start + a.wave):
                await asyncio.sleep(0.1)
                peak = max(peak, rss_mb())
                live = max(live, m.active_queues)
        t_sent = time.perf_counter() - t0
        while m.active_queues:
            await asyncio.sleep(0.5)
            peak = max(peak, rss_mb())
        await asyncio.sleep(1.0)  # let the last writes land
        after = rss_mb()
        # One more look of the trimmer (every 15 s) after the last queues dropped.
        await asyncio.sleep(16)
        after_trim = rss_mb()
        pymalloc_stats(a, "all idle again, after the trim")
        if snap1 is not None:
            gc.collect()
            top = tracemalloc.take_snapshot().compare_to(snap1, "lineno")[:15]
            print("\n-- retained since phase 1, by allocation site (tracemalloc):")
            for stat in top:
                print(f"  {stat}")
        trim_task.cancel()
        await m.stop(5)
        await bs.close()
        return [
            ("RSS before the worker starts", f"{base:.0f} MB"),
            ("phase 1: started + wake-up sweep (woken)", f"{phase1:.0f} MB ({woken})"),
            (f"phase 2: one transaction each, waves of {a.wave}", f"{t_sent:.1f} s"),
            ("phase 2: most live queues at once", f"{live}"),
            ("phase 2: peak RSS", f"{peak:.0f} MB"),
            ("all idle again, queues dropped (trims so far)", f"{after:.0f} MB"),
            (f"all idle again, after the worker's trim ({trimmer.trims} trims) "
             "(target <= 150)", f"{after_trim:.0f} MB"),
        ]
    finally:
        await engine.dispose()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="postgres", choices=["postgres", "sqlite"])
    ap.add_argument("--dests", type=int, default=100_000)
    ap.add_argument("--wave", type=int, default=5_000)
    ap.add_argument("--senders", nargs="+", default=list(reversed(SENDERS)),
                    choices=[*SENDERS, "instant"])
    ap.add_argument("--sender", help=argparse.SUPPRESS)  # one child's sender
    ap.add_argument("--db-url", help=argparse.SUPPRESS)  # its database, seeded
    ap.add_argument("--pymalloc-stats", action="store_true",
                    help="print sys._debugmallocstats() after phase 1 and at the end")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="print the allocation sites holding what phase 2 left behind "
                         "(slower, and adds its own memory to the RSS figures)")
    a = ap.parse_args()
    if a.sender is None:
        with contextlib.ExitStack() as stack:
            if a.db == "postgres":
                cluster = stack.enter_context(bench_cluster())
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="fsbench-"))
            for kind in a.senders:
                name = f"idle_{kind.replace('-', '_')}"
                url = (cluster.create_database(name) if a.db == "postgres"
                       else f"sqlite:///{tmp}/{name}.db")
                asyncio.run(seed(url, a.dests))
                argv = [sys.executable, __file__, "--db", a.db, "--dests", str(a.dests),
                        "--wave", str(a.wave), "--sender", kind, "--db-url", url]
                if a.tracemalloc:
                    argv.append("--tracemalloc")
                if a.pymalloc_stats:
                    argv.append("--pymalloc-stats")
                subprocess.run(argv, check=True)
        return

    if a.tracemalloc:
        tracemalloc.start(1)

    async def child() -> Any:
        with receivers(1) as urls:
            load = load_average()
            rows = await measure(a, urls)
        report(f"{a.dests} known destinations, {a.sender} sender ({a.db})",
               [("load average at start (1/5/15 min)", load), *rows])

    asyncio.run(child())


if __name__ == "__main__":
    main()
