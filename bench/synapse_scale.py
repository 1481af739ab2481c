"""The batch jobs at Synapse scale: a generated deployment of 10,000,000
``destination_rooms`` rows on Synapse's own schema, the Spark jobs on it in local mode
and on a standalone cluster of two workers, beside the audit as one plain query.

    .venv/bin/python bench/synapse_scale.py generate --rows 1000000
    .venv/bin/python bench/synapse_scale.py check    --rows 200000
    .venv/bin/python bench/synapse_scale.py run      --rows 1000000 --modes local,standalone

``generate`` makes (or reuses) a PostgreSQL cluster under ``--workdir`` (default
``artifacts/synapse-scale``), a database ``synscale_<rows>`` whose schema Synapse
itself created (``update_synapse_database``, as the test suite does), our schema beside
it migrated by ``federation-sender migrate -c ours.yaml --synapse-config
homeserver.yaml``, and fills it with ``INSERT … SELECT`` over ``generate_series``
inside PostgreSQL (no Python row loops; deterministic: every choice is a hash of the
row's indices and ``--seed``). What it makes, for ``--rows N``:

* ``N / 200`` destinations and ``N / 50`` rooms. Half the rooms are small (1-4 remote
  servers: DMs and private groups); the other half have Zipf-distributed servers:
  ``k(rank) = Kmax * rank^-a`` with ``Kmax = 10,000 * sqrt(N / 10^7)`` (at most every
  destination) and ``a`` solved so that ``destination_rooms`` has about ``N`` rows
  (a ≈ 0.45 at 10M: the biggest rooms have thousands of servers). A room's servers are
  a window of the destinations starting at a skewed offset, so the first destinations
  (a matrix.org) are in many rooms.
* Per room one local member (``@userX:us.example``), the create event, one join per
  remote server (its user's membership; 3 % of them leave at the end), ``3 + 0.3 k``
  messages (40 % local, 0.1 % of those flagged ``proactively_send: false``; of the
  remote ones 1 % outliers and 0.5 % rejected), interleaved in the room's time window
  (rooms start during a year, some go quiet months before the end); stream orderings
  in time order across rooms. 10 % of rooms have backfilled history (negative stream
  orderings). ``event_json`` has each event's JSON and internal metadata.
* ``current_state_events`` + ``room_memberships`` for every member's latest event.
* ``destinations``: 88 % healthy (position = the sender's); 5 % backing off (retry
  ahead, position in the last 3 % of the stream), 2 % with the retry due, 3 % behind
  with no backoff, 1.5 % down for days (position at 50-90 % of the stream), 0.5 % with
  no position.
* ``destination_rooms``: every pair's newest sendable local event; planted: 0.2 % of
  pairs with no row, 0.2 % with an older row.
* Our transaction log: from 60 % of the stream on (our worker's adoption), every pair's
  newest event in a successful transaction when the destination's position is past it
  (up to 50 PDUs a transaction); planted: 0.1 % of those pairs never carried (half
  logged as a permanent failure): lost. Half the events a down destination is owed
  are logged as failed attempts.
* ``federation_stream_position``: the sender ``federation_sender1`` just below the
  0.05 % newest local events: their rooms are ``sender_behind``.
* one local user erased (its rooms owe nothing), 0.1 % of rooms in partial state.

The expected class of every (destination, room) follows from these choices; the
generator writes the counts to ``synscale.expected`` (a small side schema the jobs
do not read) and ``check`` compares the plain query
(``bench/synapse_batch_baseline.py``) and the Spark audit with them.

``run`` times each job (``audit``, ``health-report``, ``backfill-destination-rooms
--dry-run``) as an operator runs it (``federation-sender batch … --synapse-config
homeserver.yaml``, one process per job), in local mode and on a standalone cluster
(a master and two workers of one core each, started from pyspark's own installation
with ``bin/spark-class``; the pip package ships no ``sbin/start-master.sh``), beside
the plain query; peak RSS of the driver's and the executors' JVMs from /proc, sampled
every 200 ms. Results go to ``--workdir``/results.json and are printed as a table with
the growth between the sizes measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.synapse_batch_baseline import run_counts  # noqa: E402
from federation_sender.testing.ports import free_port  # noqa: E402
from federation_sender.testing.postgres import PostgresCluster, find_pg_bin  # noqa: E402

OUR = "us.example"
INSTANCE = "federation_sender1"
JOBS = ("audit", "health-report", "backfill-destination-rooms")
DAY_MS = 86_400_000
JDBC_JAR = "/usr/share/java/postgresql.jar"


# --- parameters ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Params:
    rows: int
    destinations: int
    rooms: int
    kmax: int
    a: float
    seed: int = 1
    small_max: int = 4
    messages_per_server: float = 0.3
    local_frac: float = 0.4
    not_proactive_frac: float = 0.001
    outlier_frac: float = 0.01
    rejected_frac: float = 0.005
    leave_frac: float = 0.03
    backfill_frac: float = 0.1
    p_no_row: float = 0.002
    p_row_behind: float = 0.002
    p_lost: float = 0.001
    log_from_frac: float = 0.6
    txn_buckets: int = 50
    local_users: int = 10
    now_ms: int = 0

    @property
    def pair_target(self) -> int:
        """Memberships to make so that ``destination_rooms`` gets about ``rows``: some
        joins come after the room's newest local event (no row), some rows are
        planted missing."""
        return math.ceil(self.rows / 0.9)


def zipf_sizes(ranks: int, kmax: int, a: float, cap: int) -> Any:
    import numpy as np

    r = np.arange(1, ranks + 1, dtype=np.float64)
    return np.clip(np.floor(kmax * r ** -a), 1, cap)


def derive(rows: int, seed: int = 1, now_ms: int | None = None,
           destinations: int | None = None, rooms: int | None = None) -> Params:
    """The world of ``--rows``: 1 destination per 200 rows, 1 room per 50 (at least
    50 and 20), the Zipf exponent solved for the row count."""
    d = destinations or max(50, rows // 200)
    r = rooms or max(20, rows // 50)
    kmax = min(d, max(4, int(10_000 * math.sqrt(rows / 10_000_000))))
    zipf_rooms = (r + 1) // 2
    small = (r // 2) * 2.5
    target = Params(rows, d, r, kmax, 0.0).pair_target - small
    lo, hi = 0.0, 3.0
    for _ in range(60):  # the sum falls as a grows
        mid = (lo + hi) / 2
        if zipf_sizes(zipf_rooms, kmax, mid, d).sum() > target:
            lo = mid
        else:
            hi = mid
    return Params(rows, d, r, kmax, round(lo, 6), seed=seed,
                  local_users=max(10, r // 40),
                  now_ms=now_ms if now_ms is not None else int(time.time() * 1000))


# --- generation (SQL inside PostgreSQL) -------------------------------------------------

def _functions(seed: int) -> str:
    s = int(seed)
    return f"""
DROP SCHEMA IF EXISTS synscale CASCADE;
CREATE SCHEMA synscale;
CREATE FUNCTION synscale.u(a bigint, b bigint, salt int) RETURNS float8
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT (hashint8extended(a * 1000003 + b, salt + {s * 1000}) & 281474976710655)::float8
         / 281474976710656.0 $$;
CREATE FUNCTION synscale.eid(so bigint) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT '$' || rtrim(translate(encode(sha256(int8send(so) || int4send({s})), 'base64'),
                                '+/', '-_'), '=') $$;
CREATE FUNCTION synscale.dname(d int) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 'srv' || d || '.example.org' $$;
"""


ROOM = """
CREATE UNLOGGED TABLE synscale.room AS
SELECT x.ridx, x.k, mm.m, 2 + x.k + mm.m AS n, x.o, x.t0,
       greatest(x.t1, x.t0 + 3600000) AS t1,
       '!' || substr(translate(encode(sha256(int8send(x.ridx) || '\\x72'::bytea),
                                      'base64'), '+/=', 'XYZ'), 1, 18)
           || ':' || %(server)s AS room_id,
       '@user' || mod(x.ridx, %(lu)s) || ':' || %(server)s AS local_user
FROM (
    SELECT r AS ridx,
           CASE WHEN mod(r, 2) = 0
                THEN greatest(1, least(%(D)s, floor(%(kmax)s * power(r / 2 + 1, -%(a)s))))::int
                ELSE 1 + floor(%(small_max)s * synscale.u(r, 0, 1))::int END AS k,
           floor(%(D)s * power(synscale.u(r, 0, 2), 3))::int AS o,
           %(t_start)s + floor(0.8 * %(span)s * synscale.u(r, 0, 3))::bigint AS t0,
           %(t_end)s - floor(0.5 * %(span)s * power(synscale.u(r, 0, 4), 3))::bigint AS t1
    FROM generate_series(0, %(R)s - 1) r
) x CROSS JOIN LATERAL (SELECT 3 + ceil(x.k * %(mps)s)::int AS m) mm;
ALTER TABLE synscale.room ADD PRIMARY KEY (ridx);
"""
"""Rooms: ``k`` remote servers (even indices Zipf by rank, odd ones small), ``m``
messages, ``n`` events, the servers' window offset ``o``, the active time window."""

TIMELINE = """
SET synchronize_seqscans = off;
CREATE UNLOGGED TABLE synscale.tl AS
SELECT so, synscale.eid(so) AS event_id, ridx, p, kind, j, ts FROM (
    SELECT row_number() OVER (ORDER BY ts, ridx, p) AS so, * FROM (
        SELECT r.ridx, g.p,
               CASE WHEN g.p = 0 THEN 'c' WHEN g.p = 1 THEN 'l'
                    WHEN x.is_join THEN 'j'
                    WHEN x.jb = 0 OR synscale.u(r.ridx, g.p, 9) < %(local_frac)s
                         THEN CASE WHEN synscale.u(r.ridx, g.p, 13) < %(np_frac)s
                                   THEN 'n' ELSE 'm' END
                    WHEN synscale.u(r.ridx, g.p, 10) < %(outlier_frac)s THEN 'o'
                    WHEN synscale.u(r.ridx, g.p, 10) < %(outlier_frac)s + %(rejected_frac)s
                         THEN 'r'
                    ELSE 'x' END AS kind,
               CASE WHEN g.p >= 2 AND x.is_join THEN x.jb::int
                    WHEN g.p >= 2 AND x.jb > 0
                         THEN floor(x.jb * synscale.u(r.ridx, g.p, 8))::int END AS j,
               r.t0 + floor((g.p + 0.2 + 0.6 * synscale.u(r.ridx, g.p, 6))
                            * (r.t1 - r.t0) / r.n)::bigint AS ts
        FROM synscale.room r
        CROSS JOIN LATERAL generate_series(0, r.n - 1) g(p)
        CROSS JOIN LATERAL (
            SELECT ((g.p - 2)::bigint * r.k) / (r.k + r.m) AS jb,
                   ((g.p - 1)::bigint * r.k) / (r.k + r.m)
                   > ((g.p - 2)::bigint * r.k) / (r.k + r.m) AS is_join) x
        UNION ALL
        SELECT r.ridx, r.n + l.j, 'v', l.j,
               r.t1 + 1 + floor((%(t_end)s - r.t1) * 0.9 * synscale.u(r.ridx, l.j, 7))::bigint
        FROM synscale.room r CROSS JOIN LATERAL generate_series(0, r.k - 1) l(j)
        WHERE synscale.u(r.ridx, l.j, 5) < %(leave_frac)s
    ) e
) n;
CREATE SEQUENCE synscale.backfill;
INSERT INTO synscale.tl (so, event_id, ridx, p, kind, j, ts)
SELECT so, synscale.eid(so), ridx, p, 'b', j, ts FROM (
    SELECT -nextval('synscale.backfill') AS so, r.ridx, -1 - b.i AS p,
           floor(r.k * synscale.u(r.ridx, b.i, 11))::int AS j,
           r.t0 - (b.i + 1) * 60000 AS ts
    FROM synscale.room r CROSS JOIN LATERAL generate_series(0, 1 + r.k / 20) b(i)
    WHERE synscale.u(r.ridx, 0, 12) < %(backfill_frac)s
) b;
"""
"""Every event: position ``p`` in its room, kind (``c`` create, ``l`` the local join,
``j``/``v`` a remote server's join/leave, ``m`` a local message, ``n`` one not to be
sent proactively, ``x`` a remote one, ``o`` an outlier, ``r`` rejected, ``b``
backfilled), ``j`` the remote server's index in the room (for a remote message: one
joined before it), time; stream orderings by time. The p-th event of a room is a join
when ``floor((q+1)k/(k+m)) > floor(qk/(k+m))`` (q = p - 2): the joins spread evenly
among the messages."""

PAIRS = """
CREATE UNLOGGED TABLE synscale.room_last AS
SELECT t.ridx, t.so AS l_so, t.event_id AS l_eid, t.ts AS l_ts
FROM (SELECT ridx, max(so) AS so FROM synscale.tl
      WHERE kind IN ('c', 'l', 'm') GROUP BY ridx) m
JOIN synscale.tl t ON t.so = m.so;
ALTER TABLE synscale.room_last ADD PRIMARY KEY (ridx);
CREATE UNLOGGED TABLE synscale.pair AS
SELECT t.ridx, t.j, mod(r.o + t.j, %(D)s) AS didx, t.so AS join_so,
       synscale.u(t.ridx, t.j, 5) < %(leave_frac)s AS gone,
       rl.l_so, rl.l_ts, synscale.u(t.ridx, t.j, 30) AS plant
FROM synscale.tl t JOIN synscale.room r USING (ridx) JOIN synscale.room_last rl USING (ridx)
WHERE t.kind = 'j';
"""
"""Per room its newest sendable event (``room_last``: the local user's newest create,
join or message); per (room, remote server) the join and the planted fate."""

STATS = """
SELECT max(so), count(*) FILTER (WHERE so > 0),
       count(*) FILTER (WHERE kind IN ('c', 'l', 'm')) FROM synscale.tl
"""
SENDER = """
SELECT so - 1 FROM synscale.tl WHERE kind IN ('c', 'l', 'm')
ORDER BY so DESC OFFSET %(behind)s LIMIT 1
"""
"""The sender's position: just below the ``behind``-th newest local event, so that the
rooms of the newest ones wait for it."""

DESTS = """
CREATE UNLOGGED TABLE synscale.dest AS
SELECT didx, synscale.dname(didx) AS destination, cat, pos, ri AS retry_interval,
       rlt AS retry_last_ts,
       CASE WHEN ri > 0 THEN least(rlt, %(t_start)s + floor(pos::float8 / %(hwm)s
                                                             * %(span)s)::bigint) END
           AS failure_ts
FROM (
    SELECT didx, cat, pos, ri,
           CASE cat WHEN 'backoff' THEN %(now)s - floor(ri * 0.9 * synscale.u(didx, 0, 23))
                    WHEN 'downlong' THEN %(now)s - floor(ri * 0.5 * synscale.u(didx, 0, 23))
                    WHEN 'due' THEN %(now)s - ri - 1000
                                    - floor(3600000 * synscale.u(didx, 0, 23))
                    ELSE 0 END::bigint AS rlt
    FROM (
        SELECT didx, cat,
               CASE cat WHEN 'healthy' THEN %(sender_so)s
                        WHEN 'fresh' THEN NULL
                        WHEN 'downlong'
                             THEN floor(%(sender_so)s * (0.5 + 0.4 * synscale.u(didx, 0, 21)))
                        ELSE floor(%(sender_so)s * (1 - 0.03 * synscale.u(didx, 0, 21)))
                   END::bigint AS pos,
               CASE cat WHEN 'backoff'
                             THEN 600000 * power(2, floor(8 * synscale.u(didx, 0, 22)))
                        WHEN 'due' THEN 600000 * power(2, floor(4 * synscale.u(didx, 0, 22)))
                        WHEN 'downlong' THEN 86400000 * (1 + floor(6 * synscale.u(didx, 0, 22)))
                        ELSE 0 END::bigint AS ri
        FROM (
            SELECT d AS didx,
                   CASE WHEN synscale.u(d, 0, 20) < 0.05 THEN 'backoff'
                        WHEN synscale.u(d, 0, 20) < 0.07 THEN 'due'
                        WHEN synscale.u(d, 0, 20) < 0.10 THEN 'behind'
                        WHEN synscale.u(d, 0, 20) < 0.105 THEN 'fresh'
                        WHEN synscale.u(d, 0, 20) < 0.12 THEN 'downlong'
                        ELSE 'healthy' END AS cat
            FROM generate_series(0, %(D)s - 1) d
        ) c
    ) p
) q;
ALTER TABLE synscale.dest ADD PRIMARY KEY (didx);
"""

# The planted fate of a pair, from its hash ``plant``.
_NO_ROW = "p.plant < %(p_no_row)s"
_ROW_BEHIND = "p.plant >= %(p_no_row)s AND p.plant < %(p_no_row)s + %(p_row_behind)s"
_LOST = ("p.plant >= %(p_no_row)s + %(p_row_behind)s"
         " AND p.plant < %(p_no_row)s + %(p_row_behind)s + %(p_lost)s")
_PAST = "(d.pos IS NOT NULL AND d.pos >= p.l_so)"

ENTRIES = f"""
CREATE UNLOGGED TABLE synscale.entry AS
SELECT p.didx, p.ridx, p.l_so, p.l_ts,
       CASE WHEN {_PAST} AND NOT ({_LOST}) THEN 'success'
            WHEN {_PAST} THEN 'permanent' ELSE 'transient' END AS status
FROM synscale.pair p JOIN synscale.dest d USING (didx)
WHERE p.l_so > p.join_so AND p.l_so >= %(log_from)s AND p.l_so <= %(sender_so)s
  AND (({_PAST} AND (NOT ({_LOST}) OR synscale.u(p.ridx, p.j, 32) < 0.5))
       OR (NOT {_PAST} AND synscale.u(p.ridx, p.j, 32) < 0.5));
"""
"""What our worker's log holds: a pair's newest event in a successful transaction
(position past it, not planted lost), a permanent failure (half the lost ones), a
transient failure (half of what a down destination is owed)."""

SYNAPSE_TABLES: tuple[tuple[str, str], ...] = (
    ("destinations", """
INSERT INTO destinations (destination, retry_last_ts, retry_interval, failure_ts,
                          last_successful_stream_ordering)
SELECT destination, retry_last_ts, retry_interval, failure_ts, pos FROM synscale.dest
ORDER BY destination;
"""),
    ("rooms", """
INSERT INTO rooms (room_id, is_public, creator, room_version, has_auth_chain_index)
SELECT room_id, synscale.u(ridx, 0, 14) < 0.2, local_user, '10', true FROM synscale.room
ORDER BY room_id;
"""),
    ("events", """
INSERT INTO events (topological_ordering, event_id, type, room_id, content,
                    unrecognized_keys, processed, outlier, depth, origin_server_ts,
                    received_ts, sender, contains_url, instance_name, stream_ordering,
                    state_key, rejection_reason)
SELECT t.p + 10000, t.event_id, v.type, r.room_id, NULL, NULL, true, t.kind = 'o',
       t.p + 10000, t.ts, t.ts + CASE WHEN v.local THEN 0 ELSE 40 + mod(t.so, 400) END,
       v.sender, false, 'master', t.so, v.state_key,
       CASE WHEN t.kind = 'r' THEN 'auth_error' END
FROM synscale.tl t JOIN synscale.room r USING (ridx)
CROSS JOIN LATERAL (
    SELECT t.kind IN ('c', 'l', 'm', 'n') AS local,
           CASE t.kind WHEN 'c' THEN 'm.room.create'
                       WHEN 'l' THEN 'm.room.member' WHEN 'j' THEN 'm.room.member'
                       WHEN 'v' THEN 'm.room.member' ELSE 'm.room.message' END AS type,
           CASE WHEN t.kind IN ('c', 'l', 'm', 'n') THEN r.local_user
                ELSE '@u' || mod(t.ridx + t.j, 997) || ':'
                     || synscale.dname(mod(r.o + t.j, %(D)s)) END AS sender,
           CASE t.kind WHEN 'c' THEN '' WHEN 'l' THEN r.local_user
                       WHEN 'j' THEN '@u' || mod(t.ridx + t.j, 997) || ':'
                                     || synscale.dname(mod(r.o + t.j, %(D)s))
                       WHEN 'v' THEN '@u' || mod(t.ridx + t.j, 997) || ':'
                                     || synscale.dname(mod(r.o + t.j, %(D)s)) END AS state_key
) v;
"""),
    ("event_json", """
INSERT INTO event_json (event_id, room_id, internal_metadata, json, format_version)
SELECT e.event_id, e.room_id,
       CASE t.kind
           WHEN 'n' THEN '{"proactively_send":false,"token_id":' || mod(t.ridx, 977) || '}'
           WHEN 'o' THEN '{"outlier":true}'
           WHEN 'm' THEN '{"token_id":' || mod(t.ridx, 977) || ',"txn_id":"m' || t.ts
                         || '.' || t.p || '","device_id":"DEV' || mod(t.ridx, 89) || '"}'
           WHEN 'c' THEN '{"token_id":' || mod(t.ridx, 977) || '}'
           WHEN 'l' THEN '{"token_id":' || mod(t.ridx, 977) || '}'
           ELSE '{}' END,
       '{"auth_events":[],"content":'
       || CASE e.type WHEN 'm.room.message'
                      THEN '{"body":"message ' || t.p || '","msgtype":"m.text"}'
                      WHEN 'm.room.member'
                      THEN '{"membership":"' || CASE t.kind WHEN 'v' THEN 'leave'
                                                             ELSE 'join' END || '"}'
                      ELSE '{"room_version":"10","creator":"' || e.sender || '"}' END
       || ',"depth":' || e.depth || ',"hashes":{"sha256":"'
       || rtrim(encode(sha256(convert_to(e.event_id, 'UTF8')), 'base64'), '=')
       || '"},"origin_server_ts":' || e.origin_server_ts || ',"prev_events":["'
       || synscale.eid(t.so - 1) || '"],"room_id":"' || e.room_id || '","sender":"'
       || e.sender || '",' || CASE WHEN e.state_key IS NOT NULL
                                   THEN '"state_key":"' || e.state_key || '",' ELSE '' END
       || '"type":"' || e.type || '","unsigned":{}}',
       3
FROM synscale.tl t JOIN events e ON e.stream_ordering = t.so;
"""),
    ("rejections", """
INSERT INTO rejections (event_id, reason, last_check)
SELECT event_id, 'auth_error', '1' FROM synscale.tl WHERE kind = 'r';
"""),
    ("room_memberships", """
INSERT INTO room_memberships (event_id, user_id, sender, room_id, membership, forgotten,
                              display_name, avatar_url, event_stream_ordering, participant)
SELECT e.event_id, e.state_key, e.sender, e.room_id,
       CASE t.kind WHEN 'v' THEN 'leave' ELSE 'join' END, 0,
       CASE WHEN t.kind <> 'v' THEN 'User ' || mod(t.ridx + coalesce(t.j, 0), 997) END,
       NULL, t.so, false
FROM synscale.tl t JOIN events e ON e.stream_ordering = t.so
WHERE t.kind IN ('l', 'j', 'v');
"""),
    ("current_state_events", """
INSERT INTO current_state_events (event_id, room_id, type, state_key, membership,
                                  event_stream_ordering)
SELECT e.event_id, e.room_id, e.type, e.state_key,
       CASE t.kind WHEN 'v' THEN 'leave' WHEN 'c' THEN NULL ELSE 'join' END, t.so
FROM synscale.tl t JOIN events e ON e.stream_ordering = t.so
WHERE t.kind IN ('c', 'l', 'v')
   OR (t.kind = 'j' AND NOT synscale.u(t.ridx, t.j, 5) < %(leave_frac)s);
"""),
    ("destination_rooms", f"""
INSERT INTO destination_rooms (destination, room_id, stream_ordering)
SELECT d.destination, r.room_id,
       CASE WHEN {_ROW_BEHIND}
            THEN greatest(1, p.l_so - 1 - floor(1000 * synscale.u(p.ridx, p.j, 31))::bigint)
            ELSE p.l_so END
FROM synscale.pair p JOIN synscale.room r USING (ridx) JOIN synscale.dest d USING (didx)
WHERE p.l_so > p.join_so AND NOT ({_NO_ROW})
ORDER BY d.destination, r.room_id;
"""),
    ("federation_transaction_log", """
INSERT INTO federation_sender.federation_transaction_log
    (txn_id, destination, instance_name, pdu_count, edu_count, request_bytes, status,
     http_status, started_ts, duration_ms, catchup, max_stream_ordering, pdu_event_ids,
     error)
SELECT left(g.status, 1) || g.didx || '_' || g.b || '_' || g.c, d.destination, %(instance)s,
       g.n, x.edus, 1400 * g.n + 300 * x.edus, g.status,
       CASE g.status WHEN 'success' THEN 200 WHEN 'permanent' THEN 400
                     ELSE CASE WHEN x.v < 0.5 THEN NULL ELSE 502 END END,
       g.ts + 20 + floor(500 * x.v)::bigint,
       CASE WHEN g.status = 'transient' AND x.v < 0.5 THEN 60000
            WHEN g.status = 'transient' THEN 30 + floor(500 * x.v)::int
            ELSE 40 + floor(-ln(1 - x.v) * 120)::int END,
       g.status = 'success' AND x.v < 0.02, g.max_so, '["' || g.ids || '"]',
       CASE g.status WHEN 'success' THEN NULL WHEN 'permanent' THEN 'HTTP 400: M_BAD_JSON'
                     ELSE CASE WHEN x.v < 0.5 THEN 'timeout after 60 s'
                               ELSE 'HTTP 502: Bad Gateway' END END
FROM (
    SELECT didx, status, b, c, count(*) AS n, max(l_so) AS max_so, max(l_ts) AS ts,
           string_agg(l_eid, '","' ORDER BY l_so) AS ids
    FROM (
        SELECT e.didx, e.status, e.l_so, e.l_ts, rl.l_eid, e.l_so / %(bucket)s AS b,
               (row_number() OVER (PARTITION BY e.didx, e.status, e.l_so / %(bucket)s
                                   ORDER BY e.l_so) - 1) / 50 AS c
        FROM synscale.entry e JOIN synscale.room_last rl USING (ridx)
    ) s
    GROUP BY didx, status, b, c
) g JOIN synscale.dest d USING (didx)
CROSS JOIN LATERAL (SELECT synscale.u(g.didx, g.b * 64 + g.c, 40) AS v,
                           floor(3 * synscale.u(g.didx, g.b * 64 + g.c, 41))::int AS edus) x
ORDER BY g.ts;
"""),
    ("federation_stream_position", """
DELETE FROM federation_stream_position;
INSERT INTO federation_stream_position (type, stream_id, instance_name)
VALUES ('events', %(sender_so)s, %(instance)s), ('federation', 1, %(instance)s);
"""),
    ("erased_users, partial_state_rooms", """
INSERT INTO erased_users (user_id)
SELECT '@user0:' || %(server)s
UNION ALL SELECT '@u' || i || ':' || synscale.dname(i) FROM generate_series(1, 50) i;
INSERT INTO partial_state_rooms (room_id, device_lists_stream_id, join_event_id, joined_via)
SELECT r.room_id, 0, t.event_id, synscale.dname(r.o)
FROM synscale.room r JOIN synscale.tl t ON t.ridx = r.ridx AND t.kind = 'l'
WHERE mod(r.ridx, 997) = 5;
"""),
)
"""Synapse's tables (and our log) from the model, in dependency order."""

EXPECTED = f"""
CREATE TABLE synscale.expected AS
WITH f AS (
    SELECT min(max_stream_ordering) AS log_from_so
    FROM federation_sender.federation_transaction_log
    WHERE NOT catchup AND max_stream_ordering IS NOT NULL
), cls AS (
    SELECT p.didx,
           CASE WHEN p.l_so > %(sender_so)s THEN 'pending/sender_behind'
                WHEN {_NO_ROW} THEN 'missing_row/no_row'
                WHEN {_ROW_BEHIND} THEN 'missing_row/row_behind'
                WHEN e.status = 'success' THEN 'delivered/in_log'
                WHEN (f.log_from_so IS NULL OR p.l_so < f.log_from_so) AND {_PAST}
                     THEN 'delivered/before_log'
                WHEN NOT {_PAST} AND d.retry_interval > 0
                     AND d.retry_last_ts + d.retry_interval > %(now)s THEN 'pending/backoff'
                WHEN NOT {_PAST} THEN 'pending/catch_up'
                ELSE 'lost/not_in_log' END AS c
    FROM synscale.pair p JOIN synscale.dest d USING (didx)
    CROSS JOIN f
    LEFT JOIN synscale.entry e ON e.didx = p.didx AND e.ridx = p.ridx
                              AND e.status = 'success'
    WHERE NOT p.gone AND p.l_so > p.join_so AND mod(p.ridx, %(lu)s) <> 0
)
SELECT split_part(c, '/', 1) AS status, split_part(c, '/', 2) AS reason,
       count(*) AS pairs, count(DISTINCT didx) AS destinations
FROM cls GROUP BY c ORDER BY c;
"""
"""Every pair's class from the construction: current members (not left) whose room's
newest sendable event came after their join, in rooms whose local user is not the
erased one (``@user0``), by the rules of the audit applied to the model's own
variables (the sender's position, the planted row, the log entries, the destination's
state) rather than to Synapse's tables."""

DROP_WORK = """
DROP TABLE synscale.tl, synscale.room_last, synscale.pair, synscale.entry, synscale.room,
           synscale.dest;
DROP SEQUENCE IF EXISTS synscale.backfill;
"""

LOADED = ("events", "event_json", "room_memberships", "current_state_events",
          "destination_rooms", "rooms", "destinations")


def _secondary_indexes(conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    """(name, definition) of the loaded tables' non-unique indexes that back no
    constraint: dropped for the load and built again after it from Synapse's own
    definitions (the unique ones stay: they check the load)."""
    rows = conn.execute(
        """
        SELECT i.indexname, i.indexdef FROM pg_indexes i
        WHERE i.schemaname = 'public' AND i.tablename = ANY(%s)
          AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname)
          AND i.indexdef NOT LIKE 'CREATE UNIQUE%%'
        ORDER BY i.indexname
        """, (list(LOADED),)).fetchall()
    return [(str(n), str(d)) for n, d in rows]


def generate(url: str, p: Params, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Fill the (empty, migrated) Synapse database at ``url``; returns what it made,
    with step timings."""
    steps: list[tuple[str, float]] = []
    t_end = p.now_ms - 120_000
    span = 365 * DAY_MS
    q: dict[str, Any] = {
        "server": OUR, "instance": INSTANCE, "D": p.destinations, "R": p.rooms,
        "kmax": p.kmax, "a": p.a, "small_max": p.small_max, "mps": p.messages_per_server,
        "local_frac": p.local_frac, "np_frac": p.not_proactive_frac,
        "outlier_frac": p.outlier_frac, "rejected_frac": p.rejected_frac,
        "leave_frac": p.leave_frac, "backfill_frac": p.backfill_frac,
        "p_no_row": p.p_no_row, "p_row_behind": p.p_row_behind, "p_lost": p.p_lost,
        "lu": p.local_users, "now": p.now_ms, "t_end": t_end, "t_start": t_end - span,
        "span": span,
    }
    t_all = time.perf_counter()
    with psycopg.connect(url, autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:
        # A bulk load: no per-row trigger or foreign-key checks (the rows are consistent
        # by construction; `check` verifies the references), big sorts in memory.
        conn.execute("SET session_replication_role = replica")
        conn.execute("SET maintenance_work_mem = '1GB'")
        conn.execute("SET work_mem = '512MB'")
        conn.execute("SET jit = off")

        def step(name: str, sql: str) -> None:
            t0 = time.perf_counter()
            if "%(" in sql:
                conn.execute(sql, q)
            else:
                conn.execute(sql)
            took = time.perf_counter() - t0
            steps.append((name, took))
            log(f"  {name}: {took:.1f} s")

        step("functions", _functions(p.seed))
        step("rooms model", ROOM)
        step("timeline", TIMELINE)
        row = conn.execute(STATS).fetchone()
        assert row is not None
        hwm, n_local = int(row[0]), int(row[2])
        q["hwm"] = hwm
        behind = conn.execute(SENDER, {"behind": max(3, n_local // 2_000)}).fetchone()
        q["sender_so"] = int(behind[0]) if behind else hwm
        q["log_from"] = int(hwm * p.log_from_frac)
        q["bucket"] = max(1, hwm // p.txn_buckets)
        step("pairs model", PAIRS)
        step("destinations model", DESTS)
        step("log entries model", ENTRIES)
        conn.execute("ANALYZE synscale.tl; ANALYZE synscale.pair")
        indexes = _secondary_indexes(conn)
        for name, _ in indexes:
            conn.execute(f'DROP INDEX public."{name}"')
        for table, sql in SYNAPSE_TABLES:
            step(table, sql)
        t0 = time.perf_counter()
        for _, definition in indexes:
            conn.execute(definition)
        steps.append(("secondary indexes", time.perf_counter() - t0))
        log(f"  secondary indexes ({len(indexes)}): {steps[-1][1]:.1f} s")
        step("expected classes", EXPECTED)
        stats = _model_stats(conn)
        step("drop the model", DROP_WORK)
        conn.execute(
            "CREATE TABLE synscale.params (key text PRIMARY KEY, value text NOT NULL)")
        facts = {**asdict(p), "hwm": hwm, "sender_so": q["sender_so"],
                 "log_from_design": q["log_from"], "server_name": OUR, **stats}
        conn.execute("INSERT INTO synscale.params SELECT key, value FROM "
                     "jsonb_each_text(%s::jsonb)", (json.dumps(facts),))
        t0 = time.perf_counter()
        conn.execute("VACUUM (ANALYZE)")
        steps.append(("vacuum analyze", time.perf_counter() - t0))
        log(f"  vacuum analyze: {steps[-1][1]:.1f} s")
        counts = table_counts(conn)
        size = conn.execute("SELECT pg_database_size(current_database())").fetchone()
    return {"params": facts, "counts": counts, "database_bytes": int(size[0]) if size else 0,
            "seconds": round(time.perf_counter() - t_all, 1),
            "steps": [(n, round(s, 1)) for n, s in steps]}


def _model_stats(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """The servers-per-room distribution, and the transaction sizes."""
    row = conn.execute(
        """
        SELECT max(k), percentile_disc(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY k),
               count(*) FILTER (WHERE k >= 1000), avg(k)
        FROM synscale.room
        """).fetchone()
    assert row is not None
    txn = conn.execute("SELECT max(pdu_count), avg(pdu_count) FROM "
                       "federation_sender.federation_transaction_log").fetchone()
    assert txn is not None
    return {"servers_per_room_max": int(row[0]),
            "servers_per_room_p50_p90_p99": json.dumps([int(x) for x in row[1]]),
            "rooms_with_1000_servers_or_more": int(row[2]),
            "servers_per_room_mean": round(float(row[3]), 1),
            "pdus_per_txn_max": int(txn[0] or 0),
            "pdus_per_txn_mean": round(float(txn[1] or 0), 1)}


def table_counts(conn: psycopg.Connection[Any]) -> dict[str, int]:
    out = {}
    for t in ("destination_rooms", "destinations", "rooms", "events", "event_json",
              "current_state_events", "room_memberships", "rejections",
              "federation_sender.federation_transaction_log"):
        row = conn.execute(f"SELECT count(*) FROM {t}").fetchone()
        out[t.rsplit(".", 1)[-1]] = int(row[0]) if row else 0
    return out


def expected(url: str) -> dict[tuple[str, str], tuple[int, int]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT status, reason, pairs, destinations FROM synscale.expected").fetchall()
    return {(str(s), str(r)): (int(n), int(d)) for s, r, n, d in rows}


def params_of(url: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        return {str(k): str(v) for k, v in
                conn.execute("SELECT key, value FROM synscale.params").fetchall()}


DANGLING = """
SELECT
  (SELECT count(*) FROM room_memberships m
   WHERE NOT EXISTS (SELECT 1 FROM events e WHERE e.stream_ordering = m.event_stream_ordering
                     AND e.event_id = m.event_id)),
  (SELECT count(*) FROM current_state_events c
   WHERE NOT EXISTS (SELECT 1 FROM events e WHERE e.stream_ordering = c.event_stream_ordering
                     AND e.event_id = c.event_id)),
  (SELECT count(*) FROM destination_rooms r
   WHERE NOT EXISTS (SELECT 1 FROM destinations d WHERE d.destination = r.destination)
      OR NOT EXISTS (SELECT 1 FROM rooms o WHERE o.room_id = r.room_id)),
  (SELECT count(*) FROM events e
   WHERE NOT EXISTS (SELECT 1 FROM event_json j WHERE j.event_id = e.event_id))
"""
"""What the load's skipped checks would have refused: memberships and state naming an
event or stream ordering that does not exist, rows without their destination or room,
events without their JSON. All zero."""


# --- a database: cluster, Synapse's schema, our schema -----------------------------------

class Workdir:
    """The benchmark's PostgreSQL cluster (kept between runs) and configuration files."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.pgdata = self.root / "pgdata"
        self.port_file = self.root / "port"

    def cluster(self) -> PostgresCluster:
        """Start (initialising it the first time) the cluster; tuned for a database host
        of this machine: 2 GB of shared buffers."""
        self.root.mkdir(parents=True, exist_ok=True)
        run_as = "postgres" if os.geteuid() == 0 else None
        user = "postgres" if run_as else os.environ.get("USER", "postgres")
        if self.port_file.exists():
            port = int(self.port_file.read_text())
        else:
            port = free_port()
            self.port_file.write_text(str(port))
        c = PostgresCluster(find_pg_bin(), self.pgdata, port, user, run_as)
        if not (self.pgdata / "PG_VERSION").exists():
            if run_as:
                shutil.chown(self.root, run_as, run_as)
            c.run([str(c.bin_dir / "initdb"), "-D", str(self.pgdata), "-U", user, "-A",
                   "trust", "-E", "UTF8", "--no-sync"])
            with open(self.pgdata / "postgresql.conf", "a") as f:
                f.write(f"\nport = {port}\nlisten_addresses = '127.0.0.1'\n"
                        f"unix_socket_directories = '{self.pgdata}'\nfsync = off\n"
                        "synchronous_commit = off\nfull_page_writes = off\n"
                        "max_connections = 200\nshared_buffers = 2GB\n"
                        "max_wal_size = 8GB\ncheckpoint_timeout = 30min\n"
                        "effective_cache_size = 12GB\n")
        if c.run([str(c.bin_dir / "pg_ctl"), "-D", str(self.pgdata), "status"],
                 check=False).returncode != 0:
            c.start()
        return c

    def stop(self, c: PostgresCluster) -> None:
        c.stop()

    def homeserver_yaml(self, c: PostgresCluster, dbname: str) -> Path:
        """Synapse's configuration of the generated deployment (what the jobs and
        ``migrate`` take with ``--synapse-config``)."""
        d = self.root / dbname
        d.mkdir(parents=True, exist_ok=True)
        key = d / "signing.key"
        if not key.exists():
            key.write_text("ed25519 a_bench AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA\n")
        hs = d / "homeserver.yaml"
        hs.write_text(json.dumps({
            "server_name": OUR, "report_stats": False, "signing_key_path": str(key),
            "database": {"name": "psycopg2", "args": {
                "user": c.user, "host": "127.0.0.1", "port": c.port, "dbname": dbname}},
            "redis": {"enabled": True, "host": "127.0.0.1", "port": 6379},
            "federation_sender_instances": [INSTANCE],
        }, indent=2))
        (d / "ours.yaml").write_text(json.dumps({"data_dir": str(d / "data")}))
        return hs


def dbname_for(rows: int) -> str:
    return f"synscale_{rows}"


def prepare(work: Workdir, rows: int, *, seed: int, regenerate: bool,
            log: Callable[[str], None] = print) -> tuple[PostgresCluster, str, dict[str, Any]]:
    """The generated database of ``rows`` (made when missing, or when ``regenerate``):
    ``(cluster, url, generation report)``."""
    from federation_sender.testing.synapse_install import synapse_python
    from federation_sender.testing.synapse_schema import create_synapse_schema

    c = work.cluster()
    name = dbname_for(rows)
    report_file = work.root / name / "generation.json"
    exists = bool(c.psql(f"SELECT 1 FROM pg_database WHERE datname = '{name}'").strip())
    if exists and not regenerate and report_file.exists():
        return c, c.url(name), json.loads(report_file.read_text())
    if exists:
        c.psql(f'DROP DATABASE "{name}"')
    t0 = time.perf_counter()
    url = create_synapse_schema(c, name, synapse_python())
    hs = work.homeserver_yaml(c, name)
    done = subprocess.run(
        [sys.executable, "-m", "federation_sender", "migrate", "-c",
         str(hs.parent / "ours.yaml"), "--synapse-config", str(hs)],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"migrate failed: {done.stderr.strip()[-2000:]}")
    schema_s = time.perf_counter() - t0
    log(f"{name}: Synapse's schema and ours in {schema_s:.1f} s; generating")
    report = generate(url, derive(rows, seed=seed), log=log)
    report["schema_seconds"] = round(schema_s, 1)
    report_file.write_text(json.dumps(report, indent=2))
    return c, url, report


# --- the same deployment on our native schema ------------------------------------------

NATIVE_COPIES: tuple[tuple[str, str, str], ...] = (
    ("events",
     "stream_ordering, instance_name, event_id, room_id, type, state_key, sender, "
     "origin_server_ts, outlier, rejected, json",
     "SELECT e.stream_ordering, coalesce(e.instance_name, 'master'), e.event_id, e.room_id, "
     "e.type, e.state_key, e.sender, e.origin_server_ts, e.outlier, "
     "e.rejection_reason IS NOT NULL, j.json "
     "FROM events e JOIN event_json j USING (event_id) WHERE e.stream_ordering IS NOT NULL"),
    ("room_memberships",
     "event_id, event_stream_ordering, room_id, user_id, server_name, sender, membership",
     "SELECT event_id, event_stream_ordering, room_id, user_id, "
     "substring(user_id from position(':' in user_id) + 1), sender, membership "
     "FROM room_memberships"),
    ("destinations",
     "destination, retry_last_ts, retry_interval, failure_ts, last_successful_stream_ordering",
     "SELECT destination, retry_last_ts, retry_interval, failure_ts, "
     "last_successful_stream_ordering FROM destinations"),
    ("destination_rooms", "destination, room_id, stream_ordering",
     "SELECT destination, room_id, stream_ordering FROM destination_rooms"),
    ("federation_transaction_log",
     "id, txn_id, destination, instance_name, pdu_count, edu_count, request_bytes, status, "
     "http_status, started_ts, duration_ms, catchup, max_stream_ordering, pdu_event_ids, "
     "error",
     "SELECT id, txn_id, destination, instance_name, pdu_count, edu_count, request_bytes, "
     "status, http_status, started_ts, duration_ms, catchup, max_stream_ordering, "
     "pdu_event_ids, error FROM federation_sender.federation_transaction_log"),
    ("partial_state_rooms", "room_id", "SELECT room_id FROM partial_state_rooms"),
)
"""Our native tables from Synapse's: the same events (rejected = has a rejection
reason), every membership row with its server, the same rows, positions and log. The
native audit has no ``proactively_send`` or erasure rules, so its classes are its own:
the check on this schema is the plain query (``bench/batch_baseline.py``) against
the Spark audit, count for count."""


def native_dbname_for(rows: int) -> str:
    return f"native_{rows}"


def native_config(work: Workdir, c: PostgresCluster, rows: int) -> Path:
    """``-c`` for the native deployment: its database and our server name."""
    d = work.root / native_dbname_for(rows)
    d.mkdir(parents=True, exist_ok=True)
    cfg = d / "native.yaml"
    cfg.write_text(json.dumps({
        "server_name": OUR, "data_dir": str(d / "data"),
        "database": {"url": f"postgresql://{c.user}@127.0.0.1:{c.port}/"
                            f"{native_dbname_for(rows)}"}}))
    return cfg


def prepare_native(work: Workdir, rows: int, *, seed: int, regenerate: bool,
                   log: Callable[[str], None] = print) -> tuple[PostgresCluster, str, Path]:
    """The native database of ``rows`` (``native_<rows>``), copied from the generated
    Synapse database (made first when missing): ``(cluster, url, config)``."""
    c, synapse_url, _ = prepare(work, rows, seed=seed, regenerate=regenerate, log=log)
    name = native_dbname_for(rows)
    cfg = native_config(work, c, rows)
    done_file = cfg.parent / "copied.json"
    exists = bool(c.psql(f"SELECT 1 FROM pg_database WHERE datname = '{name}'").strip())
    if exists and done_file.exists() and not regenerate:
        return c, c.url(name), cfg
    if exists:
        c.psql(f'DROP DATABASE "{name}"')
    c.psql(f'CREATE DATABASE "{name}"')
    done = subprocess.run([sys.executable, "-m", "federation_sender", "migrate", "-c",
                           str(cfg)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"migrate failed: {done.stderr.strip()[-2000:]}")
    url = c.url(name)
    t_all = time.perf_counter()
    steps: list[tuple[str, float]] = []
    with psycopg.connect(synapse_url) as src, psycopg.connect(url, autocommit=True) as dst:
        dst.execute("SET session_replication_role = replica")
        dst.execute("SET maintenance_work_mem = '1GB'")
        tables = [t for t, _, _ in NATIVE_COPIES]
        indexes = [(str(n), str(d)) for n, d in dst.execute(
            """
            SELECT i.indexname, i.indexdef FROM pg_indexes i
            WHERE i.schemaname = 'public' AND i.tablename = ANY(%s)
              AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname)
            """, (tables,)).fetchall()]
        for n, _ in indexes:
            dst.execute(f'DROP INDEX public."{n}"')
        for table, cols, select in NATIVE_COPIES:
            t0 = time.perf_counter()
            with src.cursor().copy(f"COPY ({select}) TO STDOUT") as out, \
                    dst.cursor().copy(f"COPY {table} ({cols}) FROM STDIN") as into:
                for block in out:
                    into.write(block)
            steps.append((table, time.perf_counter() - t0))
            log(f"  {name}.{table}: {steps[-1][1]:.1f} s")
        t0 = time.perf_counter()
        for _, definition in indexes:
            dst.execute(definition)
        dst.execute("SELECT setval(pg_get_serial_sequence('federation_transaction_log', 'id'),"
                    " (SELECT coalesce(max(id), 1) FROM federation_transaction_log))")
        dst.execute("VACUUM (ANALYZE)")
        steps.append(("indexes, vacuum analyze", time.perf_counter() - t0))
        size = dst.execute("SELECT pg_database_size(current_database())").fetchone()
    report = {"seconds": round(time.perf_counter() - t_all, 1),
              "database_bytes": int(size[0]) if size else 0,
              "steps": [(n, round(s, 1)) for n, s in steps]}
    done_file.write_text(json.dumps(report, indent=2))
    log(f"{name}: copied in {report['seconds']} s, {report['database_bytes'] / 2**30:.2f} GiB")
    return c, url, cfg


# --- measuring ---------------------------------------------------------------------------

def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _processes() -> Iterator[tuple[int, int, bytes]]:
    """(pid, ppid, cmdline) of every process."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = p.joinpath("stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            cmd = p.joinpath("cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        yield int(p.name), ppid, cmd


def _descendants(root: int, procs: list[tuple[int, int, bytes]]) -> set[int]:
    kids: dict[int, list[int]] = {}
    for pid, ppid, _ in procs:
        kids.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


@dataclass
class Peaks:
    driver_kb: int = 0
    executors_kb: int = 0
    executor_max_kb: int = 0
    postgres_kb: int = 0


@contextmanager
def sample_rss(root_pid: Callable[[], int | None], dbname: str,
               workers: tuple[int, ...] = ()) -> Iterator[Peaks]:
    """Peak RSS every 200 ms: the driver (the JVM under ``root_pid``), the executors
    (``CoarseGrainedExecutorBackend`` JVMs under the ``workers``' processes, summed and
    the largest), and the database's PostgreSQL backends (summed; includes the shared
    buffers they touched). Other sessions' Spark processes are not counted."""
    peaks = Peaks()
    stop = threading.Event()
    marker = f" {dbname} ".encode()

    def run() -> None:
        while not stop.is_set():
            procs = list(_processes())
            root = root_pid()
            mine = _descendants(root, procs) | {root} if root else set()
            ours = set().union(*(_descendants(w, procs) for w in workers))
            drv = ex = ex_max = pg = 0
            for pid, _, cmd in procs:
                if pid in ours and b"CoarseGrainedExecutorBackend" in cmd:
                    kb = _rss_kb(pid)
                    ex += kb
                    ex_max = max(ex_max, kb)
                elif pid in mine and cmd.startswith(b"/") and b"java" in cmd.split(b"\0")[0]:
                    drv += _rss_kb(pid)
                elif cmd.startswith(b"postgres:") and marker in cmd:
                    pg += _rss_kb(pid)
            peaks.driver_kb = max(peaks.driver_kb, drv)
            peaks.executors_kb = max(peaks.executors_kb, ex)
            peaks.executor_max_kb = max(peaks.executor_max_kb, ex_max)
            peaks.postgres_kb = max(peaks.postgres_kb, pg)
            stop.wait(0.2)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    try:
        yield peaks
    finally:
        stop.set()
        th.join()


def partitions_rule(rows: int, cores: int) -> int:
    """Shuffle and JDBC partitions for ``rows`` destination_rooms rows on ``cores``
    executor cores: two per core, and one per 1,000,000 rows, at most 64.

    From the audit's event logs: it shuffles 230-300 bytes per row in all (its
    largest stage about 110: 109 MB at 1M), and each partition adds about 10 tasks (the stages that
    run one task per shuffle partition or JDBC range); one partition per million rows
    keeps the largest stage's partitions near 110 MB, inside Spark's advice of
    100-200 MB, while the task count stays in the tens (Spark's default of 200 runs
    2,000 tasks of a few milliseconds' work each on small data)."""
    return max(2 * cores, min(64, math.ceil(rows / 1_000_000)))


@dataclass
class JobRun:
    rows: int
    mode: str
    job: str
    partitions: int
    wall_s: float
    job_s: float
    driver_mb: int
    executors_mb: int
    executor_max_mb: int
    postgres_mb: int
    status: int
    summary: dict[str, Any]
    driver_memory: str
    executor_memory: str
    tasks: int = 0
    stages: int = 0
    shuffle_mb: float = 0.0
    """Shuffle bytes written, all stages."""
    largest_stage_shuffle_mb: float = 0.0
    steps: list[tuple[str, float]] | None = None
    """The job's own steps and their seconds (its ``--json``)."""
    profile: dict[str, dict[str, float]] | None = None
    """Where the executors' time went, per step (:func:`event_log_profile`)."""


def event_log_totals(directory: Path) -> tuple[int, int, float, float]:
    """(tasks, stages, shuffle MB written, the largest stage's shuffle MB) from the
    Spark event log of the one job run under ``directory`` (Spark 4 writes it rolled:
    ``eventlog_v2_<app>/events_<n>_<app>`` files)."""
    logs = sorted(f for f in directory.rglob("*") if f.is_file() and f.name != "appstatus")
    tasks = 0
    per_stage: dict[int, int] = {}
    for log in logs:
        with open(log, errors="replace") as f:
            lines = list(f)
        for line in lines:
            if '"SparkListenerTaskEnd"' not in line:
                continue
            ev = json.loads(line)
            tasks += 1
            written = (ev.get("Task Metrics") or {}).get("Shuffle Write Metrics", {}).get(
                "Shuffle Bytes Written", 0)
            stage = int(ev.get("Stage ID", -1))
            per_stage[stage] = per_stage.get(stage, 0) + int(written)
    mb = 2**20
    return (tasks, len(per_stage), round(sum(per_stage.values()) / mb, 1),
            round(max(per_stage.values(), default=0) / mb, 1))


_PROFILED = ('"SparkListenerJobStart"', '"SparkListenerStageCompleted"',
             '"SparkListenerTaskEnd"')


def event_log_profile(directory: Path) -> dict[str, dict[str, float]]:
    """Per step of the job (Spark's job description, which the command line sets to the
    step's name), the executors' task time in seconds: ``run`` (wall time of all tasks,
    summed over cores), ``cpu``, ``gc``, and the run time of the stages that read the
    database (``jdbc``: input rows not from a cache) and of those that sort for a window
    (``window``); ``stages``, and ``rows_read`` over JDBC."""
    logs = sorted(f for f in directory.rglob("*") if f.is_file() and f.name != "appstatus")
    step_of: dict[int, str] = {}
    kinds: dict[int, set[str]] = {}
    per_stage: dict[int, dict[str, float]] = {}
    for log in logs:
        with open(log, errors="replace") as f:
            for line in f:
                if not any(k in line for k in _PROFILED):
                    continue
                try:
                    ev = json.loads(line)
                except ValueError:  # the last line of a log being written
                    continue
                kind = ev.get("Event")
                if kind == "SparkListenerJobStart":
                    name = (ev.get("Properties") or {}).get("spark.job.description") or "-"
                    for sid in ev.get("Stage IDs", []):
                        step_of[int(sid)] = str(name)
                elif kind == "SparkListenerStageCompleted":
                    info = ev["Stage Info"]
                    scopes = set()
                    for rdd in info.get("RDD Info", []):
                        with suppress(ValueError, TypeError, KeyError):
                            scopes.add(str(json.loads(rdd.get("Scope") or "")["name"]))
                    kinds[int(info["Stage ID"])] = scopes
                elif kind == "SparkListenerTaskEnd":
                    m = ev.get("Task Metrics") or {}
                    st = per_stage.setdefault(int(ev.get("Stage ID", -1)), {
                        "run": 0.0, "cpu": 0.0, "gc": 0.0, "rows": 0.0})
                    st["run"] += m.get("Executor Run Time", 0) / 1e3
                    st["cpu"] += m.get("Executor CPU Time", 0) / 1e9
                    st["gc"] += m.get("JVM GC Time", 0) / 1e3
                    st["rows"] += (m.get("Input Metrics") or {}).get("Records Read", 0)
    out: dict[str, dict[str, float]] = {}
    for sid, st in sorted(per_stage.items()):
        step = out.setdefault(step_of.get(sid, "-"), {
            "run": 0.0, "cpu": 0.0, "gc": 0.0, "jdbc": 0.0, "window": 0.0, "stages": 0,
            "rows_read": 0})
        scopes = kinds.get(sid, set())
        jdbc = st["rows"] > 0 and "InMemoryTableScan" not in scopes
        for k in ("run", "cpu", "gc"):
            step[k] += st[k]
        step["jdbc"] += st["run"] if jdbc else 0.0
        step["window"] += st["run"] if "Window" in scopes else 0.0
        step["stages"] += 1
        step["rows_read"] += st["rows"] if jdbc else 0
    return {name: {k: round(v, 1) for k, v in step.items()} for name, step in out.items()}


def run_job(source: list[str], dbname: str, rows: int, mode: str, master: str | None,
            job: str, partitions: int, conf: Mapping[str, str], out_dir: Path,
            timeout_s: float, workers: tuple[int, ...] = ()) -> JobRun:
    """One job as an operator runs it: ``federation-sender batch JOB`` with ``source``
    (``--synapse-config homeserver.yaml``, or ``-c native.yaml``), its own process and
    JVM; ``master`` None gives no ``--master`` (the command line's own ``local[*]``)."""
    argv = [sys.executable, "-m", "federation_sender", "batch", job, *source,
            "--json", "--quiet"]
    if master is not None:
        argv += ["--master", master]
    if partitions:  # 0: the command line's default (Spark's 200 on a cluster, 16 reads)
        argv += ["--partitions", str(partitions)]
    events = out_dir / "eventlog" / f"{mode}-{job}-{partitions}"
    shutil.rmtree(events, ignore_errors=True)
    events.mkdir(parents=True)
    conf = {**conf, "spark.eventLog.enabled": "true", "spark.eventLog.compress": "false",
            "spark.eventLog.dir": f"file:{events}"}
    for k, v in conf.items():
        argv += ["--conf", f"{k}={v}"]
    if job == "backfill-destination-rooms":
        argv.append("--dry-run")
    if job == "health-report":
        argv += ["--output", str(out_dir / f"health-{mode}")]
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=str(ROOT))
    holder: dict[str, int] = {}
    with sample_rss(lambda: holder.get("pid"), dbname, workers) as peaks:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=ROOT, env=env)
        holder["pid"] = proc.pid
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        wall = time.perf_counter() - t0
    doc: dict[str, Any] = {}
    with suppress(ValueError):
        doc = json.loads(stdout) if stdout.strip() else {}
    if proc.returncode not in (0, 4):
        print(f"    {job} on {mode} failed ({proc.returncode}): {stderr.strip()[-1500:]}",
              flush=True)
    job_s = sum(float(s["seconds"]) for s in doc.get("steps", []))
    summary = {k: v for k, v in doc.get("summary", {}).items()
               if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    # Without the options, what the command sized for itself (its --json summary).
    used_partitions = partitions or int(summary.get("partitions", 0))
    driver_memory = conf.get("spark.driver.memory") or str(summary.get("driver_memory", "1g"))
    return JobRun(rows, mode, job, used_partitions, round(wall, 1), round(job_s, 1),
                  peaks.driver_kb // 1024, peaks.executors_kb // 1024,
                  peaks.executor_max_kb // 1024, peaks.postgres_kb // 1024,
                  proc.returncode, summary, driver_memory,
                  conf.get("spark.executor.memory", "-"), *event_log_totals(events),
                  steps=[(str(x["step"]), float(x["seconds"])) for x in doc.get("steps", [])],
                  profile=event_log_profile(events))


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


class Standalone:
    """A standalone Spark cluster on loopback: a master and two workers (one core and
    ``worker_memory`` each), processes of this benchmark, stopped by their ids."""

    def __init__(self, root: Path, worker_memory: str, workers: int = 2) -> None:
        self.root = root
        self.worker_memory = worker_memory
        self.workers = workers
        self.port = free_port()
        self.ui_port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def master(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def __enter__(self) -> Standalone:
        cls = str(spark_home() / "bin" / "spark-class")
        env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", SPARK_HOME=str(spark_home()),
                   PYSPARK_PYTHON=sys.executable)
        self.root.mkdir(parents=True, exist_ok=True)

        def start(name: str, args: list[str]) -> None:
            log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - the child's
            self.procs.append(subprocess.Popen([cls, *args], stdout=log, stderr=log,
                                               env=env, start_new_session=True))
            log.close()

        start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                         "--port", str(self.port), "--webui-port", str(self.ui_port)])
        self._wait(lambda s: s is not None, "the master")
        for i in range(self.workers):
            work = self.root / f"worker{i}"
            work.mkdir(exist_ok=True)
            start(f"worker{i}", ["org.apache.spark.deploy.worker.Worker", "--host",
                                 "127.0.0.1", "--cores", "1", "--memory", self.worker_memory,
                                 "--work-dir", str(work), "--webui-port",
                                 str(free_port()), self.master])
        self._wait(lambda s: s is not None and len(
            [w for w in s.get("workers", []) if w.get("state") == "ALIVE"]) >= self.workers,
            f"{self.workers} workers")
        return self

    def _state(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/",
                                        timeout=2) as r:
                doc: dict[str, Any] = json.loads(r.read())
                return doc
        except (OSError, ValueError):
            return None

    def _wait(self, ok: Callable[[dict[str, Any] | None], bool], what: str) -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if ok(self._state()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"standalone cluster: {what} not up in 90 s (logs in {self.root})")

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@dataclass
class PlainRun:
    rows: int
    seconds: float
    postgres_mb: int
    counts: dict[str, int]


def run_plain(url: str, dbname: str, rows: int, now_ms: int | None = None,
              work_mem: str = "256MB") -> PlainRun:
    with sample_rss(lambda: None, dbname) as peaks:
        t0 = time.perf_counter()
        counts = run_counts(url, OUR, now_ms if now_ms is not None else int(time.time() * 1000),
                            work_mem=work_mem)
        took = time.perf_counter() - t0
    return PlainRun(rows, round(took, 1), peaks.postgres_kb // 1024,
                    {f"{s}/{r}": n for (s, r), (n, _) in sorted(counts.items())})


# --- commands ----------------------------------------------------------------------------

def _sizes(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x]


def cmd_generate(a: argparse.Namespace) -> None:
    work = Workdir(Path(a.workdir))
    for rows in _sizes(a.rows):
        _, _, rep = prepare(work, rows, seed=a.seed, regenerate=a.regenerate)
        print(json.dumps(rep, indent=2))
        print(f"{dbname_for(rows)}: generated in {rep['seconds']} s (+ {rep['schema_seconds']} s"
              f" for the schemas), {rep['database_bytes'] / 2**30:.2f} GiB", flush=True)
    if a.stop:
        work.stop(work.cluster())


def compare(a: Mapping[tuple[str, str], int], b: Mapping[tuple[str, str], int]) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [f"{k[0]}/{k[1]}: {a.get(k, 0)} != {b.get(k, 0)}" for k in keys
            if a.get(k, 0) != b.get(k, 0)]


def spark_counts(summary: Mapping[str, Any]) -> dict[tuple[str, str], int]:
    """The audit summary's pairs per (status, reason)."""
    from federation_sender.batch.synapse_transforms import RULES

    out = {}
    for r in RULES:
        by_status = [x for x in RULES if x.status == r.status]
        key = r.status if len(by_status) == 1 else f"{r.status}_{r.reason}"
        if summary.get(key):
            out[(r.status, r.reason)] = int(summary[key])
    return out


def cmd_check(a: argparse.Namespace) -> None:
    """Generate (or reuse) each size, then: no dangling references; the plain query's
    classes equal the construction's; the Spark audit's (in process, local mode, the
    generation's clock) equal both; the partitions each JDBC read got."""
    from federation_sender import cli
    from federation_sender.batch.cli import run_batch
    from federation_sender.batch.session import SessionOptions, build_session
    from federation_sender.testing.clock import FakeClock

    work = Workdir(Path(a.workdir))
    spark = build_session(SessionOptions(master="local[2]", shuffle_partitions=a.partitions,
                                         conf={"spark.driver.memory": a.driver_memory}))
    failed = False
    try:
        for rows in _sizes(a.rows):
            _, url, rep = prepare(work, rows, seed=a.seed, regenerate=a.regenerate)
            params = params_of(url)
            now_ms = int(params["now_ms"])
            name = dbname_for(rows)
            with psycopg.connect(url) as conn:
                dangling = conn.execute(DANGLING).fetchone()
            want = {k: n for k, (n, _) in expected(url).items()}
            plain = run_plain(url, name, rows, now_ms)
            got_plain = {tuple(k.split("/")): v for k, v in plain.counts.items()}
            hs = work.root / name / "homeserver.yaml"
            args = cli.build_parser().parse_args(
                ["batch", "audit", "--synapse-config", str(hs), "--json", "--quiet",
                 "--partitions", str(a.partitions)])
            settings = cli._load(args)
            import io

            out = io.StringIO()
            t0 = time.perf_counter()
            status = run_batch(args, settings, spark=spark, out=out,
                               clock=FakeClock(now_ms / 1000))
            spark_s = time.perf_counter() - t0
            doc = json.loads(out.getvalue())
            got_spark = spark_counts(doc["summary"])
            print(f"\n{name}: {rep['counts']}")
            print(f"  dangling references (memberships, state, rows, events without JSON): "
                  f"{tuple(dangling or ())}")
            print(f"  expected (construction): {dict(sorted(want.items()))}")
            print(f"  plain query: {plain.seconds} s; Spark audit (local[2], "
                  f"{a.partitions} partitions, in process): {spark_s:.1f} s, exit {status}")
            for label, diff in (("plain vs expected", compare(got_plain, want)),
                                ("Spark vs plain", compare(got_spark, got_plain))):
                print(f"  {label}: {diff or 'equal'}")
                failed |= bool(diff)
            failed |= any(dangling or ())
            print("  JDBC reads (partitions; rows per partition, min/max):")
            for line in read_partitions(spark, url, a.partitions, counts=a.partition_counts):
                print("    " + line)
    finally:
        spark.stop()
    if failed:
        raise SystemExit("check failed")


def read_partitions(spark: Any, url: str, partitions: int, *, counts: bool) -> list[str]:
    """How many partitions each of the jobs' JDBC reads gets (and, with ``counts``,
    how many rows each partition holds: the skew of the range split)."""
    from pyspark.sql import functions as F

    from federation_sender.batch.io import Database
    from federation_sender.batch.synapse_source import SynapseJdbcSource
    from federation_sender.storage.synapse.batch_reads import READS, RangeSplit, RoomSplit

    src = SynapseJdbcSource(spark, Database.from_urls(url, None), partitions)
    lines = []
    for name, read in READS.items():
        df = src.table(name)
        n = df.rdd.getNumPartitions()
        split = (f"{read.split.column} ranges" if isinstance(read.split, RangeSplit)
                 else "room_id ranges at quantiles of rooms"
                 if isinstance(read.split, RoomSplit) else "none")
        line = f"{name}: {n} ({split})"
        if counts:
            sizes = [r["n"] for r in df.groupBy(F.spark_partition_id().alias("p"))
                     .agg(F.count(F.lit(1)).alias("n")).collect()]
            if sizes:
                line += f"; rows {sum(sizes):,}, per partition {min(sizes):,}-{max(sizes):,}"
        lines.append(line)
    return lines


def _results_file(work: Workdir) -> Path:
    return work.root / "results.json"


def _load_results(work: Workdir) -> dict[str, Any]:
    f = _results_file(work)
    return json.loads(f.read_text()) if f.exists() else {"jobs": [], "plain": [],
                                                         "generation": {}}


def cmd_run(a: argparse.Namespace) -> None:
    work = Workdir(Path(a.workdir))
    results = _load_results(work)
    modes = [m for m in a.modes.split(",") if m]
    jobs = [j for j in a.jobs.split(",") if j]
    for rows in _sizes(a.rows):
        c, url, rep = prepare(work, rows, seed=a.seed, regenerate=a.regenerate)
        name = dbname_for(rows)
        results["generation"][str(rows)] = {
            "seconds": rep["seconds"], "database_bytes": rep["database_bytes"],
            "counts": rep["counts"]}
        hs = work.root / name / "homeserver.yaml"
        # The page cache warm for both sides alike.
        c.psql("SELECT count(*) FROM events; SELECT count(*) FROM event_json; "
               "SELECT count(*) FROM destination_rooms; SELECT count(*) FROM "
               "current_state_events", name)
        print(f"\n{name}: {rep['counts']['destination_rooms']:,} destination_rooms rows, "
              f"{rep['database_bytes'] / 2**30:.2f} GiB", flush=True)
        for _ in range(a.plain_repeat):
            plain = run_plain(url, name, rows, work_mem=a.work_mem)
            results["plain"] = [p for p in results["plain"] if p["rows"] != rows] + [
                asdict(plain)]
            print(f"  plain query: {plain.seconds} s, PostgreSQL {plain.postgres_mb} MB "
                  f"(work_mem {a.work_mem})", flush=True)
        for mode in modes:
            cores = 2
            parts = (partitions_rule(rows, cores) if a.partitions == "rule"
                     else 0 if a.partitions == "default" else int(a.partitions))
            memory = a.driver_memory if mode == "local" else a.cluster_driver_memory
            # "auto": the command's own sizing from the row counts (batch/sizing.py).
            conf = {} if memory == "auto" else {"spark.driver.memory": memory}
            if mode == "standalone":
                conf.update({"spark.executor.memory": a.executor_memory,
                             "spark.executor.cores": "1", "spark.cores.max": "2"})
            conf.update(kv.split("=", 1) for kv in a.conf)
            runner = (_local() if mode == "local"
                      else _standalone(work.root / "spark", a.worker_memory))
            with runner as (master, workers):
                for job in jobs:
                    r = run_job(["--synapse-config", str(hs)], name, rows, mode, master, job,
                                parts, conf,
                                work.root / name, a.timeout, workers)
                    results["jobs"] = [x for x in results["jobs"] if not (
                        x["rows"] == rows and x["mode"] == mode and x["job"] == job
                        and x["partitions"] == r.partitions)] + [asdict(r)]
                    print(f"  {mode:10} {job:27} {r.partitions:3} partitions: {r.job_s:7.1f} s "
                          f"(wall {r.wall_s} s), driver {r.driver_mb} MB, executors "
                          f"{r.executors_mb} MB (largest {r.executor_max_mb} MB), "
                          f"PostgreSQL {r.postgres_mb} MB, {r.tasks} tasks in {r.stages} "
                          f"stages, shuffle {r.shuffle_mb} MB (largest stage "
                          f"{r.largest_stage_shuffle_mb} MB), exit {r.status}", flush=True)
                    _results_file(work).write_text(json.dumps(results, indent=2))
        _results_file(work).write_text(json.dumps(results, indent=2))
    print()
    print(table(results))
    if a.stop:
        work.stop(work.cluster())


@dataclass
class NativePlain:
    rows: int
    seconds: float
    postgres_mb: int
    counts: dict[str, int]


def run_native_plain(url: str, dbname: str, rows: int, work_mem: str) -> NativePlain:
    """The native audit as one plain PostgreSQL statement (``bench/batch_baseline.py``
    ``AUDIT_COUNTS``): the expected rows once, the undelivered pairs and the
    ``destination_rooms`` differences counted from them."""
    from bench.batch_baseline import run_query

    with sample_rss(lambda: None, dbname) as peaks:
        t0 = time.perf_counter()
        (row,) = run_query(url, "audit-counts", OUR, work_mem=work_mem)
        seconds = time.perf_counter() - t0
    return NativePlain(rows, round(seconds, 1), peaks.postgres_kb // 1024,
                       {k: int(v) for k, v in row.items()})


def native_counts(summary: Mapping[str, Any]) -> dict[str, int]:
    """The Spark audit's classes as the plain query counts them (the plain diff's
    ``missing`` includes the rows the audit calls pruned after delivery)."""
    out = {k: int(summary.get(k, 0)) for k in (
        "undelivered_lost", "undelivered_pending", "rows_behind", "rows_ahead", "rows_stale")}
    out["rows_missing"] = int(summary.get("rows_missing", 0)) + int(
        summary.get("rows_pruned_after_delivery", 0))
    return out


def cmd_native(a: argparse.Namespace) -> None:
    """The native audit at scale (issue #47): the Spark audit as an operator runs it,
    with no option or with ``--variant`` arguments, locally or on a standalone cluster of
    two workers (``--modes``), beside the plain query."""
    work = Workdir(Path(a.workdir))
    results = _load_results(work)
    results.setdefault("native_plain", [])
    results.setdefault("native_jobs", [])
    variants = a.variant or [""]
    for rows in _sizes(a.rows):
        c, url, cfg = prepare_native(work, rows, seed=a.seed, regenerate=a.regenerate)
        name = native_dbname_for(rows)
        c.psql("SELECT count(*) FROM events; SELECT count(*) FROM room_memberships; "
               "SELECT count(*) FROM destination_rooms", name)
        plain = None
        if not a.no_plain:
            plain = run_native_plain(url, name, rows, a.work_mem)
            results["native_plain"] = [p for p in results["native_plain"]
                                       if p["rows"] != rows] + [asdict(plain)]
            print(f"  plain query: {plain.seconds} s, PostgreSQL {plain.postgres_mb} MB: "
                  f"{plain.counts}", flush=True)
        for mode in [m for m in a.modes.split(",") if m]:
            conf: dict[str, str] = {}
            if mode == "standalone":
                conf = {"spark.executor.memory": a.executor_memory,
                        "spark.executor.cores": "1", "spark.cores.max": "2"}
            runner = (_local() if mode == "local"
                      else _standalone(work.root / "spark", a.worker_memory))
            with runner as (master, workers):
                for variant in variants:
                    r = run_job(["-c", str(cfg), *variant.split()], name, rows, mode,
                                None if mode == "local" else master, "audit", 0, conf,
                                work.root / name / "runs", a.timeout, workers)
                    r.mode = f"{a.label} {mode} {variant or '(defaults)'}".strip()
                    _record_native(results, r, plain)
                    _results_file(work).write_text(json.dumps(results, indent=2))
    if a.stop:
        work.stop(work.cluster())


def _record_native(results: dict[str, Any], r: JobRun, plain: NativePlain | None) -> None:
    """Keep one native audit run in ``results`` and print it with its agreement with the
    plain query's counts."""
    got = native_counts(r.summary)
    agree = "-" if plain is None else ("agree" if got == plain.counts else "DIFFER: " + ", ".join(
        f"{k} {got.get(k)} != {plain.counts.get(k)}"
        for k in sorted(set(got) | set(plain.counts)) if got.get(k) != plain.counts.get(k)))
    results["native_jobs"] = [x for x in results["native_jobs"] if not (
        x["rows"] == r.rows and x["mode"] == r.mode)] + [asdict(r)]
    print("   " + "; ".join(f"{n} {x:.1f} s" for n, x in r.steps or []))
    for step, p in (r.profile or {}).items():
        print(f"     {step}: tasks {p['run']} s (cpu {p['cpu']}, gc {p['gc']}; reading the "
              f"database {p['jdbc']}, window sorts {p['window']}), {p['stages']:.0f} stages")
    executors = f", executors {r.executors_mb} MB" if r.executors_mb else ""
    print(f"  audit {r.mode}: job {r.job_s} s, wall {r.wall_s} s, driver {r.driver_mb} MB"
          f"{executors}, {r.tasks} tasks in {r.stages} stages, shuffle {r.shuffle_mb} MB,"
          f" exit {r.status}, plain query {agree}", flush=True)


@contextmanager
def _local() -> Iterator[tuple[str, tuple[int, ...]]]:
    yield "local[2]", ()


@contextmanager
def _standalone(root: Path, worker_memory: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    with Standalone(root, worker_memory) as s:
        yield s.master, tuple(p.pid for p in s.procs[1:])


def table(results: Mapping[str, Any]) -> str:
    """The Markdown table of every measured run, with the growth from the smallest
    size measured of the same mode, job and partitions."""
    plain = {p["rows"]: p for p in results["plain"]}
    runs = sorted(results["jobs"], key=lambda r: (r["mode"], r["job"], r["rows"]))
    lines = ["| rows | mode | job | partitions | job time | wall | driver peak | executors "
             "peak | plain query | Spark / plain | growth vs smallest (Spark, plain) |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    first: dict[tuple[str, str], dict[str, Any]] = {}
    for r in runs:
        base = first.setdefault((r["mode"], r["job"]), r)
        p = plain.get(r["rows"])
        pb = plain.get(base["rows"])
        growth = "-"
        if base is not r and base["job_s"] and p and pb and pb["seconds"]:
            growth = (f"x{r['rows'] / base['rows']:.0f} rows: x{r['job_s'] / base['job_s']:.1f},"
                      f" x{p['seconds'] / pb['seconds']:.1f}")
        ratio = f"{r['job_s'] / p['seconds']:.1f}x" if p and p["seconds"] else "-"
        ex = f"{r['executors_mb']:,} MB" if r["mode"] != "local" else "-"
        lines.append(
            f"| {r['rows']:,} | {r['mode']} | {r['job']} | {r['partitions']} | "
            f"{r['job_s']:.1f} s | {r['wall_s']:.1f} s | {r['driver_mb']:,} MB | {ex} | "
            f"{p['seconds'] if p else '-'} s | {ratio} | {growth} |")
    return "\n".join(lines)


def native_table(results: Mapping[str, Any]) -> str:
    """The Markdown table of the native audit runs (``native``) beside the plain
    statement, with where the executors' task time went."""
    plain = {p["rows"]: p for p in results.get("native_plain", [])}
    lines = ["| rows | run | audit job time | wall | driver peak | executors peak | "
             "plain statement | audit / plain | task time: reading the database, window "
             "sorts, the rest (CPU) |", "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(results.get("native_jobs", []), key=lambda r: (r["rows"], r["mode"])):
        p = plain.get(r["rows"])
        ratio = f"{r['job_s'] / p['seconds']:.1f}x" if p and p["seconds"] else "-"
        prof = [v for v in (r.get("profile") or {}).values()]
        run = sum(v["run"] for v in prof)
        jdbc = sum(v["jdbc"] for v in prof)
        window = sum(v["window"] for v in prof)
        cpu = sum(v["cpu"] for v in prof)
        where = (f"{run:.0f} s: {jdbc:.0f}, {window:.0f}, {run - jdbc - window:.0f} "
                 f"({cpu:.0f} s CPU)") if prof else "-"
        ex = f"{r['executors_mb']:,} MB" if r["executors_mb"] else "-"
        lines.append(f"| {r['rows']:,} | {r['mode']} | {r['job_s']:.1f} s | {r['wall_s']:.1f} s "
                     f"| {r['driver_mb']:,} MB | {ex} | {p['seconds'] if p else '-'} s | "
                     f"{ratio} | {where} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--rows", required=True,
                        help="destination_rooms rows, comma-separated sizes")
    common.add_argument("--workdir", default=str(ROOT / "artifacts" / "synapse-scale"))
    common.add_argument("--seed", type=int, default=1)
    common.add_argument("--regenerate", action="store_true",
                        help="generate again even if the database exists")
    common.add_argument("--stop", action="store_true",
                        help="stop the PostgreSQL cluster at the end")
    g = sub.add_parser("generate", parents=[common], help="make the databases")
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("check", parents=[common],
                       help="plain query vs construction vs Spark audit")
    c.add_argument("--partitions", type=int, default=4)
    c.add_argument("--driver-memory", default="2g")
    c.add_argument("--partition-counts", action="store_true",
                   help="count the rows of each JDBC partition (reads every table)")
    c.set_defaults(fn=cmd_check)
    r = sub.add_parser("run", parents=[common], help="time the jobs and the plain query")
    r.add_argument("--modes", default="local,standalone")
    r.add_argument("--jobs", default=",".join(JOBS))
    r.add_argument("--partitions", default="rule",
                   help="JDBC and shuffle partitions: N, 'rule' (partitions_rule, the "
                   "default) or 'default' (no --partitions: the command line's default)")
    r.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Spark configuration for every job")
    r.add_argument("--driver-memory", default="4g",
                   help="local mode's driver; 'auto': the command's own sizing")
    r.add_argument("--cluster-driver-memory", default="1g")
    r.add_argument("--executor-memory", default="3g")
    r.add_argument("--worker-memory", default="4g")
    r.add_argument("--work-mem", default="256MB")
    r.add_argument("--plain-repeat", type=int, default=1)
    r.add_argument("--timeout", type=float, default=3 * 3600)
    r.set_defaults(fn=cmd_run)
    n = sub.add_parser("native", parents=[common],
                       help="the native audit beside the plain queries (issue #47)")
    n.add_argument("--variant", action="append", default=None, metavar="ARGS",
                   help="extra batch arguments of one run, e.g. '--partitions 16' "
                   "(repeatable; default: one run with none)")
    n.add_argument("--no-plain", action="store_true", help="skip the plain query")
    n.add_argument("--modes", default="local",
                   help="local, standalone (two workers of one core) or both")
    n.add_argument("--executor-memory", default="3g")
    n.add_argument("--worker-memory", default="4g")
    n.add_argument("--label", default="", help="names the runs in the results (a tree)")
    n.add_argument("--work-mem", default="256MB")
    n.add_argument("--timeout", type=float, default=3 * 3600)
    n.set_defaults(fn=cmd_native)
    t = sub.add_parser("table", parents=[common], help="print the results table")
    t.set_defaults(fn=lambda a: print(table(_load_results(Workdir(Path(a.workdir))))
                                      + "\n\n" + native_table(_load_results(
                                          Workdir(Path(a.workdir))))))
    a = ap.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
