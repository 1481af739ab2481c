"""A spike: 4,500 events in rooms shared with 415 destinations, drained (every event
delivered to every destination) in at most 30 s.

The events are written first (the main process's cost is not ours), then the engine is
poked once and timed until the receivers have everything.

    .venv/bin/python bench/spike.py [--db postgres|sqlite] [--events 4500] [--dests 415]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from common import ME, RecordingSender, build_rooms, clock, database, receivers, report, rss_mb
from common import url_for as url_for_dest

from federation_sender.config import QueueSettings
from federation_sender.queue import QueueManager
from federation_sender.storage.native import NativeBackend
from federation_sender.testing.http_sender import HttpTransactionSender
from federation_sender.testing.queue_writer import HomeserverWriter


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="postgres", choices=["postgres", "sqlite"])
    ap.add_argument("--events", type=int, default=4500)
    ap.add_argument("--dests", type=int, default=415)
    ap.add_argument("--rooms", type=int, default=15)
    ap.add_argument("--receivers", type=int, default=1)
    a = ap.parse_args()
    with receivers(a.receivers) as urls:
        async with database(a.db) as engine:
            rooms = await build_rooms(engine, a.dests, a.rooms)
            writer = await HomeserverWriter(engine, ME).init()
            inner = HttpTransactionSender(url_for_dest(urls), ME, clock(), timeout_s=60)
            sender = RecordingSender(inner, keep=False)
            m = QueueManager(NativeBackend(engine), sender.inner, QueueSettings(), ME, "bench",
                             clock(), random.Random(1), lambda _d: True, attempt_deadline_s=60)
            await m.start()
            # Warm-up: one event so queues and connections exist, as in a live server.
            sender.target_pdus = a.dests
            await writer.message(rooms[0], f"@alice:{ME}")
            m.notify_new_events(writer.stream_ordering)
            await asyncio.wait_for(sender.done.wait(), 120)
            sender.done.clear()
            sender.ok_pdus = sender.ok_txns = 0
            sender.target_pdus = a.events * a.dests
            await writer.messages_in_rooms(
                [(rooms[i % len(rooms)], f"@alice:{ME}") for i in range(a.events)])
            peak = rss_mb()
            t0 = time.perf_counter()
            c0 = time.process_time()
            m.notify_new_events(writer.stream_ordering)
            while not sender.done.is_set():
                await asyncio.sleep(0.25)
                peak = max(peak, rss_mb())
                if time.perf_counter() - t0 > 600:
                    break
            elapsed = time.perf_counter() - t0
            cpu = time.process_time() - c0
            await m.stop(5)
            await inner.close()
            report(f"spike: {a.events} events, {a.rooms} rooms shared with {a.dests} "
                   f"destinations ({a.db})", [
                ("PDUs delivered", f"{sender.ok_pdus} of {a.events * a.dests}"),
                ("transactions", f"{sender.ok_txns}"),
                ("drain time (target <= 30 s)", f"{elapsed:.1f} s"),
                ("transactions per s", f"{sender.ok_txns / elapsed:.0f}"),
                ("engine CPU", f"{cpu:.1f} s"),
                ("peak RSS", f"{peak:.0f} MB"),
            ])


if __name__ == "__main__":
    asyncio.run(main())
