"""The Synapse audit as one plain PostgreSQL query: what an operator would write instead
of the Spark job, and the baseline ``bench/synapse_scale.py`` races it against.

:data:`FINDINGS` returns one row per (destination, room) with an event the destination
should have, with the class and reason of
:data:`federation_sender.batch.synapse_transforms.RULES` (first match wins), computed
from the same tables the job reads (:mod:`federation_sender.storage.synapse.batch_reads`):

* the newest sendable event per room (not an outlier, not rejected, a depth canonical
  JSON can carry, not ``proactively_send: false`` nor an out-of-band membership, a
  local sender or a relayed join, no erased sender) is a backward scan of Synapse's
  ``events_room_stream`` index ``(room_id, stream_ordering)`` per room of ``rooms``
  (``LATERAL … ORDER BY stream_ordering DESC LIMIT 1``): it stops at the first
  sendable event, so it reads a handful of rows per room instead of every event;
* a room whose newest sendable event is a join relayed for server X gets the runner-up
  (the newest one not relayed for X) the same way, for X only;
* the joined servers now and since when from ``current_state_events`` and
  ``room_memberships``; delivered positions from our transaction log's successful
  transactions (``jsonb_array_elements_text`` of ``pdu_event_ids``, joined with
  ``events`` by id).

:data:`COUNTS` wraps it: pairs and destinations per (status, reason), what the job's
summary reports. Parameters: ``%(server)s`` (our server name), ``%(hwm)s`` (the
high-water mark: events above it are not considered), ``%(now_ms)s`` (for the backoff
rule). :func:`run_counts` runs it with the session settings the benchmark uses.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

from federation_sender.storage.synapse.batch_reads import TXN_LOG

_MAX_DEPTH = 2**53 - 1

_SENDABLE = f"""
    e.stream_ordering <= %(hwm)s
    AND NOT e.outlier
    AND e.rejection_reason IS NULL
    AND NOT EXISTS (SELECT 1 FROM rejections rj WHERE rj.event_id = e.event_id)
    AND e.depth BETWEEN -{_MAX_DEPTH} AND {_MAX_DEPTH}
    AND (j.meta ->> 'proactively_send') IS DISTINCT FROM 'false'
    AND (j.meta ->> 'out_of_band_membership') IS DISTINCT FROM 'true'
    AND (CASE WHEN position(':' in e.sender) > 0
              THEN substring(e.sender from position(':' in e.sender) + 1) ELSE '' END
         = %(server)s
         OR coalesce(j.meta ->> 'send_on_behalf_of', '') <> '')
    AND NOT EXISTS (SELECT 1 FROM erased_users eu WHERE eu.user_id = e.sender)
"""
"""The worker's sending rules over ``events e`` and ``j`` (``meta``: the parsed
``internal_metadata``), as :func:`~federation_sender.batch.synapse_transforms
.sendable_events` and the erased-sender filter apply them."""

_EVENT = """
    SELECT e.stream_ordering, e.event_id,
           nullif(j.meta ->> 'send_on_behalf_of', '') AS obo
    FROM events e
    CROSS JOIN LATERAL (SELECT ej.internal_metadata::jsonb AS meta FROM event_json ej
                        WHERE ej.event_id = e.event_id) j
"""

FINDINGS = f"""
WITH newest AS MATERIALIZED (
    SELECT r.room_id, a.stream_ordering AS a_so, a.event_id AS a_id, a.obo AS a_obo
    FROM rooms r
    CROSS JOIN LATERAL ({_EVENT}
        WHERE e.room_id = r.room_id AND {_SENDABLE}
        ORDER BY e.stream_ordering DESC LIMIT 1) a
), runner_up AS MATERIALIZED (
    SELECT n.room_id, b.stream_ordering AS b_so, b.event_id AS b_id
    FROM newest n
    CROSS JOIN LATERAL ({_EVENT}
        WHERE e.room_id = n.room_id AND {_SENDABLE}
          AND (nullif(j.meta ->> 'send_on_behalf_of', '')) IS DISTINCT FROM n.a_obo
        ORDER BY e.stream_ordering DESC LIMIT 1) b
    WHERE n.a_obo IS NOT NULL
), servers AS (
    SELECT c.room_id,
           CASE WHEN position(':' in c.state_key) > 0
                THEN substring(c.state_key from position(':' in c.state_key) + 1)
                ELSE '' END AS destination,
           coalesce(min(coalesce(c.event_stream_ordering, m.event_stream_ordering,
                                 (SELECT e.stream_ordering FROM events e
                                  WHERE e.event_id = c.event_id))),
                    -{2**62}) AS joined_since_so
    FROM current_state_events c JOIN room_memberships m ON m.event_id = c.event_id
    WHERE c.type = 'm.room.member' AND m.membership = 'join'
    GROUP BY 1, 2
), owed AS (
    SELECT s.destination, s.room_id, s.joined_since_so,
           CASE WHEN n.a_obo = s.destination THEN u.b_so ELSE n.a_so END AS stream_ordering,
           CASE WHEN n.a_obo = s.destination THEN u.b_id ELSE n.a_id END AS event_id
    FROM servers s
    JOIN newest n ON n.room_id = s.room_id
    LEFT JOIN runner_up u ON u.room_id = s.room_id
    WHERE s.destination <> %(server)s
), delivered AS (
    SELECT t.destination, e.room_id, max(e.stream_ordering) AS delivered_so
    FROM {TXN_LOG} t
    CROSS JOIN LATERAL jsonb_array_elements_text(t.pdu_event_ids::jsonb) AS p(event_id)
    JOIN events e ON e.event_id = p.event_id
    WHERE t.status = 'success' AND e.stream_ordering <= %(hwm)s
    GROUP BY 1, 2
), facts AS MATERIALIZED (
    SELECT (SELECT min(stream_id) FROM federation_stream_position
            WHERE type = 'events') AS sender_so,
           (SELECT min(max_stream_ordering) FROM {TXN_LOG}
            WHERE NOT catchup AND max_stream_ordering IS NOT NULL) AS log_from_so
), pairs AS (
    SELECT o.destination, o.room_id, o.event_id, o.stream_ordering, o.joined_since_so,
           dr.stream_ordering AS row_so, ds.last_successful_stream_ordering,
           dl.delivered_so, ds.retry_last_ts, ds.retry_interval, ds.failure_ts,
           f.sender_so, f.log_from_so,
           coalesce(ds.last_successful_stream_ordering, -1) >= o.stream_ordering AS past,
           (f.log_from_so IS NULL OR o.stream_ordering < f.log_from_so) AS before_log
    FROM owed o
    CROSS JOIN facts f
    LEFT JOIN destination_rooms dr
           ON dr.destination = o.destination AND dr.room_id = o.room_id
    LEFT JOIN destinations ds ON ds.destination = o.destination
    LEFT JOIN delivered dl ON dl.destination = o.destination AND dl.room_id = o.room_id
    WHERE o.stream_ordering >= o.joined_since_so
)
SELECT destination, room_id, event_id, stream_ordering, row_so,
       last_successful_stream_ordering, delivered_so,
       CASE
           WHEN sender_so IS NULL OR stream_ordering > sender_so THEN 'pending'
           WHEN row_so IS NULL OR row_so < stream_ordering THEN 'missing_row'
           WHEN delivered_so >= stream_ordering THEN 'delivered'
           WHEN before_log AND past THEN 'delivered'
           WHEN NOT past THEN 'pending'
           ELSE 'lost'
       END AS status,
       CASE
           WHEN sender_so IS NULL OR stream_ordering > sender_so THEN 'sender_behind'
           WHEN row_so IS NULL THEN 'no_row'
           WHEN row_so < stream_ordering THEN 'row_behind'
           WHEN delivered_so >= stream_ordering THEN 'in_log'
           WHEN before_log AND past THEN 'before_log'
           WHEN NOT past AND coalesce(retry_interval, 0) > 0
                AND coalesce(retry_last_ts, 0) + retry_interval > %(now_ms)s THEN 'backoff'
           WHEN NOT past THEN 'catch_up'
           ELSE 'not_in_log'
       END AS reason
FROM pairs
"""
"""Every finding: ``destination``, ``room_id``, ``event_id``, ``stream_ordering``,
``row_so``, ``last_successful_stream_ordering``, ``delivered_so``, ``status``,
``reason``."""

COUNTS = f"""
SELECT status, reason, count(*) AS pairs, count(DISTINCT destination) AS destinations
FROM ({FINDINGS}) f
GROUP BY status, reason
ORDER BY status, reason
"""
"""``status``, ``reason``, ``pairs``, ``destinations``: the audit's summary counts."""


def high_water_mark(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT coalesce(max(stream_ordering), 0) FROM events").fetchone()
    assert row is not None
    return int(row[0])


def run_counts(url: str, server_name: str, now_ms: int, *, hwm: int | None = None,
               work_mem: str | None = "256MB") -> dict[tuple[str, str], tuple[int, int]]:
    """:data:`COUNTS` on ``url``: (status, reason) -> (pairs, destinations). JIT is off
    (it only adds compile time to this plan); ``work_mem`` is the sorts' and hashes'
    memory, as the benchmark gives it."""
    with psycopg.connect(url, row_factory=tuple_row) as conn:
        conn.execute("SET jit = off")
        if work_mem:
            conn.execute(sql.SQL("SET work_mem = {}").format(sql.Literal(work_mem)))
        top = high_water_mark(conn) if hwm is None else hwm
        rows = conn.execute(COUNTS, {"server": server_name, "hwm": top,
                                     "now_ms": now_ms}).fetchall()
    return {(str(s), str(r)): (int(n), int(d)) for s, r, n, d in rows}
