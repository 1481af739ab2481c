"""Memory with 100,000 known idle destinations: at most 150 MB resident.

Phase 1: 100,000 destinations in the database (each with a ``destination_rooms`` row,
caught up), the worker started, a wake-up sweep run: nothing may be held per destination.
Phase 2: every destination gets one EDU (a real transaction through an in-process
sender that answers 200 at once), then goes idle; after the idle TTL the queues are
dropped. RSS is sampled throughout.

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
        m = QueueManager(engine, sender, settings, ME, "bench", clock(), random.Random(1),
                         lambda _d: True)
        await m.start()
        woken = await m.wake_due_destinations()
        gc.collect()
        phase1 = rss_mb()
        t0 = time.perf_counter()
        peak = phase1
        for i in range(a.dests):
            m.enqueue_edu(dest_name(i), "m.bench", {"i": i})
            if i % 5000 == 0:
                await asyncio.sleep(0)
                peak = max(peak, rss_mb())
        while sender.sent < a.dests:
            await asyncio.sleep(0.2)
            peak = max(peak, rss_mb())
        t_sent = time.perf_counter() - t0
        live = m.active_queues
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
            ("phase 2: one transaction each, seconds", f"{t_sent:.1f} s"),
            ("phase 2: live queues at the peak", f"{live}"),
            ("phase 2: peak RSS", f"{peak:.0f} MB"),
            ("all idle again, queues dropped (target <= 150)", f"{after:.0f} MB"),
        ])


if __name__ == "__main__":
    asyncio.run(main())
