"""The batch computations as plain SQL inside PostgreSQL: the benchmark's baseline and a
cross-check of the Spark transforms (the tests compare both with the same oracle).
Benchmark code, not the package's (``bench/batch.py``, ``bench/synapse_scale.py`` and
``tests/batch/test_sql_baseline.py`` import it); the Synapse audit's plain query is
``bench/synapse_batch_baseline.py``.

Each query takes ``%(server)s`` (our server name) and ``%(hwm)s`` (the high-water mark)
and returns the same rows as the corresponding transform. The as-of lookup "latest local
event of the room at or before the end of a join interval" is a ``LATERAL`` backward
index scan on ``(room_id, stream_ordering)``, the plan PostgreSQL is good at.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.rows import dict_row, tuple_row

_LOCAL = (
    "NOT e.outlier AND NOT e.rejected"
    " AND substring(e.sender from position(':' in e.sender) + 1) = %(server)s"
)

_LATEST_LOCAL = f"""
    SELECT e.stream_ordering AS so FROM events e
    WHERE e.room_id = {{room}} AND e.stream_ordering <= {{upto}} AND {_LOCAL}
    ORDER BY e.stream_ordering DESC LIMIT 1
"""
"""The room's latest local event at or before a position: a backward scan of
``ix_events_room_id_stream_ordering`` that stops at the first local event."""

EXPECTED_DESTINATION_ROOMS = f"""
WITH m AS (
    SELECT room_id, server_name AS destination, membership,
           event_stream_ordering AS start_so,
           lead(event_stream_ordering) OVER (
               PARTITION BY room_id, user_id ORDER BY event_stream_ordering) AS end_so
    FROM room_memberships WHERE event_stream_ordering <= %(hwm)s
), iv AS MATERIALIZED (
    SELECT * FROM m WHERE membership = 'join' AND destination <> %(server)s
), newest AS MATERIALIZED (
    SELECT r.room_id, le.so
    FROM (SELECT DISTINCT room_id FROM iv WHERE end_so IS NULL) r
    CROSS JOIN LATERAL ({_LATEST_LOCAL.format(room="r.room_id", upto="%(hwm)s")}) le
)
SELECT destination, room_id, max(so) AS stream_ordering FROM (
    SELECT iv.destination, iv.room_id, n.so
    FROM iv JOIN newest n ON n.room_id = iv.room_id
    WHERE iv.end_so IS NULL AND n.so >= iv.start_so
    UNION ALL
    SELECT iv.destination, iv.room_id, le.so
    FROM iv CROSS JOIN LATERAL ({_LATEST_LOCAL.format(room="iv.room_id", upto="iv.end_so")}) le
    WHERE iv.end_so IS NOT NULL AND le.so >= iv.start_so
) s
GROUP BY destination, room_id
"""
"""Per (destination, room) the latest local event the destination should have (see
:mod:`federation_sender.batch.transforms`). A still-joined server (an open interval) is
owed the room's newest local event, looked up once per room; a closed interval looks up
the newest local event at or before its end."""

DIFF = f"""
WITH x AS ({EXPECTED_DESTINATION_ROOMS}),
a AS (SELECT * FROM destination_rooms WHERE stream_ordering <= %(hwm)s)
SELECT coalesce(x.destination, a.destination) AS destination,
       coalesce(x.room_id, a.room_id) AS room_id,
       x.stream_ordering AS expected_so, a.stream_ordering AS actual_so,
       CASE WHEN a.stream_ordering IS NULL THEN 'missing'
            WHEN x.stream_ordering IS NULL THEN 'stale'
            WHEN a.stream_ordering < x.stream_ordering THEN 'behind'
            ELSE 'ahead' END AS problem
FROM x FULL OUTER JOIN a ON x.destination = a.destination AND x.room_id = a.room_id
WHERE x.stream_ordering IS DISTINCT FROM a.stream_ordering
"""

_DELIVERED = """d AS (
    SELECT t.destination, e.room_id, max(e.stream_ordering) AS delivered_so
    FROM federation_transaction_log t
    CROSS JOIN LATERAL jsonb_array_elements_text(t.pdu_event_ids::jsonb) AS p(event_id)
    JOIN events e ON e.event_id = p.event_id
    WHERE t.status = 'success'
    GROUP BY t.destination, e.room_id
)"""
"""Per (destination, room) the newest event a successful transaction carried."""

UNDELIVERED = f"""
WITH x AS ({EXPECTED_DESTINATION_ROOMS}),
{_DELIVERED}
SELECT x.destination, x.room_id, x.stream_ordering, d.delivered_so,
       ds.last_successful_stream_ordering,
       CASE WHEN ds.last_successful_stream_ordering >= x.stream_ordering
            THEN 'lost' ELSE 'pending' END AS status
FROM x
LEFT JOIN d ON d.destination = x.destination AND d.room_id = x.room_id
LEFT JOIN destinations ds ON ds.destination = x.destination
WHERE d.delivered_so IS NULL OR d.delivered_so < x.stream_ordering
"""

AUDIT_COUNTS = f"""
WITH x AS MATERIALIZED ({EXPECTED_DESTINATION_ROOMS}),
a AS (SELECT * FROM destination_rooms WHERE stream_ordering <= %(hwm)s),
{_DELIVERED}, u AS (
    SELECT ds.last_successful_stream_ordering >= x.stream_ordering AS lost
    FROM x
    LEFT JOIN d ON d.destination = x.destination AND d.room_id = x.room_id
    LEFT JOIN destinations ds ON ds.destination = x.destination
    WHERE d.delivered_so IS NULL OR d.delivered_so < x.stream_ordering
), r AS (
    SELECT x.stream_ordering AS expected_so, a.stream_ordering AS actual_so
    FROM x FULL OUTER JOIN a ON x.destination = a.destination AND x.room_id = a.room_id
    WHERE x.stream_ordering IS DISTINCT FROM a.stream_ordering
)
SELECT (SELECT count(*) FILTER (WHERE lost) FROM u) AS undelivered_lost,
       (SELECT count(*) FILTER (WHERE lost IS NOT TRUE) FROM u) AS undelivered_pending,
       count(*) FILTER (WHERE actual_so IS NULL) AS rows_missing,
       count(*) FILTER (WHERE expected_so IS NULL) AS rows_stale,
       count(*) FILTER (WHERE actual_so < expected_so) AS rows_behind,
       count(*) FILTER (WHERE actual_so > expected_so) AS rows_ahead
FROM r
"""
"""The audit's classes as one statement: the expected rows computed once, then the
undelivered pairs (``lost`` or ``pending``, as :data:`UNDELIVERED`) and the
``destination_rooms`` differences (as :data:`DIFF`; its ``missing`` includes the rows
the Spark audit calls pruned after delivery) counted from them."""

HEALTH = """
WITH l AS (
    SELECT *, (status = 'success')::int AS ok,
           sum((status = 'success')::int) OVER w AS successes_so_far,
           min(started_ts) FILTER (WHERE status = 'success') OVER (
               PARTITION BY destination ORDER BY started_ts, id
               ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING) AS next_success_ts,
           row_number() OVER w
             - row_number() OVER (PARTITION BY destination, catchup
                                  ORDER BY started_ts, id) AS island
    FROM federation_transaction_log
    WINDOW w AS (PARTITION BY destination ORDER BY started_ts, id)
), backoff AS (
    SELECT destination, sum(ms) AS backoff_ms FROM (
        SELECT destination, coalesce(min(next_success_ts), %(horizon)s) - min(started_ts) AS ms
        FROM l WHERE ok = 0 GROUP BY destination, successes_so_far) s
    GROUP BY destination
), catchup AS (
    SELECT destination, sum(ms) AS catchup_ms, sum(n) AS catchup_transactions FROM (
        SELECT destination, max(started_ts + duration_ms) - min(started_ts) AS ms,
               count(*) AS n
        FROM l WHERE catchup GROUP BY destination, island) s
    GROUP BY destination
), traffic AS (
    SELECT destination, count(*) AS transactions, sum(ok) AS successes,
           sum(CASE WHEN ok = 1 THEN pdu_count ELSE 0 END) AS pdus_sent,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY duration_ms) AS p50,
           percentile_cont(0.95) WITHIN GROUP (ORDER BY duration_ms) AS p95,
           percentile_cont(0.99) WITHIN GROUP (ORDER BY duration_ms) AS p99
    FROM l GROUP BY destination
), rooms AS (
    SELECT r.destination, max(r.stream_ordering) AS max_so,
           count(*) FILTER (WHERE r.stream_ordering
                            > coalesce(ds.last_successful_stream_ordering, -1)) AS outstanding
    FROM destination_rooms r LEFT JOIN destinations ds USING (destination)
    GROUP BY r.destination
), alld AS (
    SELECT destination FROM federation_transaction_log
    UNION SELECT destination FROM destinations
    UNION SELECT destination FROM destination_rooms
)
SELECT alld.destination, coalesce(t.transactions, 0) AS transactions,
       coalesce(t.successes, 0) AS successes,
       t.successes::float8 / t.transactions AS success_rate,
       t.p50 AS latency_p50_ms, t.p95 AS latency_p95_ms, t.p99 AS latency_p99_ms,
       coalesce(b.backoff_ms, 0) AS backoff_ms, coalesce(c.catchup_ms, 0) AS catchup_ms,
       coalesce(c.catchup_transactions, 0) AS catchup_transactions,
       greatest(coalesce(r.max_so - coalesce(ds.last_successful_stream_ordering, 0), 0), 0)
           AS lag_stream_positions,
       coalesce(r.outstanding, 0) AS outstanding_rooms
FROM alld
LEFT JOIN traffic t USING (destination)
LEFT JOIN backoff b USING (destination)
LEFT JOIN catchup c USING (destination)
LEFT JOIN rooms r USING (destination)
LEFT JOIN destinations ds USING (destination)
"""

QUERIES: Mapping[str, str] = {
    "audit-counts": AUDIT_COUNTS,
    "backfill-destination-rooms": DIFF,
    "audit": UNDELIVERED,
    "health-report": HEALTH,
    "expected-destination-rooms": EXPECTED_DESTINATION_ROOMS,
}


def high_water_mark(conn: psycopg.Connection[Any]) -> int:
    with conn.cursor(row_factory=tuple_row) as cur:
        row = cur.execute("SELECT coalesce(max(stream_ordering), 0) FROM events").fetchone()
    assert row is not None
    return int(row[0])


def run_query(url: str, name: str, server_name: str, horizon_ms: int = 0,
              work_mem: str | None = None) -> list[dict[str, Any]]:
    """Run one baseline query; rows as dicts. ``work_mem`` raises PostgreSQL's per-sort
    memory for the session (the benchmark gives it as much as Spark gets)."""
    with psycopg.connect(url, row_factory=dict_row) as conn:
        if work_mem:
            conn.execute(f"SET work_mem = '{work_mem}'")
        # The planner can not estimate the "local sender" filter and picks a bitmap scan
        # of the room's whole history per join interval (quadratic in big rooms) over the
        # backward index scan that stops at the first local event; JIT only adds
        # compile time here.
        conn.execute("SET enable_bitmapscan = off")
        conn.execute("SET jit = off")
        hwm = high_water_mark(conn)
        return conn.execute(
            QUERIES[name],
            {"server": server_name, "hwm": hwm, "horizon": horizon_ms},
        ).fetchall()
