"""Memory with 100,000 known idle destinations: at most 150 MB resident.

Phase 1: 100,000 destinations in the database (each with a ``destination_rooms`` row,
caught up), the worker started, a wake-up sweep run: nothing may be held per destination.
Phase 2: every destination gets one EDU (a real transaction through an in-process
sender that answers 200 at once), a wave of ``--wave`` destinations at a time, then goes
idle; after the idle TTL (2 s here) the queues are dropped. RSS is sampled throughout.
The RSS before the worker starts is the interpreter with its libraries.

    .venv/bin/python bench/idle_memory.py [--db postgres|sqlite] [--dests 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
from dataclasses import replace

from common import ME, clock, database, dest_name, report, rss_mb

from federation_sender.config import QueueSettings
from federation_sender.queue import QueueManager
from federation_sender.storage import destinations as dst
from federation_sender.storage.native import NativeBackend
from federation_sender.transport.result import Outcome, SendResult, Transaction


class InstantSender:
    def __init__(self) -> None:
        self.sent = 0

    async def send_transaction(self, txn: Transaction) -> SendResult:
        self.sent += 1
        return SendResult(Outcome.SUCCESS, status=200)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="postgres", choices=["postgres", "sqlite"])
    ap.add_argument("--dests", type=int, default=100_000)
    ap.add_argument("--wave", type=int, default=5_000)
    a = ap.parse_args()
    async with database(a.db) as engine:
        names = [dest_name(i) for i in range(a.dests)]
        async with engine.begin() as conn:
            await dst.upsert_destination_rooms(conn, [(n, f"!r{i % 500}:{ME}", 1)
                                                      for i, n in enumerate(names)])
            await dst.set_last_successful_many(conn, [(n, 1) for n in names])
        del names
        gc.collect()
        base = rss_mb()
        sender = InstantSender()
        settings = replace(QueueSettings(), idle_queue_ttl_s=2.0)
        m = QueueManager(NativeBackend(engine), sender, settings, ME, "bench", clock(),
                         random.Random(1), lambda _d: True)
        await m.start()
        woken = await m.wake_due_destinations()
        gc.collect()
        phase1 = rss_mb()
        t0 = time.perf_counter()
        peak = phase1
        live = 0
        for start in range(0, a.dests, a.wave):
            # Destinations become active a wave at a time, as traffic moves around.
            for i in range(start, min(a.dests, start + a.wave)):
                m.enqueue_edu(dest_name(i), "m.bench", {"i": i})
            while sender.sent < min(a.dests, start + a.wave):
                await asyncio.sleep(0.1)
                peak = max(peak, rss_mb())
                live = max(live, m.active_queues)
        t_sent = time.perf_counter() - t0
        while m.active_queues:
            await asyncio.sleep(0.5)
            peak = max(peak, rss_mb())
        await asyncio.sleep(1.0)  # let the last writes land
        gc.collect()
        after = rss_mb()
        await m.stop(5)
        report(f"{a.dests} known destinations ({a.db})", [
            ("RSS before the worker starts", f"{base:.0f} MB"),
            ("phase 1: started + wake-up sweep (woken)", f"{phase1:.0f} MB ({woken})"),
            (f"phase 2: one transaction each, waves of {a.wave}", f"{t_sent:.1f} s"),
            ("phase 2: most live queues at once", f"{live}"),
            ("phase 2: peak RSS", f"{peak:.0f} MB"),
            ("all idle again, queues dropped (target <= 150)", f"{after:.0f} MB"),
        ])


if __name__ == "__main__":
    asyncio.run(main())
