"""The batch jobs' reads of a Synapse database: which tables and columns, as the
queries Spark's executors run over JDBC, and how each is split into parallel reads.

Each :class:`SynapseRead` is one frame the jobs see (``batch/synapse_source.py`` loads
it): a ``SELECT`` run as a JDBC subquery, the columns it returns, and a split:

* :class:`RangeSplit`: a numeric column the executors read in ranges (Spark's
  ``partitionColumn``), bounds from ``min``/``max`` on the driver: ``events`` on
  ``stream_ordering`` (its unique index; the stream is dense, so the ranges are even),
  our transaction log on ``id``;
* :class:`RoomSplit`: ranges of ``room_id`` (``WHERE room_id >= a AND room_id < b``
  predicates, one per executor task), the boundaries quantiles of Synapse's small
  ``rooms`` table, the same ranges for every such read: ``current_members``
  (``current_state_events`` has no numeric key worth ranging on, and ``room_id`` leads
  its unique index) and ``destination_rooms`` (its ``destination_rooms_room_id``
  index), so each range is an index range scan. Not ``destination_rooms`` on
  ``stream_ordering``: a row is its room's newest event, so the rows crowd the top of
  the stream and its last range held two thirds of them (docs/batch.md, "JDBC reads:
  partitions"); the ranges of rooms hold equal numbers of rooms, and so about equal
  numbers of rows (one room's rows stay in one range);
* none: the small tables (``destinations``, ``federation_stream_position``,
  ``erased_users``, ``partial_state_rooms``), one read each.

What the frames carry, and why the jobs need nothing else:

* ``events``: ``events`` with ``event_json.internal_metadata`` (``proactively_send``,
  ``out_of_band_membership``, ``send_on_behalf_of``: the worker's sending rules read
  them, :mod:`.events`) and ``rejected`` (``events.rejection_reason`` or a row in
  ``rejections``). Never the event JSON: it is most of the table's bytes.
* ``current_members``: the joined members now, from ``current_state_events`` (type
  ``m.room.member``) joined with ``room_memberships`` (membership ``join``), with the
  member event's stream ordering (``event_stream_ordering``; for rows written before
  Synapse filled that column, the event's own).
* ``destinations``: Synapse's retry state and catch-up position, as they are.
* ``sender_positions``: ``federation_stream_position`` of type ``events``: how far each
  federation sender instance has processed the events stream.
* ``federation_transaction_log``: ours, in schema ``federation_sender`` (named with its
  schema: the executors' JDBC connections have Synapse's search path, not ours).

Nothing here writes (the repair is :mod:`.batch_apply`). The driver's own reads (the
high-water mark, the bounds, whether our schema is there) are plain DB-API calls on a
psycopg connection, as :mod:`federation_sender.storage.batch_reads` does for ours.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise

from federation_sender.storage.batch_apply import checked_identifier
from federation_sender.storage.batch_reads import DriverConnection
from federation_sender.storage.synapse.database import OWN_SCHEMA

TXN_LOG = f"{OWN_SCHEMA}.federation_transaction_log"


@dataclass(frozen=True)
class RangeSplit:
    """Read in ranges of ``column`` (an output column of the query), bounds from
    ``min``/``max`` of ``table.column``."""

    column: str
    table: str
    bounded_by_high_water_mark: bool = False
    """Only rows at or below the job's high-water mark are read (``events``)."""


@dataclass(frozen=True)
class RoomSplit:
    """Read in ranges of ``room_id``, cut at quantiles of ``rooms.room_id``."""


@dataclass(frozen=True)
class SynapseRead:
    sql: str
    columns: tuple[str, ...]
    split: RangeSplit | RoomSplit | None = None


READS: Mapping[str, SynapseRead] = {
    "events": SynapseRead(
        """
        SELECT e.stream_ordering, e.event_id, e.room_id, e.sender, e.depth, e.outlier,
               (e.rejection_reason IS NOT NULL
                OR EXISTS (SELECT 1 FROM rejections r WHERE r.event_id = e.event_id))
                   AS rejected,
               j.internal_metadata
        FROM events e LEFT JOIN event_json j ON j.event_id = e.event_id
        WHERE e.stream_ordering IS NOT NULL
        """,
        ("stream_ordering", "event_id", "room_id", "sender", "depth", "outlier", "rejected",
         "internal_metadata"),
        RangeSplit("stream_ordering", "events", bounded_by_high_water_mark=True),
    ),
    "current_members": SynapseRead(
        """
        SELECT c.room_id, c.state_key AS user_id,
               COALESCE(c.event_stream_ordering, m.event_stream_ordering,
                        (SELECT e.stream_ordering FROM events e
                         WHERE e.event_id = c.event_id)) AS stream_ordering
        FROM current_state_events c JOIN room_memberships m ON m.event_id = c.event_id
        WHERE c.type = 'm.room.member' AND m.membership = 'join'
        """,
        ("room_id", "user_id", "stream_ordering"),
        RoomSplit(),
    ),
    "destination_rooms": SynapseRead(
        "SELECT destination, room_id, stream_ordering FROM destination_rooms",
        ("destination", "room_id", "stream_ordering"),
        RoomSplit(),
    ),
    "destinations": SynapseRead(
        "SELECT destination, retry_last_ts, retry_interval, failure_ts,"
        " last_successful_stream_ordering FROM destinations",
        ("destination", "retry_last_ts", "retry_interval", "failure_ts",
         "last_successful_stream_ordering"),
    ),
    "sender_positions": SynapseRead(
        "SELECT instance_name, stream_id FROM federation_stream_position"
        " WHERE type = 'events'",
        ("instance_name", "stream_id"),
    ),
    "erased_users": SynapseRead("SELECT user_id FROM erased_users", ("user_id",)),
    "partial_state_rooms": SynapseRead("SELECT room_id FROM partial_state_rooms", ("room_id",)),
    "federation_transaction_log": SynapseRead(
        "SELECT id, destination, status, http_status, started_ts, duration_ms, catchup,"
        f" pdu_count, max_stream_ordering, pdu_event_ids, error FROM {TXN_LOG}",
        ("id", "destination", "status", "http_status", "started_ts", "duration_ms",
         "catchup", "pdu_count", "max_stream_ordering", "pdu_event_ids", "error"),
        RangeSplit("id", TXN_LOG),
    ),
}
"""Every frame the jobs read on a Synapse deployment, by name."""

TXN_LOG_DDL = (
    "id long, destination string, status string, http_status int, started_ts long, "
    "duration_ms int, catchup boolean, pdu_count int, max_stream_ordering long, "
    "pdu_event_ids string, error string"
)
"""The transaction log's frame when our schema is not there (Synapse's own sender has
been the only one): empty, with the types a read would have."""


def subquery(name: str) -> str:
    """``READS[name]`` as a JDBC ``dbtable``: ``(SELECT …) AS <name>``."""
    return f"({READS[name].sql.strip()}) AS {checked_identifier(name)}"


def has_own_schema(conn: DriverConnection) -> bool:
    """Whether our schema (and so our transaction log) exists beside Synapse's."""
    row = conn.execute(
        "SELECT 1 FROM information_schema.tables"
        f" WHERE table_schema = '{OWN_SCHEMA}' AND table_name = 'federation_transaction_log'"
    ).fetchone()
    return row is not None


def range_bounds(conn: DriverConnection, split: RangeSplit) -> tuple[int, int] | None:
    """``(min, max)`` of the split's column, ``None`` when its table is empty."""
    schema, _, table = split.table.rpartition(".")
    name = ".".join(checked_identifier(p) for p in (schema, table) if p)
    c = checked_identifier(split.column)
    row = conn.execute(f"SELECT min({c}), max({c}) FROM {name}").fetchone()
    if row is None or row[0] is None:
        return None
    return int(row[0]), int(row[1])


def room_predicates(conn: DriverConnection, parts: int) -> list[str]:
    """``parts`` disjoint ``room_id`` ranges covering every room id (fewer when there
    are few rooms), as WHERE clauses over a frame with a ``room_id`` column."""
    if parts <= 1:
        return []
    fractions = ", ".join(f"{i / parts:.6f}" for i in range(1, parts))
    row = conn.execute(
        f"SELECT percentile_disc(ARRAY[{fractions}]) WITHIN GROUP (ORDER BY room_id)"
        " FROM rooms"
    ).fetchone()
    cuts = sorted({str(c) for c in (row[0] if row and row[0] else []) if c is not None})
    if not cuts:
        return []
    lits = [_literal(c) for c in cuts]
    preds = [f"room_id < {lits[0]}"]
    preds += [f"room_id >= {a} AND room_id < {b}" for a, b in pairwise(lits)]
    preds.append(f"room_id >= {lits[-1]}")
    return preds


def _literal(value: str) -> str:
    """A PostgreSQL string literal (standard_conforming_strings, the default since 9.1)."""
    if "\x00" in value:
        raise ValueError("a room id with a NUL byte")
    return "'" + value.replace("'", "''") + "'"
