"""Benchmark of the Spark batch jobs against the same computations as SQL inside
PostgreSQL, on synthetic histories of several sizes.

    .venv/bin/python bench/batch.py --sizes 100000,1000000,5000000 --scaling-size 1000000

For each size: a fresh database on a throwaway PostgreSQL cluster, filled with COPY by a
generator that simulates rooms (skewed sizes), membership churn (joins, leaves, kicks),
local and remote messages, and the worker's own tables (transactions of <= 50 PDUs, a few
failures and lost transactions, destination_rooms with a few wrong rows). Then each job
runs on Spark (one local session for the whole run; job time excludes its start) and as
SQL, with wall time and peak memory: the Spark JVM's plus the Python driver's RSS, or
the PostgreSQL backend's RSS (which includes the shared buffers it touched), sampled
every 100 ms. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.batch_baseline import run_query
from federation_sender.batch.arguments import add_batch_parser
from federation_sender.batch.cli import run_batch
from federation_sender.batch.session import SessionOptions, build_session
from federation_sender.config import DatabaseSettings, Settings
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.postgres import ephemeral_cluster

OUR = "us.example"
JOBS = ("backfill-destination-rooms", "audit", "health-report")
SQL_FOR_JOB = {
    "backfill-destination-rooms": ["backfill-destination-rooms"],
    "audit": ["audit", "backfill-destination-rooms"],  # undelivered + mismatches
    "health-report": ["health-report"],
}


# --- synthetic history --------------------------------------------------------------------

def generate(url: str, n_events: int, seed: int = 1) -> dict[str, int]:
    rng = random.Random(seed)
    n_rooms = max(20, n_events // 500)
    servers = [f"s{i}.example" for i in range(300)]
    weights = [1 / (i + 1) ** 0.9 for i in range(n_rooms)]
    cum: list[float] = []
    acc = 0.0
    for w in weights:
        acc += w
        cum.append(acc)
    joined: dict[str, dict[str, str]] = defaultdict(dict)       # room -> user -> server
    server_users: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    buffers: dict[str, list[str]] = defaultdict(list)
    latest: dict[tuple[str, str], int] = {}
    delivered_max: dict[str, int] = defaultdict(int)
    counts = defaultdict(int)
    so = 0
    ts0 = 1_700_000_000_000
    txn_id = 0

    conns = [psycopg.connect(url) for _ in range(3)]
    cur_e, cur_m, cur_t = (c.cursor() for c in conns)
    with (cur_e.copy("COPY events (stream_ordering, event_id, room_id, type, state_key, sender,"
                     " origin_server_ts, outlier, rejected, json) FROM STDIN") as ce,
          cur_m.copy("COPY room_memberships (event_id, event_stream_ordering, room_id, user_id,"
                     " server_name, sender, membership) FROM STDIN") as cm,
          cur_t.copy("COPY federation_transaction_log (txn_id, destination, pdu_count,"
                     " edu_count, request_bytes, status, http_status, started_ts, duration_ms,"
                     " catchup, max_stream_ordering, pdu_event_ids) FROM STDIN") as ct):

        def flush(dest: str, last_so: int) -> None:
            nonlocal txn_id
            ids = buffers.pop(dest)
            ts = ts0 + last_so * 20
            dur = int(rng.lognormvariate(4, 0.8))
            catchup = rng.random() < 0.02
            r = rng.random()
            if r < 0.03:   # a failure, then the retry succeeds
                txn_id += 1
                ct.write_row((f"t{txn_id}", dest, len(ids), 0, 900 * len(ids), "transient",
                              502, ts, dur * 20, catchup, None, json.dumps(ids)))
                ts += 600_000
            txn_id += 1
            if r > 0.999:  # lost: logged as a permanent failure, never resent
                ct.write_row((f"t{txn_id}", dest, len(ids), 0, 900 * len(ids), "permanent",
                              400, ts, dur, catchup, None, json.dumps(ids)))
                counts["lost_transactions"] += 1
                return
            ct.write_row((f"t{txn_id}", dest, len(ids), 0, 900 * len(ids), "success", 200,
                          ts, dur, catchup, last_so, json.dumps(ids)))
            delivered_max[dest] = max(delivered_max[dest], last_so)

        def emit(room: str, sender: str, etype: str = "m.room.message",
                 member: tuple[str, str, str] | None = None) -> None:
            nonlocal so
            so += 1
            eid = f"$e{so}"
            outlier = rng.random() < 0.003
            ce.write_row((so, eid, room, etype, member[0] if member else None, sender,
                          ts0 + so * 20, outlier, False, "{}"))
            local = sender.endswith(":" + OUR) and not outlier
            before = {s for s, n in server_users[room].items() if n > 0} if local else set()
            if member is not None:
                user, srv, membership = member
                cm.write_row((eid, so, room, user, srv, sender, membership))
                was = joined[room].pop(user, None)
                if was is not None:
                    server_users[room][was] -= 1
                if membership == "join":
                    joined[room][user] = srv
                    server_users[room][srv] += 1
            if local:
                after = {s for s, n in server_users[room].items() if n > 0}
                for dest in (before | after) - {OUR}:
                    latest[(dest, room)] = so
                    buf = buffers[dest]
                    buf.append(eid)
                    if len(buf) >= 50:
                        flush(dest, so)

        for r in range(n_rooms):
            room = f"!room{r}"
            emit(room, f"@admin:{OUR}", "m.room.member", (f"@admin:{OUR}", OUR, "join"))
            k = min(80, int(rng.paretovariate(1.1) * 2))
            for s in rng.sample(servers, k):
                u = f"@u{rng.randrange(3)}:{s}"
                emit(room, u, "m.room.member", (u, s, "join"))
        while so < n_events:
            room = f"!room{rng.choices(range(n_rooms), cum_weights=cum)[0]}"
            x = rng.random()
            members = joined[room]
            if x < 0.06:
                if x < 0.03 or len(members) < 3:
                    s = rng.choice(servers)
                    u = f"@u{rng.randrange(3)}:{s}"
                    emit(room, u, "m.room.member", (u, s, "join"))
                else:
                    u = rng.choice(list(members))
                    srv = members[u]
                    if srv == OUR:
                        continue
                    kicker = f"@admin:{OUR}" if x < 0.04 else u
                    emit(room, kicker, "m.room.member", (u, srv, "leave"))
            else:
                remote = [u for u in members if not u.endswith(":" + OUR)]
                sender = f"@admin:{OUR}" if rng.random() < 0.3 or not remote else rng.choice(
                    remote)
                emit(room, sender)
        for dest in list(buffers):
            flush(dest, so)
    for c in conns:
        c.commit()
        c.close()
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        with cur.copy("COPY destination_rooms FROM STDIN") as cp:
            for (dest, room), s in latest.items():
                if rng.random() < 0.005:
                    s = max(1, s - 7)    # a wrong row for the jobs to find
                    counts["wrong_rows"] += 1
                cp.write_row((dest, room, s))
        with cur.copy("COPY destinations (destination, last_successful_stream_ordering)"
                      " FROM STDIN") as cp:
            for dest, s in delivered_max.items():
                cp.write_row((dest, s))
        conn.commit()
        conn.execute("ANALYZE")
    counts.update(events=so, rooms=n_rooms, destination_rooms=len(latest),
                  transactions=txn_id)
    return dict(counts)


# --- measuring ----------------------------------------------------------------------------

def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


@contextmanager
def peak_rss(pids: Callable[[], list[int]]) -> Iterator[list[int]]:
    """Sample the summed RSS of ``pids()`` every 100 ms; yields [peak_kb]."""
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], sum(rss_kb(p) for p in pids()))
            stop.wait(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        yield peak
    finally:
        stop.set()
        th.join()


def spark_pids(spark: Any) -> list[int]:
    jvm = spark.sparkContext._gateway.proc.pid
    kids = []
    for p in Path("/proc").iterdir():   # python workers forked by the JVM's daemon
        if p.name.isdigit():
            try:
                ppid = int(p.joinpath("stat").read_text().split()[3])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == jvm:
                kids.append(int(p.name))
    return [os.getpid(), jvm, *kids]


def run_spark(spark: Any, url: str, job: str, partitions: int, out_dir: str) -> tuple[float, int]:
    parser = argparse.ArgumentParser()
    add_batch_parser(parser.add_subparsers(dest="command"))
    argv = ["batch", job, "--json", "--quiet", "--partitions", str(partitions)]
    if job == "backfill-destination-rooms":
        argv.append("--dry-run")
    if job == "health-report":
        argv += ["--output", out_dir]
    args = parser.parse_args(argv)
    settings = Settings(server_name=OUR, database=DatabaseSettings(url=url))
    out = io.StringIO()
    with peak_rss(lambda: spark_pids(spark)) as peak:
        t0 = time.perf_counter()
        status = run_batch(args, settings, spark=spark, out=out)
        took = time.perf_counter() - t0
    if status not in (0, 4):
        raise RuntimeError(f"{job} failed with {status}")
    return took, peak[0]


def run_sql(url: str, job: str, work_mem: str) -> tuple[float, int]:
    total = 0.0
    peak_kb = 0
    for q in SQL_FOR_JOB[job]:
        # run_query opens its own connection: sample every backend of this database.
        with peak_rss(lambda: backend_pids(url)) as peak:
            t0 = time.perf_counter()
            run_query(url, q, OUR, horizon_ms=int(time.time() * 1000), work_mem=work_mem)
            total += time.perf_counter() - t0
        peak_kb = max(peak_kb, peak[0])
    return total, peak_kb


def backend_pids(url: str) -> list[int]:
    dbname = url.rsplit("/", 1)[1]
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = p.joinpath("cmdline").read_bytes()
            except OSError:
                continue
            if cmd.startswith(b"postgres:") and f" {dbname} ".encode() in cmd:
                out.append(int(p.name))
    return out


async def _migrate(url: str) -> None:
    eng = create_engine(url)
    try:
        await upgrade(eng)
    finally:
        await eng.dispose()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100000,1000000,5000000")
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--scaling-size", type=int, default=1_000_000)
    ap.add_argument("--scaling-partitions", default="1,2,4,8")
    ap.add_argument("--driver-memory", default="4g")
    ap.add_argument("--work-mem", default="256MB")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",") if s]
    jobs = [j for j in a.jobs.split(",") if j]
    t0 = time.perf_counter()
    spark = build_session(SessionOptions(master="local[*]", shuffle_partitions=a.partitions,
                                         conf={"spark.driver.memory": a.driver_memory}))
    print(f"Spark session start: {time.perf_counter() - t0:.1f} s "
          f"(local[*], {os.cpu_count()} cores, driver memory {a.driver_memory})", flush=True)
    rows: list[str] = []
    scaling: list[str] = []
    with ephemeral_cluster() as cluster:
        for n in sizes:
            url = cluster.create_database(f"bench{n}")
            asyncio.run(_migrate(url))
            t0 = time.perf_counter()
            info = generate(url, n)
            gen_s = time.perf_counter() - t0
            size = cluster.psql(f"SELECT pg_size_pretty(pg_database_size('bench{n}'))").strip()
            print(f"\n{n:,} events: generated in {gen_s:.0f} s, {info}, database {size}",
                  flush=True)
            # Warm the page cache for both sides alike.
            cluster.psql("SELECT count(*) FROM events; SELECT count(*) FROM room_memberships;"
                         " SELECT count(*) FROM federation_transaction_log;", f"bench{n}")
            for job in jobs:
                st, sm = run_spark(spark, url, job, a.partitions, f"/tmp/bench-health-{n}")
                qt, qm = run_sql(url, job, a.work_mem)
                line = (f"| {job} | {n:,} | {st:.1f} s | {sm / 1024:.0f} MB | {qt:.1f} s "
                        f"| {qm / 1024:.0f} MB |")
                rows.append(line)
                print(line, flush=True)
            if n == a.scaling_size:
                for p in [int(x) for x in a.scaling_partitions.split(",")]:
                    st, _ = run_spark(spark, url, "backfill-destination-rooms", p, "/tmp/x")
                    line = f"| {n:,} | {p} | {st:.1f} s |"
                    scaling.append(line)
                    print(line, flush=True)
            cluster.psql(f'DROP DATABASE "bench{n}"')
    spark.stop()
    print("\n| job | events | Spark time | Spark peak RSS | SQL time "
          "| PostgreSQL backend peak RSS |")
    print("|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    if scaling:
        print("\n| events | partitions | backfill (dry run) time |")
        print("|---:|---:|---:|")
        print("\n".join(scaling))


if __name__ == "__main__":
    main()
