"""How the queue engine's cost grows with destinations, rooms and events.

Three sweeps, each growing one dimension of a workload while the others stay fixed:

* **destinations** 50 / 200 / 1,000: 500 events over 10 rooms, every room joined by
  every destination (PDUs = 500 x destinations);
* **rooms** 10 / 100 / 1,000: 2,000 events over the rooms, 200 destinations, 20 per
  room (every destination gets the same 200 events whatever the number of rooms:
  40,000 PDUs, spread over more rooms, more membership lookups, more
  ``destination_rooms`` rows);
* **events** 1,000 / 5,000 / 20,000: 10 rooms, 200 destinations, 50 per room
  (PDUs = 50 x events).

Each point runs in a fresh child process (so its peak RSS is its own) against a fresh
database of one shared PostgreSQL cluster (``synchronous_commit = off``) and the same
receiver process (FakeHomeserver, another process). Per point: rooms and memberships
written, the worker started, a warm-up event per room delivered (queues and
connections exist, as on a live server), then all events written (not timed: the main
process's cost) and the engine poked once; timed until every PDU was delivered.
Printed: wall time, the engine process's CPU time, transactions and PDUs per second,
CPU per PDU, RSS before the poke and peak RSS (``VmHWM``), and the receiver process's
CPU over the whole point (setup and warm-up included; it parses every body, and on two
cores it is often what bounds the wall time).

    .venv/bin/python bench/scaling.py [--sweeps destinations,rooms,events] \
        [--destinations 50,200,1000] [--rooms 10,100,1000] [--events 1000,5000,20000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import ME, RecordingSender, build_rooms, clock, receivers, rss_mb, url_for

from federation_sender.config import QueueSettings
from federation_sender.queue.manager import QueueManager
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.http_sender import HttpTransactionSender
from federation_sender.testing.postgres import ephemeral_cluster
from federation_sender.testing.queue_writer import HomeserverWriter

HERE = Path(__file__).resolve()


@dataclass(frozen=True)
class Point:
    sweep: str
    destinations: int
    rooms: int
    per_room: int
    events: int

    @property
    def pdus(self) -> int:
        return self.events * self.per_room


def vm_hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def measure(p: Point, db_url: str, receiver: str) -> dict[str, Any]:
    engine = create_engine(db_url, pool_size=20)
    await upgrade(engine)
    try:
        t_setup = time.perf_counter()
        rooms = await build_rooms(engine, p.destinations, p.rooms, p.per_room)
        writer = await HomeserverWriter(engine, ME).init()
        inner = HttpTransactionSender(url_for([receiver]), ME, clock(), timeout_s=60)
        sender = RecordingSender(inner, keep=False)
        m = QueueManager(NativeBackend(engine), sender.inner, QueueSettings(), ME, "bench", clock(),
                         random.Random(1), lambda _d: True, attempt_deadline_s=60)
        await m.start()
        sender.target_pdus = p.rooms * p.per_room
        await writer.messages_in_rooms([(r, f"@alice:{ME}") for r in rooms])
        m.notify_new_events(writer.stream_ordering)
        await asyncio.wait_for(sender.done.wait(), 300)
        sender.done.clear()
        sender.ok_pdus = sender.ok_txns = 0
        sender.target_pdus = p.pdus
        await writer.messages_in_rooms(
            [(rooms[i % len(rooms)], f"@alice:{ME}") for i in range(p.events)])
        t_setup = time.perf_counter() - t_setup
        rss_before = rss_mb()
        t0 = time.perf_counter()
        c0 = time.process_time()
        m.notify_new_events(writer.stream_ordering)
        await asyncio.wait_for(sender.done.wait(), 600)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        await m.stop(5)
        await inner.close()
        return {**asdict(p), "setup_s": t_setup, "wall_s": wall, "cpu_s": cpu,
                "txns": sender.ok_txns, "delivered": sender.ok_pdus, "pdus": p.pdus,
                "rss_before_mb": rss_before, "peak_rss_mb": vm_hwm_mb()}
    finally:
        await engine.dispose()


def points(a: argparse.Namespace) -> list[Point]:
    out: list[Point] = []
    sweeps = a.sweeps.split(",")
    if "destinations" in sweeps:
        out += [Point("destinations", n, 10, n, 500) for n in _ints(a.destinations)]
    if "rooms" in sweeps:
        out += [Point("rooms", 200, r, 20, 2000) for r in _ints(a.rooms)]
    if "events" in sweeps:
        out += [Point("events", 200, 10, 50, e) for e in _ints(a.events)]
    return out


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def children_cpu_s() -> float:
    """CPU seconds used so far by this process's multiprocessing children (receivers)."""
    total = 0
    for c in mp.active_children():
        with open(f"/proc/{c.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def run_child(p: Point, db_url: str, receiver: str) -> dict[str, Any]:
    rx0 = children_cpu_s()
    proc = subprocess.run(
        [sys.executable, str(HERE), "--child", json.dumps(asdict(p)), "--db-url", db_url,
         "--receiver", receiver],
        capture_output=True, text=True, timeout=900, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r: dict[str, Any] = json.loads(line[7:])
            r["receiver_cpu_s"] = children_cpu_s() - rx0
            return r
    sys.stderr.write(proc.stdout + proc.stderr)
    raise SystemExit(f"child for {p} failed ({proc.returncode})")


COLUMNS = [
    ("destinations", "destinations", "{:,}"),
    ("rooms", "rooms", "{:,}"),
    ("events", "events", "{:,}"),
    ("PDUs", "pdus", "{:,}"),
    ("txns", "txns", "{:,}"),
    ("wall s", "wall_s", "{:.2f}"),
    ("CPU s", "cpu_s", "{:.2f}"),
    ("txn/s", "txn_per_s", "{:,.0f}"),
    ("PDUs/s", "pdu_per_s", "{:,.0f}"),
    ("CPU µs/PDU", "cpu_us_per_pdu", "{:.1f}"),
    ("CPU ms/txn", "cpu_ms_per_txn", "{:.2f}"),
    ("receiver CPU s", "receiver_cpu_s", "{:.1f}"),
    ("RSS before MB", "rss_before_mb", "{:.0f}"),
    ("peak RSS MB", "peak_rss_mb", "{:.0f}"),
]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(c[0] for c in COLUMNS) + " |",
             "|" + "---:|" * len(COLUMNS)]
    for r in rows:
        r = dict(r, txn_per_s=r["txns"] / r["wall_s"], pdu_per_s=r["delivered"] / r["wall_s"],
                 cpu_us_per_pdu=1e6 * r["cpu_s"] / max(1, r["delivered"]),
                 cpu_ms_per_txn=1e3 * r["cpu_s"] / max(1, r["txns"]))
        lines.append("| " + " | ".join(fmt.format(r[k]) for _, k, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweeps", default="destinations,rooms,events")
    ap.add_argument("--destinations", default="50,200,1000")
    ap.add_argument("--rooms", default="10,100,1000")
    ap.add_argument("--events", default="1000,5000,20000")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--db-url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--receiver", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        r = asyncio.run(measure(Point(**json.loads(a.child)), a.db_url, a.receiver))
        print("RESULT " + json.dumps(r), flush=True)
        return
    results: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    with receivers(1) as urls, ephemeral_cluster() as cluster:
        cluster.psql("ALTER SYSTEM SET synchronous_commit = off")
        cluster.psql("SELECT pg_reload_conf()")
        for i, p in enumerate(points(a)):
            url = cluster.create_database(f"scale{i}")
            r = run_child(p, url, urls[0])
            results.append(r)
            print(f"{p.sweep:>12}: {p.destinations:>5} dests {p.rooms:>5} rooms "
                  f"{p.events:>6} events -> {r['delivered']:>8} PDUs in {r['txns']:>6} txns, "
                  f"{r['wall_s']:6.2f} s wall, {r['cpu_s']:6.2f} s CPU, "
                  f"peak RSS {r['peak_rss_mb']:.0f} MB, receiver CPU {r['receiver_cpu_s']:.1f} s",
                  flush=True)
    for sweep in dict.fromkeys(r["sweep"] for r in results):
        print(f"\n== scaling with {sweep}\n")
        print(table([r for r in results if r["sweep"] == sweep]))
    print(f"\n(total {time.perf_counter() - t_all:.0f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
