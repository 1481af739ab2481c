"""Fan-out throughput: transactions per second to N loopback destinations, the queue
engine with the production sender and with the stand-in, side by side with a bare
aiohttp loop sending the same transactions to the same receivers (in another process).

For each N and each sender (``--senders``, default both; see ``common.py``): a fresh
database, one room joined by every destination, a warm-up event (every queue and
connection exists), then ``--events`` events announced to the engine as the main process
would persist them, ``--burst`` per millisecond, and drained to all N. Then the bare
loop replays the production run's transactions (per destination in order, one in flight
per destination, the same global concurrency, its pool warmed before its clock), signed
(the baseline for the production sender) and unsigned (the stand-in's). With
``--rounds`` > 1 the four are interleaved in rotating order, so load from other jobs on
the machine falls on all of them alike; medians are printed. Ratios:
production / signed bare loop (target >= 0.8) and stand-in / unsigned bare loop.

How events are announced (``--announce``):

* ``clock`` (default): at every turn of the event loop, everything persisted by now (by
  the clock) is announced at once, as the replication reader does: it drains whatever the
  socket buffered, however long the loop took to come back to it.
* ``turn``: one burst per turn of the event loop, whatever the clock says (the first
  version of this benchmark). Under load a turn takes milliseconds, so the events trickle
  in at the loop's pace and the figure measures loop latency more than throughput.

    .venv/bin/python bench/fanout.py [--db postgres|sqlite] [--dests 200 1000] \
        [--senders production stand-in] [--rounds 1] [--announce clock|turn]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import replace
from typing import Any

from common import (
    EXTRA_SENDERS,
    GC,
    ME,
    SENDERS,
    bare_loop,
    build_rooms,
    databases,
    dest_name,
    load_average,
    make_sender,
    receivers,
    report,
    url_for,
)

from federation_sender.config import QueueSettings
from federation_sender.queue.manager import QueueManager
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


async def engine_run(fresh_db: Any, kind: str, n: int, urls: list[str], events: int,
                     burst: int, mode: str) -> dict[str, Any]:
    settings = replace(QueueSettings(), max_concurrent_transactions=500)
    async with fresh_db() as engine:
        rooms = await build_rooms(engine, n, 1)
        writer = await HomeserverWriter(engine, ME).init()
        bs = make_sender(kind, urls)
        await bs.start()
        await bs.warm_pool([dest_name(i) for i in range(n)])
        m = bs.manager(engine, settings, attempt_deadline_s=60)
        await m.start()
        # Warm-up: create every queue and connection once.
        bs.counter.reset(n)
        await writer.message(rooms[0], f"@alice:{ME}")
        m.notify_new_events(writer.stream_ordering)
        await asyncio.wait_for(bs.counter.done.wait(), 120)
        bs.counter.reset(events * n, keep=True)
        # The main process's writes are not the engine's cost: write first, then poke the
        # engine burst by burst as the events stream would.
        start = writer.stream_ordering
        await writer.messages(rooms[0], f"@alice:{ME}", events)
        GC.settle()
        t0 = time.perf_counter()
        c0 = time.process_time()
        if PROFILE is not None:
            PROFILE.enable()
        await announce(m, start, events, burst, mode)
        await asyncio.wait_for(bs.counter.done.wait(), 600)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        GC.end()
        if PROFILE is not None:
            PROFILE.disable()
        txns = list(bs.counter.sent)
        await m.stop(5)
        await bs.close()
        return {"txns": txns, "s": wall, "cpu": cpu, "gc": GC.collections, "gc_s": GC.gc_s}


async def run_one(db: str, n: int, urls: list[str], events: int, burst: int,
                  mode: str = "clock", kind: str = "production") -> dict[str, float]:
    """One engine run of ``kind`` and the bare loop replaying it (signed for the
    production senders), for the diagnostics and profiling drivers."""
    async with databases(db) as fresh_db:
        res = await engine_run(fresh_db, kind, n, urls, events, burst, mode)
    txns = res["txns"]
    t_bare, cpu_bare = await bare_loop(txns, url_for(urls), 500, sign=kind != "stand-in")
    return {"txns": len(txns), "engine_s": res["s"], "bare_s": t_bare,
            "engine_tps": len(txns) / res["s"], "bare_tps": len(txns) / t_bare,
            "engine_cpu_ms_per_txn": 1000 * res["cpu"] / len(txns),
            "bare_cpu_ms_per_txn": 1000 * cpu_bare / len(txns)}


VARIANTS = ("production", "bare signed", "stand-in", "bare unsigned",
            "production-default-telemetry", "production-no-telemetry", "production-sampled",
            "production-traced-all", "production-aiohttp")


async def run_n(fresh_db: Any, n: int, urls: list[str], a: argparse.Namespace
                ) -> dict[str, list[tuple[float, float, int, int, float]]]:
    """``variant -> [(txn/s, CPU ms per txn, txns, collections in the window, seconds
    they took)]`` over the rounds."""
    out: dict[str, list[tuple[float, float, int, int, float]]] = {v: [] for v in VARIANTS}
    concurrency = 500
    for r in range(a.rounds):
        engines = list(a.senders)
        engines = engines[r % len(engines):] + engines[:r % len(engines)]
        replay: list[Any] = []
        for kind in engines:
            res = await engine_run(fresh_db, kind, n, urls, a.events, a.burst, a.announce)
            k = len(res["txns"])
            out[kind].append((k / res["s"], 1000 * res["cpu"] / k, k, res["gc"], res["gc_s"]))
            if kind == "production" or not replay:
                replay = res["txns"]
        bares = [("bare signed", True), ("bare unsigned", False)]
        if r % 2:
            bares.reverse()
        for name, sign in bares:
            wall, cpu = await bare_loop(replay, url_for(urls), concurrency, sign=sign)
            out[name].append((len(replay) / wall, 1000 * cpu / len(replay), len(replay),
                              GC.collections, GC.gc_s))
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(n: int, out: dict[str, list[tuple[float, float, int, int, float]]],
              a: argparse.Namespace,
              load: str) -> dict[str, float]:
    med = {v: _median([x[0] for x in out[v]]) for v in VARIANTS}
    cpu = {v: _median([x[1] for x in out[v]]) for v in VARIANTS}
    if not out["production"] or not out["stand-in"]:
        report(f"fan-out to {n} destinations", [(f"{v}: txn/s / CPU ms per txn",
                                                 f"{med[v]:.0f} / {cpu[v]:.3f}")
                                                for v in VARIANTS if out[v]])
        return {}
    rows = [("load average at start / end (1/5/15 min)", f"{load} / {load_average()}")]
    for v in VARIANTS:
        if out[v]:
            runs = ", ".join(f"{x[0]:.0f}" for x in out[v])
            collections = sum(x[3] for x in out[v])
            gc_ms = ", ".join(f"{1000 * x[4]:.0f}" for x in out[v] if x[3])
            rows.append((f"{v}: txn/s (runs) / CPU ms per txn / GC runs (ms)",
                         f"{med[v]:.0f} ({runs}) / {cpu[v]:.3f} / {collections}"
                         + (f" ({gc_ms})" if gc_ms else "")))
    prod_ratio = med["production"] / med["bare signed"]
    stand_ratio = med["stand-in"] / med["bare unsigned"]
    per_round = [p[0] / b[0] for p, b in zip(out["production"], out["bare signed"],
                                             strict=False)]
    rows += [
        ("ratio production / bare signed (target >= 0.8)",
         f"{prod_ratio:.2f}" + (f" (rounds: {', '.join(f'{x:.2f}' for x in per_round)})"
                                if len(per_round) > 1 else "")),
        ("ratio stand-in / bare unsigned", f"{stand_ratio:.2f}"),
        ("production / stand-in", f"{med['production'] / med['stand-in']:.2f}"),
    ]
    txns = out["production"][0][2] if out["production"] else 0
    report(f"fan-out to {n} destinations ({a.db}, {a.events} events, {a.burst} per ms, "
           f"announced per {a.announce}, {txns} txns, {a.rounds} round(s))", rows)
    return {"production_tps": med["production"], "bare_signed_tps": med["bare signed"],
            "standin_tps": med["stand-in"], "bare_unsigned_tps": med["bare unsigned"],
            "ratio": prod_ratio, "standin_ratio": stand_ratio}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="postgres", choices=["postgres", "sqlite"])
    ap.add_argument("--dests", type=int, nargs="+", default=[200, 1000])
    ap.add_argument("--events", type=int, default=400)
    ap.add_argument("--burst", type=int, default=5)
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--senders", nargs="+", default=list(SENDERS),
                    choices=[*SENDERS, *EXTRA_SENDERS])
    ap.add_argument("--announce", default="clock", choices=["clock", "turn"])
    a = ap.parse_args()
    with receivers(a.receivers) as urls:
        async with databases(a.db) as fresh_db:
            for n in a.dests:
                load = load_average()
                out = await run_n(fresh_db, n, urls, a)
                summarise(n, out, a, load)


if __name__ == "__main__":
    asyncio.run(main())
