"""The send-time read's own cost (``storage/synapse/send_time.py``), on Synapse's schema.

A throwaway PostgreSQL cluster holds a schema Synapse made itself, filled with
``--events`` messages in 10 rooms, 1 % of them redacted (a tenth of those by another
server's user, a recheck asked for), ``--erased`` erased users and a few MSC4293 ban
redactions, then ``ANALYZE``d. Measured, one question at a time (each its own read), for
transactions of 1, 12 (the spike's mean) and 50 PDUs:

* ``wall_ms`` p50 / p99: from the question to its answer (the time a transaction waits);
* ``worker_cpu_ms``: this process's CPU per read;
* ``db_cpu_ms``: the PostgreSQL backend's CPU per read (``/proc/PID/stat`` of the
  backends named ``send-time-bench``);

and the spike's shape: ``--queues`` questions about the same 12 PDUs asked at once (a
room's servers given the same PDUs), answered by gathered reads: reads, wall time until
the last answer, CPU per question; ``db_slots`` 16 asks them as the runner does, each
question holding one of the queue manager's 16 database slots (``db_concurrency``),
``db_slots`` none without that limit. End to end, with and without the check in one run:
``bench/synapse_compare.py --senders ours unfiltered`` (docs/benchmarks.md).

    .venv/bin/python bench/send_time_cost.py [--events 50000] [--calls 2000] [--queues 415]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from federation_sender.aio.slots import Slots
from federation_sender.storage.synapse.database import create_synapse_engine
from federation_sender.storage.synapse.send_time import SynapseSendTime
from federation_sender.testing.postgres import PostgresCluster, ephemeral_cluster
from federation_sender.testing.synapse_install import synapse_python
from federation_sender.testing.synapse_schema import create_synapse_schema

APP = "send-time-bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")

FILL = """
INSERT INTO rooms (room_id, is_public, creator, room_version)
SELECT '!room' || r || ':a.test', false, '@c:a.test', '10' FROM generate_series(0, 9) r;
INSERT INTO events (topological_ordering, event_id, type, room_id, processed, outlier, depth,
    origin_server_ts, received_ts, sender, instance_name, stream_ordering)
SELECT i, '$e' || i, 'm.room.message', '!room' || (i % 10) || ':a.test', true, false, i, i, i,
    '@u' || (i % 1000) || ':a.test', 'master', i FROM generate_series(1, {n}) i;
INSERT INTO event_json (event_id, room_id, internal_metadata, json, format_version)
SELECT '$e' || i, '!room' || (i % 10) || ':a.test', '{{}}',
    '{{"type":"m.room.message","content":{{"body":"hello"}}}}', 3 FROM generate_series(1, {n}) i;
INSERT INTO events (topological_ordering, event_id, type, room_id, processed, outlier, depth,
    origin_server_ts, received_ts, sender, instance_name, stream_ordering)
SELECT {n} + i, '$r' || i, 'm.room.redaction', '!room' || ((i * 100) % 10) || ':a.test', true,
    false, i, i, i, CASE WHEN i % 10 = 0 THEN '@mod:b.test' ELSE '@u' || ((i * 100) % 1000)
    || ':a.test' END, 'master', {n} + i FROM generate_series(1, {n} / 100) i;
INSERT INTO event_json (event_id, room_id, internal_metadata, json, format_version)
SELECT '$r' || i, '!room' || ((i * 100) % 10) || ':a.test',
    CASE WHEN i % 10 = 0 THEN '{{"recheck_redaction":true}}' ELSE '{{}}' END, '{{}}', 3
FROM generate_series(1, {n} / 100) i;
INSERT INTO redactions (event_id, redacts, received_ts)
SELECT '$r' || i, '$e' || (i * 100), 0 FROM generate_series(1, {n} / 100) i;
INSERT INTO erased_users (user_id) SELECT '@u' || (i * 7) || ':a.test'
FROM generate_series(1, {erased}) i;
INSERT INTO room_ban_redactions (room_id, user_id, redacting_event_id)
SELECT '!room' || (i % 10) || ':a.test', '@u' || (i * 13) || ':a.test', '$r1'
FROM generate_series(1, 20) i;
ANALYZE;
"""


def backends_cpu_s(cluster: PostgresCluster) -> float:
    out = cluster.psql("SELECT pid FROM pg_stat_activity WHERE application_name = "
                       f"'{APP}' AND pid <> pg_backend_pid()")  # not this psql's own
    total = 0.0
    for pid in out.split():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def question(k: int, size: int, n: int) -> tuple[list[str], set[str]]:
    """``size`` consecutive recent events (a transaction's), starting near event ``k``."""
    start = n - 5000 + (k * size) % 4900
    ids = [f"$e{start + j}" for j in range(size)]
    return ids, {f"@u{(start + j) % 1000}:a.test" for j in range(size)}


async def one_at_a_time(reader: SynapseSendTime, cluster: PostgresCluster, size: int,
                        calls: int, n: int) -> dict[str, object]:
    await reader.send_time_facts(*question(0, size, n))  # connection made, statement cached
    walls: list[float] = []
    redacted = erased = 0
    cpu0, db0 = time.process_time(), backends_cpu_s(cluster)
    for k in range(calls):
        t0 = time.perf_counter()
        facts = await reader.send_time_facts(*question(k, size, n))
        walls.append(time.perf_counter() - t0)
        redacted += len(facts.redacted)
        erased += len(facts.erased_senders)
    cpu, db = time.process_time() - cpu0, backends_cpu_s(cluster) - db0
    q = statistics.quantiles(walls, n=100, method="inclusive")
    return {"pdus": size, "calls": calls, "wall_ms_p50": round(q[49] * 1000, 3),
            "wall_ms_p99": round(q[98] * 1000, 3),
            "worker_cpu_ms": round(1000 * cpu / calls, 4),
            "db_cpu_ms": round(1000 * db / calls, 4),
            "redacted_found": redacted, "erased_found": erased}


async def together(reader: SynapseSendTime, cluster: PostgresCluster, queues: int,
                   n: int, slots: int | None) -> dict[str, object]:
    ids, senders = question(7, 12, n)
    limit = Slots(slots) if slots is not None else None

    async def ask() -> None:
        if limit is None:
            await reader.send_time_facts(ids, senders)
            return
        async with limit:
            await reader.send_time_facts(ids, senders)

    reads0 = reader.reads
    cpu0, db0 = time.process_time(), backends_cpu_s(cluster)
    t0 = time.perf_counter()
    await asyncio.gather(*(ask() for _ in range(queues)))
    wall = time.perf_counter() - t0
    cpu, db = time.process_time() - cpu0, backends_cpu_s(cluster) - db0
    return {"questions": queues, "pdus": 12, "db_slots": slots, "reads": reader.reads - reads0,
            "wall_ms": round(wall * 1000, 3),
            "worker_cpu_ms_per_question": round(1000 * cpu / queues, 4),
            "db_cpu_ms_per_question": round(1000 * db / queues, 4)}


async def measure(url: str, cluster: PostgresCluster, a: argparse.Namespace) -> None:
    os.environ["PGAPPNAME"] = APP
    engine = create_synapse_engine(url, pool_size=1)
    try:
        reader = SynapseSendTime(engine)
        for size in (1, 12, 50):
            print(json.dumps(await one_at_a_time(reader, cluster, size, a.calls, a.events)),
                  flush=True)
        for _ in range(3):
            for slots in (16, None):
                print(json.dumps(await together(reader, cluster, a.queues, a.events, slots)),
                      flush=True)
    finally:
        await engine.dispose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=50_000)
    p.add_argument("--erased", type=int, default=200)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--queues", type=int, default=415)
    a = p.parse_args(argv)
    with ephemeral_cluster() as cluster:
        url = create_synapse_schema(cluster, "send_time_bench", synapse_python())
        cluster.psql(FILL.format(n=a.events, erased=a.erased), dbname="send_time_bench")
        asyncio.run(measure(url, cluster, a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
