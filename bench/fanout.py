"""Fan-out throughput: transactions per second to N loopback destinations, the queue
engine side by side with a bare aiohttp loop sending the same bodies to the same
receivers (in another process).

For each N: one room joined by every destination; ``--events`` events, announced to the
engine as the main process would persist them, ``--burst`` per millisecond, and drained to
all N; then the bare loop replays the exact transactions the engine sent (per destination
in order, one in flight per destination, the same global concurrency). Prints txn/s for
both and the ratio.

How events are announced (``--announce``):

* ``clock`` (default): at every turn of the event loop, everything persisted by now (by
  the clock) is announced at once, as the replication reader does: it drains whatever the
  socket buffered, however long the loop took to come back to it.
* ``turn``: one burst per turn of the event loop, whatever the clock says (the first
  version of this benchmark). Under load a turn takes milliseconds, so the events trickle
  in at the loop's pace and the figure measures loop latency more than throughput.

    .venv/bin/python bench/fanout.py [--db postgres|sqlite] [--dests 200 1000] \
        [--announce clock|turn]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import replace
from typing import Any

from common import (
    ME,
    RecordingSender,
    bare_loop,
    build_rooms,
    clock,
    database,
    receivers,
    report,
    url_for,
)

from federation_sender.config import QueueSettings
from federation_sender.queue import QueueManager
from federation_sender.storage.native import NativeBackend
from federation_sender.testing.http_sender import HttpTransactionSender
from federation_sender.testing.queue_writer import HomeserverWriter

PROFILE: Any = None
"""A cProfile.Profile to enable around the engine phase (set by a profiling driver)."""


async def announce(m: QueueManager, start: int, events: int, burst: int, mode: str) -> None:
    """Announce ``events`` events past ``start``, ``burst`` per millisecond (see above)."""
    end = start + events
    if mode == "turn":
        for upto in range(start + burst, end + burst, burst):
            m.notify_new_events(min(upto, end))
            await asyncio.sleep(0.001)
        return
    t0 = time.perf_counter()
    upto = start
    while upto < end:
        due = start + burst * (1 + int((time.perf_counter() - t0) * 1000))
        upto = min(end, due)
        m.notify_new_events(upto)
        await asyncio.sleep(0.001)


async def run_one(db: str, n: int, urls: list[str], events: int, burst: int,
                  mode: str = "clock") -> dict[str, float]:
    settings = replace(QueueSettings(), max_concurrent_transactions=500)
    async with database(db) as engine:
        rooms = await build_rooms(engine, n, 1)
        writer = await HomeserverWriter(engine, ME).init()
        inner = HttpTransactionSender(url_for(urls), ME, clock(), timeout_s=60)
        sender = RecordingSender(inner, keep=False)
        m = QueueManager(NativeBackend(engine), sender.inner, settings, ME, "bench", clock(),
                         random.Random(1), lambda _d: True, attempt_deadline_s=60)
        await m.start()
        # Warm-up: create every queue and connection once.
        sender.target_pdus = n
        await writer.message(rooms[0], f"@alice:{ME}")
        m.notify_new_events(writer.stream_ordering)
        await asyncio.wait_for(sender.done.wait(), 120)
        sender.keep = True
        sender.sent.clear()
        sender.ok_txns = sender.ok_pdus = 0
        sender.done.clear()
        sender.target_pdus = events * n
        # The main process's writes are not the engine's cost: write first, then poke the
        # engine burst by burst as the events stream would.
        start = writer.stream_ordering
        await writer.messages(rooms[0], f"@alice:{ME}", events)
        t0 = time.perf_counter()
        c0 = time.process_time()
        if PROFILE is not None:
            PROFILE.enable()
        await announce(m, start, events, burst, mode)
        await asyncio.wait_for(sender.done.wait(), 600)
        t_engine = time.perf_counter() - t0
        cpu_engine = time.process_time() - c0
        if PROFILE is not None:
            PROFILE.disable()
        txns = list(sender.sent)
        await m.stop(5)
        await inner.close()
        t_bare, cpu_bare = await bare_loop(txns, url_for(urls),
                                           settings.max_concurrent_transactions)
        return {
            "txns": len(txns),
            "engine_s": t_engine,
            "bare_s": t_bare,
            "engine_tps": len(txns) / t_engine,
            "bare_tps": len(txns) / t_bare,
            "engine_cpu_ms_per_txn": 1000 * cpu_engine / len(txns),
            "bare_cpu_ms_per_txn": 1000 * cpu_bare / len(txns),
        }


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="postgres", choices=["postgres", "sqlite"])
    ap.add_argument("--dests", type=int, nargs="+", default=[200, 1000])
    ap.add_argument("--events", type=int, default=400)
    ap.add_argument("--burst", type=int, default=5)
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--announce", default="clock", choices=["clock", "turn"])
    a = ap.parse_args()
    with receivers(a.receivers) as urls:
        for n in a.dests:
            r = await run_one(a.db, n, urls, a.events, a.burst, a.announce)
            report(f"fan-out to {n} destinations ({a.db}, {a.events} events, {a.burst} per ms, "
                   f"announced per {a.announce})", [
                ("transactions", f"{int(r['txns'])}"),
                ("engine: seconds / txn per s", f"{r['engine_s']:.2f} / {r['engine_tps']:.0f}"),
                ("bare aiohttp loop: seconds / txn per s",
                 f"{r['bare_s']:.2f} / {r['bare_tps']:.0f}"),
                ("CPU ms per txn: engine / bare",
                 f"{r['engine_cpu_ms_per_txn']:.2f} / {r['bare_cpu_ms_per_txn']:.2f}"),
                ("ratio engine / bare (target >= 0.7)", f"{r['engine_tps'] / r['bare_tps']:.2f}"),
            ])


if __name__ == "__main__":
    asyncio.run(main())
