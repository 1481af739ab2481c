"""Live fan-out under load: events persisted one by one at a steady rate into rooms
shared with hundreds of destinations, each delivered everywhere as it comes (the
kde.org incident's shape: a busy room, 415 servers). Measures the delay from each
event's persistence to its delivery at each destination.

For each ``--holds`` value (``queue.coalesce_hold_s``: 0 sends as soon as anything is
queued; the default 0.5 lets a queue wait for the intake's next hand-over while the
intake is behind, see ``queue/coalesce.py``), in one run and alternating: a fresh
database, the rooms, a warm pool, one warm-up event; then ``--events`` events written
at ``--rate`` per second (each write is the main process persisting an event, followed
by its poke), and the run waits until every destination has every event.

Reported: the time the writes took, drain (last write to last delivery), p50/p99 delay
per (event, destination), PDUs per transaction, the process's CPU per delivered PDU.
The writer is a process of its own (as Synapse's main process is): it writes at its
rate however busy the sender is, and tells the sender of each event (the poke) over a
pipe. Delays count from when a write committed (``time.monotonic``, the same clock in
both processes).

    .venv/bin/python bench/live.py [--dests 415] [--rooms 1] [--events 1500] [--rate 30] \
        [--holds 0.5 0] [--senders production]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import statistics
import threading
import time
from dataclasses import replace
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
)

from federation_sender.config import QueueSettings
from federation_sender.testing.queue_writer import HomeserverWriter
from federation_sender.transport.result import Transaction


async def live(fresh_db: Any, kind: str, hold: float, urls: list[str], a: argparse.Namespace
               ) -> list[tuple[str, str]]:
    async with fresh_db() as engine:
        rooms = await build_rooms(engine, a.dests, a.rooms)
        writer = await HomeserverWriter(engine, ME).init()
        bs = make_sender(kind, urls)
        await bs.start()
        await bs.warm_pool([dest_name(i) for i in range(a.dests)])
        settings = replace(QueueSettings(), coalesce_hold_s=hold)
        m = bs.manager(engine, settings, attempt_deadline_s=60)
        await m.start()
        bs.counter.reset(a.dests)
        await writer.message(rooms[0], f"@alice:{ME}")
        m.notify_new_events(writer.stream_ordering)
        await asyncio.wait_for(bs.counter.done.wait(), 120)

        written: dict[str, float] = {}
        delays: list[float] = []
        last = 0.0
        inner = bs.counter.delivered

        def delivered(txn: Transaction) -> None:
            nonlocal last
            now = time.monotonic()
            for p in txn.pdus:
                t = written.get(str(p.get("event_id")))
                if t is not None:
                    delays.append(now - t)
                    last = now
            inner(txn)

        bs.counter.delivered = delivered  # type: ignore[method-assign]
        bs.counter.reset(a.events * a.dests)
        load = load_average()
        loop = asyncio.get_running_loop()
        all_written = asyncio.Event()

        def on_written(eid: str, so: int, t: float) -> None:
            written[eid] = t
            m.notify_new_events(so)
            if len(written) == a.events:
                all_written.set()

        ctx = mp.get_context("spawn")
        q: Any = ctx.Queue()
        url = engine.url.render_as_string(hide_password=False)
        child = ctx.Process(target=_write, args=(url, rooms, a.events, a.rate, q), daemon=True)

        def relay() -> None:
            while (msg := q.get()) is not None:
                loop.call_soon_threadsafe(on_written, *msg)

        t0 = time.monotonic()
        c0 = time.process_time()
        child.start()
        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        await all_written.wait()
        t_written = max(written.values())
        child.join(10)
        with contextlib.suppress(TimeoutError):  # reported as not delivered
            await asyncio.wait_for(bs.counter.done.wait(), a.timeout_s)
        cpu = time.process_time() - c0
        c = bs.counter
        gate_holds = m.gate.holds if m.gate is not None else 0
        await m.stop(5)
        await bs.close()
        q = statistics.quantiles(delays, n=100, method="inclusive") if len(delays) > 1 else [0] * 99
        return [
            ("load average at start (1/5/15 min)", load),
            ("PDUs delivered", f"{c.ok_pdus} of {a.events * a.dests}"),
            ("writes took (target rate)", f"{t_written - t0:.1f} s ({a.events / a.rate:.0f} s)"),
            ("drain: last write to last delivery", f"{max(0.0, last - t_written):.2f} s"),
            ("delay p50 / p99", f"{q[49]:.2f} / {q[98]:.2f} s"),
            ("PDUs per transaction", f"{c.ok_pdus / max(1, c.ok_txns):.1f} ({c.ok_txns} txns)"),
            ("CPU per delivered PDU", f"{1e6 * cpu / max(1, c.ok_pdus):.0f} µs ({cpu:.1f} s)"),
            ("transactions that waited for a hand-over", f"{gate_holds}"),
        ]


def _write(url: str, rooms: list[str], events: int, rate: float, q: Any) -> None:
    """The main process: ``events`` messages at ``rate`` per second, each reported as
    (event id, stream ordering, commit time) once committed; None at the end."""
    from federation_sender.storage.engine import create_engine

    async def run() -> None:
        engine = create_engine(url)
        writer = await HomeserverWriter(engine, ME).init()
        start = time.monotonic()
        for i in range(events):
            pause = start + i / rate - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            e = await writer.message(rooms[i % len(rooms)], f"@alice:{ME}")
            q.put((e.event_id, e.stream_ordering, time.monotonic()))
        q.put(None)
        await engine.dispose()

    asyncio.run(run())


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="postgres", choices=["postgres", "sqlite"])
    ap.add_argument("--events", type=int, default=1500)
    ap.add_argument("--rate", type=float, default=30.0)
    ap.add_argument("--dests", type=int, default=415)
    ap.add_argument("--rooms", type=int, default=1)
    ap.add_argument("--holds", type=float, nargs="+", default=[0.5, 0.0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--senders", nargs="+", default=["production"],
                    choices=[*SENDERS, *EXTRA_SENDERS])
    a = ap.parse_args()
    with receivers(1) as urls:
        async with databases(a.db) as fresh_db:
            for r in range(a.rounds):
                order = a.holds if r % 2 == 0 else list(reversed(a.holds))
                for kind in a.senders:
                    for hold in order:
                        rows = await live(fresh_db, kind, hold, urls, a)
                        report(f"live, {kind} sender, coalesce_hold_s {hold:g}: {a.events} "
                               f"events at {a.rate:g}/s, {a.rooms} room(s) shared with "
                               f"{a.dests} destinations ({a.db})", rows)


if __name__ == "__main__":
    asyncio.run(main())
