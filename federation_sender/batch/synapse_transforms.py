"""Pure DataFrame transforms of the jobs on a Synapse deployment: frames in, frames out.

The input frames are those of :data:`federation_sender.storage.synapse.batch_reads
.READS` (Synapse's tables as the storage reads them); :func:`audit_findings` is the
whole audit, so it can be run and timed on generated frames as on a database.

Which event a destination should have
-------------------------------------
For each destination D with a joined member in room R *now* (the current state), the
newest event of R that the worker's sending rules would send to D:

* sendable (the worker's ``is_sendable`` and Synapse's ``_process_event_queue_loop``):
  not an outlier, not rejected, a depth canonical JSON can carry, neither
  ``proactively_send: false`` nor an out-of-band membership in its internal metadata,
  and a local sender or a join relayed for another server (``send_on_behalf_of``),
  which is never sent back to that server;
* not withheld by catch-up (:mod:`federation_sender.visibility`): an erased sender's
  events never count. History visibility does not need reading: only events since D's
  current join count (at or after the earliest current join event of D's members),
  and D is joined in the state after each of them, which every visibility admits.

Per room this is the newest sendable event A, or for the server A was relayed for, the
newest one not relayed for that server: two aggregations over the events, not a join of
events with servers.

Classes
-------
:data:`RULES` decide, first match wins, from the destination's row, its position, its
retry state, the sender's position and our transaction log. "The receiver has it" is
today's notion (the native audit's): a successful transaction of ours carried the event
or a later event of the room to D. The log vouches only from the first stream position
our worker sent live (``log_from_so``); for older events the positions are trusted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from federation_sender.batch.transforms import delivered_positions, server_of

CANONICALJSON_MAX_INT = 2**53 - 1
_FOREVER = -(2**62)
"""``joined_since_so`` of a member whose join event has no stream ordering at all."""


def sendable_events(events: DataFrame, server_name: str) -> DataFrame:
    """The events the worker sends (see the module docstring), with the server a
    relayed join was made for. Columns: ``stream_ordering``, ``event_id``, ``room_id``,
    ``sender``, ``on_behalf_of``."""
    meta = F.col("internal_metadata")
    obo = F.get_json_object(meta, "$.send_on_behalf_of")
    relayed = obo.isNotNull() & (obo != F.lit(""))
    not_proactive = F.coalesce(
        F.get_json_object(meta, "$.proactively_send") == F.lit("false"), F.lit(False))
    out_of_band = F.coalesce(
        F.get_json_object(meta, "$.out_of_band_membership") == F.lit("true"), F.lit(False))
    return events.filter(
        meta.isNotNull()  # no event_json row: the worker never sends it either
        & ~F.col("outlier")
        & ~F.col("rejected")
        & F.col("depth").between(-CANONICALJSON_MAX_INT, CANONICALJSON_MAX_INT)
        & ~not_proactive
        & ~out_of_band
        & ((server_of(F.col("sender")) == F.lit(server_name)) | relayed)
    ).select("stream_ordering", "event_id", "room_id", "sender",
             F.when(relayed, obo).alias("on_behalf_of"))


def current_servers(members: DataFrame, server_name: str) -> DataFrame:
    """Remote servers with a joined member now, and since when: the earliest current
    join event of their members. Columns: ``room_id``, ``destination``,
    ``joined_since_so``."""
    return (
        members.select("room_id", server_of(F.col("user_id")).alias("destination"),
                       "stream_ordering")
        .filter(F.col("destination") != F.lit(server_name))
        .groupBy("room_id", "destination")
        .agg(F.coalesce(F.min("stream_ordering"), F.lit(_FOREVER)).alias("joined_since_so"))
    )


def newest_for_destinations(
    sendable: DataFrame, servers: DataFrame, erased_users: DataFrame
) -> DataFrame:
    """For each (destination, room) of ``servers``, the newest event it should have
    received (see the module docstring); pairs with none are left out. Columns:
    ``destination``, ``room_id``, ``joined_since_so``, ``stream_ordering``,
    ``event_id``."""
    # Small tables (erased users, destinations, partial-state rooms, the sender's
    # position) are broadcast: no shuffle of the big side for them.
    erased = F.broadcast(erased_users.select(F.col("user_id").alias("sender")).distinct())
    evs = sendable.join(erased, "sender", "left_anti")
    newest = evs.groupBy("room_id").agg(
        F.max_by(F.struct("stream_ordering", "event_id", "on_behalf_of"),
                 "stream_ordering").alias("a"))
    a = newest.select("room_id", F.col("a.stream_ordering").alias("a_so"),
                      F.col("a.event_id").alias("a_id"),
                      F.col("a.on_behalf_of").alias("a_obo"))
    # Only rooms whose newest event is a relayed join need the runner-up.
    relayed = a.filter(F.col("a_obo").isNotNull()).select("room_id", "a_obo")
    b = (
        evs.join(relayed, "room_id")
        .filter(~F.col("on_behalf_of").eqNullSafe(F.col("a_obo")))
        .groupBy("room_id")
        .agg(F.max_by(F.struct("stream_ordering", "event_id"), "stream_ordering").alias("b"))
        .select("room_id", F.col("b.stream_ordering").alias("b_so"),
                F.col("b.event_id").alias("b_id"))
    )
    own = F.col("a_obo").eqNullSafe(F.col("destination"))
    return (
        servers.join(a, "room_id")
        .join(b, "room_id", "left")
        .select(
            "destination", "room_id", "joined_since_so",
            F.when(own, F.col("b_so")).otherwise(F.col("a_so")).alias("stream_ordering"),
            F.when(own, F.col("b_id")).otherwise(F.col("a_id")).alias("event_id"),
        )
        .filter(F.col("stream_ordering") >= F.col("joined_since_so"))
    )


# --- classes ---------------------------------------------------------------------------

def _c(name: str) -> Column:
    return F.col(name)


def _past() -> Column:
    """The destination's position is at or past the event: catch-up will not send it."""
    return F.coalesce(_c("last_successful_stream_ordering"), F.lit(-1)) >= _c("stream_ordering")


def _before_log() -> Column:
    return _c("log_from_so").isNull() | (_c("stream_ordering") < _c("log_from_so"))


def _backing_off() -> Column:
    return (F.coalesce(_c("retry_interval"), F.lit(0)) > 0) & (
        F.coalesce(_c("retry_last_ts"), F.lit(0)) + _c("retry_interval") > _c("now_ms"))


@dataclass(frozen=True)
class Rule:
    status: str
    reason: str
    when: Callable[[], Column]
    means: str


RULES: tuple[Rule, ...] = (
    Rule("pending", "sender_behind",
         lambda: _c("sender_so").isNull() | (_c("stream_ordering") > _c("sender_so")),
         "the sender's events position (federation_stream_position) is below the event"),
    Rule("missing_row", "no_row", lambda: _c("row_so").isNull(),
         "no destination_rooms row: catch-up can never send the room"),
    Rule("missing_row", "row_behind", lambda: _c("row_so") < _c("stream_ordering"),
         "the row is older than the event: catch-up stops short of it"),
    Rule("delivered", "in_log", lambda: _c("delivered_so") >= _c("stream_ordering"),
         "a successful transaction carried it or a later event of the room"),
    Rule("delivered", "before_log", lambda: _before_log() & _past(),
         "older than our transaction log, and the position is past it"),
    Rule("pending", "backoff", lambda: ~_past() & _backing_off(),
         "position below the event, retry_last_ts + retry_interval still ahead"),
    Rule("pending", "catch_up", lambda: ~_past(),
         "position below the event, no backoff: catch-up sends it"),
    Rule("lost", "not_in_log", lambda: F.lit(True),
         "position past the event, which no successful transaction carried"),
)
"""The audit's decision table, first match wins (docs/batch.md draws it)."""

STATUSES = ("delivered", "pending", "lost", "missing_row")


def _rule_index() -> Column:
    expr: Column = F.lit(len(RULES) - 1)
    for i in range(len(RULES) - 2, -1, -1):
        expr = F.when(RULES[i].when(), F.lit(i)).otherwise(expr)
    return expr


def sender_position(sender_positions: DataFrame) -> DataFrame:
    """One row: ``sender_so``, the lowest events position of the sender instances."""
    return sender_positions.agg(F.min("stream_id").alias("sender_so"))


def log_start(txn_log: DataFrame) -> DataFrame:
    """One row: ``log_from_so``, the stream ordering of our worker's first live
    transaction with PDUs (null: no log). Events from there on were ours to send."""
    return txn_log.filter(~F.col("catchup") & F.col("max_stream_ordering").isNotNull()).agg(
        F.min("max_stream_ordering").alias("log_from_so"))


def audit_findings(tables: Mapping[str, DataFrame], server_name: str, now_ms: int) -> DataFrame:
    """One row per (destination, room) with an event the destination should have, and
    its class. ``tables`` are the frames of ``READS`` (``events`` bounded by the job's
    high-water mark). Columns: ``destination``, ``room_id``, ``event_id``,
    ``stream_ordering``, ``joined_since_so``, ``row_so``,
    ``last_successful_stream_ordering``, ``delivered_so``, ``retry_last_ts``,
    ``retry_interval``, ``failure_ts``, ``sender_so``, ``log_from_so``,
    ``partial_state``, ``owed`` (the receiver can not have it), ``status``,
    ``reason``."""
    events = tables["events"]
    servers = current_servers(tables["current_members"], server_name)
    newest = newest_for_destinations(
        sendable_events(events, server_name), servers, tables["erased_users"])
    rows = tables["destination_rooms"].select(
        "destination", "room_id", F.col("stream_ordering").alias("row_so"))
    dests = F.broadcast(tables["destinations"].select(
        "destination", "last_successful_stream_ordering", "retry_last_ts", "retry_interval",
        "failure_ts"))
    delivered = delivered_positions(tables["federation_transaction_log"], events)
    partial = F.broadcast(tables["partial_state_rooms"].select(
        "room_id", F.lit(True).alias("partial_state")).distinct())
    facts = sender_position(tables["sender_positions"]).crossJoin(
        log_start(tables["federation_transaction_log"]))
    idx = _rule_index()
    owed = ~(F.coalesce(_c("delivered_so"), F.lit(-1)) >= _c("stream_ordering")) & ~(
        _before_log() & _past())
    return (
        newest.join(rows, ["destination", "room_id"], "left")
        .join(dests, "destination", "left")
        .join(delivered, ["destination", "room_id"], "left")
        .join(partial, "room_id", "left")
        .crossJoin(F.broadcast(facts))
        .withColumn("now_ms", F.lit(now_ms).cast("long"))
        .withColumn("partial_state", F.coalesce(_c("partial_state"), F.lit(False)))
        .withColumn("owed", owed)
        .withColumn("rule", idx)
        .select(
            "destination", "room_id", "event_id", "stream_ordering", "joined_since_so",
            "row_so", "last_successful_stream_ordering", "delivered_so", "retry_last_ts",
            "retry_interval", "failure_ts", "sender_so", "log_from_so", "partial_state",
            "owed",
            F.array(*[F.lit(r.status) for r in RULES])[_c("rule")].alias("status"),
            F.array(*[F.lit(r.reason) for r in RULES])[_c("rule")].alias("reason"),
        )
    )


def row_repairs(findings: DataFrame) -> DataFrame:
    """Rows to create or raise: every ``missing_row`` finding gets its event. Columns:
    ``destination``, ``room_id``, ``stream_ordering``, ``action`` (``upsert``)."""
    return findings.filter(_c("status") == "missing_row").select(
        "destination", "room_id", "stream_ordering", F.lit("upsert").alias("action"))


def position_repairs(findings: DataFrame) -> DataFrame:
    """Per destination, one below its earliest event that is owed although its position
    is past it (``lost``, and ``missing_row`` likewise owed): applied only ever
    lowering. Columns: ``destination``, ``position``."""
    return (
        findings.filter(_c("status").isin("lost", "missing_row") & _c("owed") & _past())
        .groupBy("destination")
        .agg((F.min("stream_ordering") - 1).alias("position"))
    )


# --- health ------------------------------------------------------------------------------

def down_destinations(destinations: DataFrame, now_ms: int) -> DataFrame:
    """Destinations with a backoff recorded (``retry_interval > 0``: Synapse resets it
    to 0 on a success). Columns: ``destination``, ``down_since_ts`` (``failure_ts``),
    ``retry_last_ts``, ``retry_interval_ms``, ``next_retry_ts``, ``backing_off``
    (the next retry is still ahead), ``last_successful_stream_ordering``."""
    return destinations.filter(F.coalesce(_c("retry_interval"), F.lit(0)) > 0).select(
        "destination",
        _c("failure_ts").alias("down_since_ts"),
        "retry_last_ts",
        _c("retry_interval").alias("retry_interval_ms"),
        (F.coalesce(_c("retry_last_ts"), F.lit(0)) + _c("retry_interval")).alias("next_retry_ts"),
        ((F.coalesce(_c("retry_last_ts"), F.lit(0)) + _c("retry_interval")) > F.lit(now_ms))
        .alias("backing_off"),
        "last_successful_stream_ordering",
    )


def catchup_debt(
    destination_rooms: DataFrame, destinations: DataFrame, sendable: DataFrame
) -> DataFrame:
    """Per destination, what catch-up still owes: ``rooms_behind`` (rows past its
    position), ``events_behind`` (sendable events of those rooms past the position, up
    to the row), ``oldest_behind_so``. Counting is an as-of lookup (a running count per
    room over events and the rows' two ends), not a range join."""
    pos = destinations.select("destination", "last_successful_stream_ordering")
    behind = (
        destination_rooms.join(pos, "destination", "left")
        .withColumn("lo", F.coalesce(_c("last_successful_stream_ordering"), F.lit(-1)))
        .filter(_c("stream_ordering") > _c("lo"))
        .select("destination", "room_id", "lo", _c("stream_ordering").alias("hi"))
    )
    rooms = behind.select("room_id").distinct()
    evs = sendable.join(rooms, "room_id", "left_semi").select(
        "room_id", _c("stream_ordering").alias("so"), F.lit(0).alias("kind"),
        F.lit(1).alias("one"), F.lit(None).cast("string").alias("destination"),
        F.lit(None).cast("string").alias("end"))
    points = behind.select("room_id", _c("lo").alias("so"), F.lit(1).alias("kind"),
                           F.lit(0).alias("one"), "destination", F.lit("lo").alias("end"))
    points = points.unionByName(behind.select(
        "room_id", _c("hi").alias("so"), F.lit(1).alias("kind"), F.lit(0).alias("one"),
        "destination", F.lit("hi").alias("end")))
    upto = (Window.partitionBy("room_id").orderBy("so", "kind")
            .rowsBetween(Window.unboundedPreceding, Window.currentRow))
    counted = (
        evs.unionByName(points)
        .withColumn("n", F.sum("one").over(upto))
        .filter(_c("kind") == 1)
        .groupBy("destination", "room_id")
        .agg((F.max(F.when(_c("end") == "hi", _c("n")))
              - F.max(F.when(_c("end") == "lo", _c("n")))).alias("events"))
    )
    return (
        behind.join(counted, ["destination", "room_id"], "left")
        .groupBy("destination")
        .agg(F.count(F.lit(1)).alias("rooms_behind"),
             F.sum(F.coalesce(_c("events"), F.lit(0))).cast("long").alias("events_behind"),
             F.min("lo").alias("position"), F.min("hi").alias("oldest_behind_so"))
    )


def rooms_most_unreachable(
    members: DataFrame, destinations: DataFrame, server_name: str, top_n: int | None = None
) -> DataFrame:
    """The rooms with joined servers that are down (a backoff recorded), most first
    (the first ``top_n``; all when None). Columns: ``room_id``, ``joined_servers``,
    ``unreachable_servers``, ``examples`` (up to five of them, sorted)."""
    down = destinations.filter(F.coalesce(_c("retry_interval"), F.lit(0)) > 0).select(
        "destination", F.lit(True).alias("down"))
    servers = current_servers(members, server_name).join(down, "destination", "left")
    rooms = (
        servers.groupBy("room_id")
        .agg(F.count(F.lit(1)).alias("joined_servers"),
             F.count(F.when(_c("down"), F.lit(1))).alias("unreachable_servers"),
             F.slice(F.sort_array(F.collect_list(F.when(_c("down"), _c("destination")))),
                     1, 5).alias("examples"))
        .filter(_c("unreachable_servers") > 0)
        .orderBy(F.desc("unreachable_servers"), "room_id")
    )
    return rooms if top_n is None else rooms.limit(top_n)
