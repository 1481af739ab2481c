"""Recovery: 10,000 destinations each with 20 rooms outstanding after an outage, then
all come back (REMOTE_SERVER_UP for each): every destination caught up within 60 s.

Setup (written straight to the database, as the outage left it): 1,000 rooms, each
shared with 200 destinations so every destination is in 20 rooms; one new event per
room; ``destination_rooms`` rows for all 200,000 (destination, room) pairs past every
destination's ``last_successful_stream_ordering``; every destination in a day-long
backoff. The clock starts at the REMOTE_SERVER_UPs and stops when every destination's
position is past all its rows (no destination left behind in ``destination_rooms``).

For each sender (``--senders``, default the production path, then the stand-in; see
``common.py``), in one run, each with a fresh database.

    .venv/bin/python bench/recovery.py [--db postgres|sqlite] [--dests 10000] \
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
    databases,
    dest_name,
    load_average,
    make_sender,
    receivers,
    report,
    rss_mb,
)

from federation_sender.config import QueueSettings
from federation_sender.storage import destinations as dst
from federation_sender.testing.queue_writer import HomeserverWriter


async def setup(engine: object, n_dests: int, rooms_per_dest: int, per_room: int) -> int:
    n_rooms = n_dests * rooms_per_dest // per_room
    w = await HomeserverWriter(engine, ME).init()  # type: ignore[arg-type]
    stride = n_rooms // rooms_per_dest
    members: dict[int, list[int]] = {j: [] for j in range(n_rooms)}
    for d in range(n_dests):
        q = d // (n_dests // n_rooms) if n_dests >= n_rooms else d
        for k in range(rooms_per_dest):
            members[(q + k * stride) % n_rooms].append(d)
    for j in range(n_rooms):
        await w.bulk_joins(f"!r{j}:{ME}", [f"@alice:{ME}"] + [f"@u:{dest_name(d)}"
                                                            for d in members[j]])
    before = w.stream_ordering
    evs = await w.messages_in_rooms([(f"!r{j}:{ME}", f"@alice:{ME}") for j in range(n_rooms)])
    so = {e.room_id: e.stream_ordering for e in evs}
    now_ms = int(time.time() * 1000)
    async with engine.begin() as conn:  # type: ignore[attr-defined]
        rows = [(dest_name(d), f"!r{j}:{ME}", so[f"!r{j}:{ME}"])
                for j, ds in members.items() for d in ds]
        await dst.upsert_destination_rooms(conn, rows)
        await dst.set_last_successful_many(conn, [(dest_name(d), before)
                                                  for d in range(n_dests)])
        for d in range(n_dests):
            await dst.set_retry_timings(conn, dest_name(d), now_ms, now_ms, 86_400_000)
    return w.stream_ordering


async def recover(fresh_db: Any, kind: str, urls: list[str], a: argparse.Namespace
                  ) -> list[tuple[str, str]]:
    async with fresh_db() as engine:
        t_setup = time.perf_counter()
        await setup(engine, a.dests, a.rooms_per_dest, a.dests_per_room)
        t_setup = time.perf_counter() - t_setup
        bs = make_sender(kind, urls)
        await bs.start()
        m = bs.manager(engine, QueueSettings(), attempt_deadline_s=60, db_concurrency=24)
        await m.start()
        expected = a.dests * a.rooms_per_dest
        load = load_average()
        t0 = time.perf_counter()
        c0 = time.process_time()
        await asyncio.gather(*(m.remote_server_up(dest_name(d)) for d in range(a.dests)))
        t_up = time.perf_counter() - t0
        peak = rss_mb()
        behind = a.dests
        while True:
            await asyncio.sleep(0.5)
            peak = max(peak, rss_mb())
            if bs.counter.ok_pdus >= expected:
                async with engine.connect() as conn:
                    behind = len(await dst.destinations_behind(conn))
                if behind == 0:
                    break
            if time.perf_counter() - t0 > 600:
                break
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - c0
        await m.stop(5)
        await bs.close()
        return [
            ("load average at start (1/5/15 min)", load),
            ("setup (not timed)", f"{t_setup:.1f} s"),
            ("REMOTE_SERVER_UP for all", f"{t_up:.1f} s"),
            ("PDUs delivered", f"{bs.counter.ok_pdus} of {expected}"),
            ("transactions", f"{bs.counter.ok_txns}"),
            ("destinations still behind", f"{behind}"),
            ("all caught up after (target <= 60 s)", f"{elapsed:.1f} s"),
            ("engine CPU", f"{cpu:.1f} s"),
            ("peak RSS", f"{peak:.0f} MB"),
        ]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="postgres", choices=["postgres", "sqlite"])
    ap.add_argument("--dests", type=int, default=10_000)
    ap.add_argument("--rooms-per-dest", type=int, default=20)
    ap.add_argument("--dests-per-room", type=int, default=200)
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--senders", nargs="+", default=list(reversed(SENDERS)),
                    choices=[*SENDERS, *EXTRA_SENDERS])
    a = ap.parse_args()
    with receivers(a.receivers) as urls:
        async with databases(a.db) as fresh_db:
            for kind in a.senders:
                rows = await recover(fresh_db, kind, urls, a)
                report(f"recovery, {kind} sender: {a.dests} destinations x "
                       f"{a.rooms_per_dest} rooms outstanding ({a.db})", rows)


if __name__ == "__main__":
    asyncio.run(main())
