"""A spike: 4,500 events in rooms shared with 415 destinations, drained (every event
delivered to every destination) in at most 30 s.

For each sender (``--senders``, default the production path, then the stand-in; see
``common.py``) in one run: a fresh database, the rooms, a warm pool (one empty
transaction per destination) and one warm-up event (queues exist, as in a live
server); then the events are written (the main process's cost is not ours), the engine
is poked once and timed until the receivers have everything.

    .venv/bin/python bench/spike.py [--db postgres|sqlite] [--events 4500] [--dests 415] \
        [--senders production stand-in]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from common import (
    EXTRA_SENDERS,
    ME,
    SENDERS,
    build_rooms,
    databases,
    dest_name,
    load_average,
    make_sender,
    receivers,
    report,
    rss_mb,
)

from federation_sender.config import QueueSettings
from federation_sender.testing.queue_writer import HomeserverWriter


async def spike(fresh_db: Any, kind: str, urls: list[str], a: argparse.Namespace
                ) -> list[tuple[str, str]]:
    async with fresh_db() as engine:
        rooms = await build_rooms(engine, a.dests, a.rooms)
        writer = await HomeserverWriter(engine, ME).init()
        bs = make_sender(kind, urls)
        await bs.start()
        await bs.warm_pool([dest_name(i) for i in range(a.dests)])
        m = bs.manager(engine, QueueSettings(), attempt_deadline_s=60)
        await m.start()
        # Warm-up: one event so queues and connections exist, as in a live server.
        bs.counter.reset(a.dests)
        await writer.message(rooms[0], f"@alice:{ME}")
        m.notify_new_events(writer.stream_ordering)
        await asyncio.wait_for(bs.counter.done.wait(), 120)
        bs.counter.reset(a.events * a.dests)
        await writer.messages_in_rooms(
            [(rooms[i % len(rooms)], f"@alice:{ME}") for i in range(a.events)])
        load = load_average()
        peak = rss_mb()
        t0 = time.perf_counter()
        c0 = time.process_time()
        m.notify_new_events(writer.stream_ordering)
        while not bs.counter.done.is_set():
            await asyncio.sleep(0.25)
            peak = max(peak, rss_mb())
            if time.perf_counter() - t0 > 600:
                break
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - c0
        await m.stop(5)
        await bs.close()
        c = bs.counter
        return [
            ("load average at start (1/5/15 min)", load),
            ("PDUs delivered", f"{c.ok_pdus} of {a.events * a.dests}"),
            ("transactions", f"{c.ok_txns}"),
            ("drain time (target <= 30 s)", f"{elapsed:.1f} s"),
            ("transactions per s", f"{c.ok_txns / elapsed:.0f}"),
            ("engine CPU", f"{cpu:.1f} s"),
            ("peak RSS", f"{peak:.0f} MB"),
        ]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="postgres", choices=["postgres", "sqlite"])
    ap.add_argument("--events", type=int, default=4500)
    ap.add_argument("--dests", type=int, default=415)
    ap.add_argument("--rooms", type=int, default=15)
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--senders", nargs="+", default=list(reversed(SENDERS)),
                    choices=[*SENDERS, *EXTRA_SENDERS])
    a = ap.parse_args()
    with receivers(a.receivers) as urls:
        async with databases(a.db) as fresh_db:
            for kind in a.senders:
                rows = await spike(fresh_db, kind, urls, a)
                report(f"spike, {kind} sender: {a.events} events, {a.rooms} rooms shared "
                       f"with {a.dests} destinations ({a.db})", rows)


if __name__ == "__main__":
    asyncio.run(main())
