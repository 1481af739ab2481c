"""Pure DataFrame transforms of the batch jobs: DataFrames in, DataFrames out, no I/O.

Input frames carry the columns of the database tables they come from (see
``federation_sender.storage.schema``), restricted to what the jobs read
(:data:`federation_sender.batch.io.TABLE_COLUMNS`).

Who should receive a local event
--------------------------------
A server is *joined* to room R at position S if one of its users' latest membership row
with ``event_stream_ordering <= S`` is ``join``. The destinations of a local event E
(stream ordering ``s``) are the servers joined just before E (position ``s - 1``) and those
joined after it (position ``s``), minus our own server: a kicked or leaving server still
receives its own kick or leave, a joining server receives its join.

Each ``join`` row of a user opens an interval ``[start, end]`` where ``end`` is the stream
ordering of that user's next membership row (open when there is none). The server is a
destination of E exactly when one of its users' intervals has ``start <= s <= end``: the
inclusive end is the "just before" half (the next row may be E itself), ``start <= s`` the
"after" half. So the latest event a destination should have received in a room is, over its
intervals there, the latest local event with ``start <= s <= end``: an *as-of* lookup that
:func:`expected_destination_rooms` does with one sort per room (a running maximum over the
union of events and interval ends) instead of a range join whose cost would grow with
events x intervals.

Skew and size: most intervals are open (the server is still joined), and for those the
as-of lookup is only the room's newest local event, an aggregation per room that needs
no sort. The sort per room runs only for the rooms with a closed interval (someone
left), over their local events and closed ends. So a big room's whole membership and
history never have to sit sorted in one task, which ran the audit of 10,000,000 rows
out of heap (issue #47).
"""

from __future__ import annotations

import functools

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.window import WindowSpec

# Sorts interval ends after events with the same stream ordering, so that an interval
# ending at event E (E is the user's next membership event) includes E.
_KIND_EVENT = 0
_KIND_END = 1

def server_of(user_id: Column) -> Column:
    """The server part of a user id ``@local:server[:port]``: everything after the first
    colon (server names may carry a port)."""
    return F.regexp_extract(user_id, r"^[^:]*:(.*)$", 1)


def local_candidates(events: DataFrame, server_name: str) -> DataFrame:
    """The rows of ``events`` that :func:`local_events` can keep, all columns, by a
    filter a JDBC source hands to the database (``NOT outlier AND NOT rejected AND
    sender LIKE '%:server'``): a sender of this server ends with ``:`` and its name, as
    a user id's localpart has no colon. A superset: :func:`local_events` still checks
    the sender's server exactly."""
    return events.filter(
        ~F.col("outlier") & ~F.col("rejected") & F.col("sender").endswith(f":{server_name}")
    )


def local_events(events: DataFrame, server_name: str) -> DataFrame:
    """The events this server sends: local sender, neither outlier nor rejected.

    Columns: ``stream_ordering``, ``event_id``, ``room_id``.
    """
    return local_candidates(events, server_name).filter(
        server_of(F.col("sender")) == F.lit(server_name)
    ).select("stream_ordering", "event_id", "room_id")


def by_room_and_server(memberships: DataFrame) -> DataFrame:
    """The membership rows hash-partitioned by ``(room_id, server_name)``: every window
    over them (:func:`join_intervals`' and :func:`departures`' per user and per server)
    is keyed by those columns and more, so a frame partitioned (and kept) this way is
    sorted for each of them without another shuffle."""
    return memberships.repartition("room_id", "server_name")


def _per_user() -> WindowSpec:
    # A user's rows all carry the user's server: keyed by the server too, so that the
    # partitioning of by_room_and_server serves this window.
    return Window.partitionBy("room_id", "server_name", "user_id")


def join_intervals(memberships: DataFrame, server_name: str) -> DataFrame:
    """Each remote user's ``join`` rows as intervals ``[start_so, end_so]``.

    ``end_so`` is the stream ordering of the same user's next membership row in the room,
    null while the user is still joined. Columns: ``room_id``, ``destination``,
    ``start_so``, ``end_so``.
    """
    per_user = _per_user().orderBy("event_stream_ordering")
    return (
        memberships.withColumn("end_so", F.lead("event_stream_ordering").over(per_user))
        .filter((F.col("membership") == "join") & (F.col("server_name") != F.lit(server_name)))
        .select(
            "room_id",
            F.col("server_name").alias("destination"),
            F.col("event_stream_ordering").alias("start_so"),
            "end_so",
        )
    )


def expected_destination_rooms(
    events: DataFrame, memberships: DataFrame, server_name: str
) -> DataFrame:
    """For every (destination, room), the latest local event the destination should have
    received: what ``destination_rooms`` must hold. See the module docstring.

    Columns: ``destination``, ``room_id``, ``stream_ordering``.
    """
    local = local_events(events, server_name).select(
        "room_id", F.col("stream_ordering").alias("so"))
    intervals = join_intervals(memberships, server_name)
    # Still joined: the room's newest local event, when it is not older than the join.
    newest = local.groupBy("room_id").agg(F.max("so").alias("latest_so"))
    still_joined = (
        intervals.filter(F.col("end_so").isNull())
        .join(newest, "room_id")
        .filter(F.col("latest_so") >= F.col("start_so"))
        .select("destination", "room_id", "latest_so")
    )
    # Closed intervals: the as-of lookup, sorting only the rooms that have one.
    closed = intervals.filter(F.col("end_so").isNotNull())
    evs = local.join(closed.select("room_id").distinct(), "room_id", "left_semi").select(
        "room_id",
        "so",
        F.lit(_KIND_EVENT).alias("kind"),
        F.lit(None).cast("string").alias("destination"),
        F.lit(None).cast("long").alias("start_so"),
    )
    ends = closed.select(
        "room_id",
        F.col("end_so").alias("so"),
        F.lit(_KIND_END).alias("kind"),
        "destination",
        "start_so",
    )
    upto = (
        Window.partitionBy("room_id")
        .orderBy("so", "kind")
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    latest = F.max(F.when(F.col("kind") == _KIND_EVENT, F.col("so"))).over(upto)
    left_since = (
        evs.unionByName(ends)
        .withColumn("latest_so", latest)
        .filter((F.col("kind") == _KIND_END) & (F.col("latest_so") >= F.col("start_so")))
        .select("destination", "room_id", "latest_so")
    )
    return (
        still_joined.unionByName(left_since)
        .groupBy("destination", "room_id")
        .agg(F.max("latest_so").alias("stream_ordering"))
    )


def diff_destination_rooms(expected: DataFrame, actual: DataFrame) -> DataFrame:
    """Rows where ``destination_rooms`` (``actual``) disagrees with ``expected``.

    ``problem`` is ``missing`` (no row), ``behind`` (older than the latest event the
    destination should have: catch-up may never send it), ``ahead`` (newer than any event
    the destination should receive) or ``stale`` (a row for a room the destination should
    have nothing from: a purged room, a server that never joined). Columns:
    ``destination``, ``room_id``, ``expected_so``, ``actual_so``, ``problem``.
    """
    e = expected.select(
        "destination", "room_id", F.col("stream_ordering").alias("expected_so")
    )
    a = actual.select("destination", "room_id", F.col("stream_ordering").alias("actual_so"))
    problem = (
        F.when(F.col("actual_so").isNull(), F.lit("missing"))
        .when(F.col("expected_so").isNull(), F.lit("stale"))
        .when(F.col("actual_so") < F.col("expected_so"), F.lit("behind"))
        .otherwise(F.lit("ahead"))
    )
    return (
        e.join(a, ["destination", "room_id"], "full_outer")
        .filter(~F.col("expected_so").eqNullSafe(F.col("actual_so")))
        .withColumn("problem", problem)
    )


def destination_room_changes(diff: DataFrame) -> DataFrame:
    """The writes that make ``destination_rooms`` agree: ``upsert`` the expected stream
    ordering, or ``delete`` a stale row. Columns: ``destination``, ``room_id``,
    ``stream_ordering`` (null for deletes), ``action``."""
    return diff.select(
        "destination",
        "room_id",
        F.col("expected_so").alias("stream_ordering"),
        F.when(F.col("problem") == "stale", F.lit("delete"))
        .otherwise(F.lit("upsert"))
        .alias("action"),
    )


def sent_event_ids(txn_log: DataFrame) -> DataFrame:
    """The ids of the PDUs successful transactions carried. Columns: ``destination``,
    ``event_id``."""
    return txn_log.filter(F.col("status") == "success").select(
        "destination",
        F.explode(F.from_json("pdu_event_ids", T.ArrayType(T.StringType()))).alias("event_id"),
    )


def delivered_among(sent: DataFrame, *lookups: DataFrame) -> DataFrame:
    """Per (destination, room), the highest stream ordering of a :func:`sent_event_ids`
    event found in ``lookups`` (frames with ``event_id``, ``room_id`` and
    ``stream_ordering``; an event in more than one counts once, by the maximum).

    Columns: ``destination``, ``room_id``, ``delivered_so``.
    """
    cols = ("event_id", "room_id", "stream_ordering")
    found = [sent.join(lookup.select(*cols), "event_id") for lookup in lookups]
    return (
        functools.reduce(DataFrame.unionByName, found)
        .groupBy("destination", "room_id")
        .agg(F.max("stream_ordering").alias("delivered_so"))
    )


def delivered_positions(txn_log: DataFrame, events: DataFrame) -> DataFrame:
    """Per (destination, room), the highest stream ordering of an event that a successful
    transaction carried to the destination. Catch-up sends forward extremities, which may
    be remote events, so this joins with all events, not only local ones (the native
    jobs look the log's ids up among the local events first:
    :func:`federation_sender.batch.job.delivered_positions`).

    Columns: ``destination``, ``room_id``, ``delivered_so``.
    """
    return delivered_among(sent_event_ids(txn_log), events)


def not_among(sent: DataFrame, lookup: DataFrame) -> DataFrame:
    """The distinct ids of :func:`sent_event_ids` that ``lookup`` does not hold.
    Columns: ``event_id``."""
    return (sent.select("event_id").join(lookup.select("event_id"), "event_id", "left_anti")
            .distinct())


def undelivered(
    expected: DataFrame, delivered: DataFrame, destinations: DataFrame
) -> DataFrame:
    """(destination, room) pairs whose latest event was neither delivered nor superseded
    by a later delivered event of the same room.

    ``status`` is ``lost`` when the destination's ``last_successful_stream_ordering`` is
    already at or past the event (catch-up will never look at it again) and ``pending``
    when catch-up still has it ahead. Columns: ``destination``, ``room_id``,
    ``stream_ordering``, ``delivered_so``, ``last_successful_stream_ordering``,
    ``status``.
    """
    pos = destinations.select("destination", "last_successful_stream_ordering")
    return (
        expected.join(delivered, ["destination", "room_id"], "left")
        .filter(
            F.col("delivered_so").isNull() | (F.col("delivered_so") < F.col("stream_ordering"))
        )
        .join(pos, "destination", "left")
        .withColumn(
            "status",
            F.when(
                F.col("last_successful_stream_ordering") >= F.col("stream_ordering"),
                F.lit("lost"),
            ).otherwise(F.lit("pending")),
        )
        .select(
            "destination",
            "room_id",
            "stream_ordering",
            "delivered_so",
            "last_successful_stream_ordering",
            "status",
        )
    )


def departures(memberships: DataFrame, server_name: str) -> DataFrame:
    """The moments a remote server left a room: the membership row after which none of
    its users is joined any more. Columns: ``room_id``, ``destination``, ``out_so``."""
    per_user = _per_user().orderBy("event_stream_ordering")
    per_server = (Window.partitionBy("room_id", "server_name")
                  .orderBy("event_stream_ordering")
                  .rowsBetween(Window.unboundedPreceding, Window.currentRow))
    joined = (F.col("membership") == "join").cast("int")
    was_joined = F.coalesce(
        (F.lag("membership").over(per_user) == "join").cast("int"), F.lit(0))
    return (
        memberships.filter(F.col("server_name") != F.lit(server_name))
        .withColumn("delta", joined - was_joined)
        .withColumn("count", F.sum("delta").over(per_server))
        .filter((F.col("delta") == -1) & (F.col("count") == 0))
        .select("room_id", F.col("server_name").alias("destination"),
                F.col("event_stream_ordering").alias("out_so"))
    )


def split_pruned(raw_diff: DataFrame, undelivered_rows: DataFrame, memberships: DataFrame,
                 server_name: str) -> tuple[DataFrame, DataFrame]:
    """Split :func:`diff_destination_rooms` output into real differences and rows the
    worker pruned on purpose. Catch-up deletes the row of a room the destination has
    *left* once its events are handled, so a "missing" row is pruned (not a
    disagreement) only when the room's latest event was delivered (not among
    ``undelivered_rows``) and the destination left the room after that event
    (:func:`departures`). Catch-up prunes a row only while the destination is out of
    the room, so a server that left after the row's event and joined again may have
    lost its row on purpose; a missing row of a room it has stayed in is missing
    whatever was delivered: the next catch-up would never see the room. Only the
    missing rows are looked up (a few, against every expected row), and the departures
    are worked out only from their servers' membership rows in their rooms (a server's
    departures from a room depend on nothing else). Returns ``(diff, pruned)``;
    ``pruned`` has ``problem="pruned"``. The audit and the backfill both use this, so
    they agree on such rows."""
    missing = raw_diff.filter(F.col("problem") == "missing")
    theirs = memberships.join(
        missing.select("room_id", F.col("destination").alias("server_name")).distinct(),
        ["room_id", "server_name"], "left_semi")
    left_after = (
        missing.select("destination", "room_id", "expected_so")
        .join(departures(theirs, server_name), ["destination", "room_id"])
        .filter(F.col("out_so") >= F.col("expected_so"))
        .select("destination", "room_id").distinct()
        .join(undelivered_rows.select("destination", "room_id"),
              ["destination", "room_id"], "left_anti")
    )
    pruned = (missing.join(left_after, ["destination", "room_id"], "left_semi")
              .withColumn("problem", F.lit("pruned")))
    diff = raw_diff.filter(F.col("problem") != "missing").unionByName(
        missing.join(left_after, ["destination", "room_id"], "left_anti"))
    return diff, pruned


def position_repairs(undelivered_rows: DataFrame) -> DataFrame:
    """Per destination, the position catch-up must restart from so that it resends every
    undelivered row: one below the earliest. Applied as ``LEAST(current, position)``, so it
    only ever lowers. Columns: ``destination``, ``position``."""
    return undelivered_rows.groupBy("destination").agg(
        (F.min("stream_ordering") - 1).alias("position")
    )


def _all_destinations(*frames: DataFrame) -> DataFrame:
    out = frames[0].select("destination")
    for f in frames[1:]:
        out = out.unionByName(f.select("destination"))
    return out.distinct()


def _attempts_in_order(txn_log: DataFrame) -> DataFrame:
    """The log with ``ok``, successes so far, the next success's start, and the row
    numbers that tell runs of catch-up transactions apart (gaps-and-islands)."""
    ok = (F.col("status") == "success").cast("int")
    log = txn_log.withColumn("ok", ok)
    order = Window.partitionBy("destination").orderBy("started_ts", "id")
    later = order.rowsBetween(1, Window.unboundedFollowing)
    return (
        log.withColumn("successes_so_far", F.sum("ok").over(
            order.rowsBetween(Window.unboundedPreceding, Window.currentRow)))
        .withColumn("next_success_ts", F.min(F.when(F.col("ok") == 1, F.col("started_ts")))
                    .over(later))
        .withColumn("rn_all", F.row_number().over(order))
        .withColumn("rn_flag", F.row_number().over(
            Window.partitionBy("destination", "catchup").orderBy("started_ts", "id")))
    )


def _backoff_per_destination(log: DataFrame, horizon_ms: int) -> DataFrame:
    return (
        log.filter(F.col("ok") == 0)
        .groupBy("destination", "successes_so_far")
        .agg(
            (F.coalesce(F.first("next_success_ts"), F.lit(horizon_ms))
             - F.min("started_ts")).alias("ms")
        )
        .groupBy("destination")
        .agg(F.sum("ms").alias("backoff_ms"))
    )


def _catchup_per_destination(log: DataFrame) -> DataFrame:
    return (
        log.filter(F.col("catchup"))
        .groupBy("destination", (F.col("rn_all") - F.col("rn_flag")).alias("island"))
        .agg(
            (F.max(F.col("started_ts") + F.col("duration_ms")) - F.min("started_ts")).alias("ms"),
            F.count(F.lit(1)).alias("n"),
        )
        .groupBy("destination")
        .agg(F.sum("ms").alias("catchup_ms"), F.sum("n").alias("catchup_transactions"))
    )


def _traffic_per_destination(log: DataFrame) -> DataFrame:
    return log.groupBy("destination").agg(
        F.count(F.lit(1)).alias("transactions"),
        F.sum("ok").alias("successes"),
        F.sum(F.when(F.col("ok") == 1, F.col("pdu_count")).otherwise(0)).alias("pdus_sent"),
        F.expr("percentile(duration_ms, array(0.5, 0.95, 0.99))").alias("pct"),
        F.min("started_ts").alias("first_ts"),
        F.max("started_ts").alias("last_ts"),
    )


def destination_health(
    txn_log: DataFrame,
    destinations: DataFrame,
    destination_rooms: DataFrame,
    horizon_ms: int,
) -> DataFrame:
    """One row per destination: traffic, success rate, latency, time backing off and
    catching up, and lag.

    * latency percentiles are exact (linear interpolation) over every attempt's
      ``duration_ms``;
    * ``backoff_ms``: for each run of consecutive failed attempts, from the first failure
      to the next successful attempt (or ``horizon_ms`` while still failing);
    * ``catchup_ms``: for each run of consecutive catch-up transactions, from the first
      one's start to the end of the last one;
    * ``lag_stream_positions``: the newest ``destination_rooms`` stream ordering minus
      ``last_successful_stream_ordering`` (0 when caught up), ``outstanding_rooms`` the
      rows catch-up still has to send.
    """
    log = _attempts_in_order(txn_log)
    backoff = _backoff_per_destination(log, horizon_ms)
    catchup = _catchup_per_destination(log)
    traffic = _traffic_per_destination(log)
    rooms = destination_rooms.groupBy("destination").agg(
        F.max("stream_ordering").alias("max_stream_ordering")
    )
    failures = _last_failure_per_destination(log)
    pos = destinations.select("destination", "last_successful_stream_ordering")
    outstanding = (
        destination_rooms.join(pos, "destination", "left")
        .filter(F.col("stream_ordering")
                > F.coalesce(F.col("last_successful_stream_ordering"), F.lit(-1)))
        .groupBy("destination")
        .agg(F.count(F.lit(1)).alias("outstanding_rooms"))
    )
    return (
        _all_destinations(txn_log, destinations, destination_rooms)
        .join(traffic, "destination", "left")
        .join(backoff, "destination", "left")
        .join(catchup, "destination", "left")
        .join(rooms, "destination", "left")
        .join(pos, "destination", "left")
        .join(outstanding, "destination", "left")
        .join(failures, "destination", "left")
        .select(*_health_columns())
    )


def _last_failure_per_destination(log: DataFrame) -> DataFrame:
    """Each destination's last failed attempt: its error text when logged, else the
    outcome and HTTP status ("transient 502"), and when it started."""
    what = F.concat_ws(" ", F.col("status"), F.col("http_status").cast("string"))
    if "error" in log.columns:
        what = F.coalesce(F.col("error"), what)
    return (
        log.filter(F.col("ok") == 0)
        .groupBy("destination")
        .agg(F.max_by(what, F.struct("started_ts", "id")).alias("last_error"),
             F.max("started_ts").alias("last_error_ts"))
    )


def _health_columns() -> list[Column | str]:
    """:func:`destination_health`'s columns, in order, with their defaults."""
    lag = F.greatest(
        F.col("max_stream_ordering")
        - F.coalesce(F.col("last_successful_stream_ordering"), F.lit(0)),
        F.lit(0),
    )
    return [
        "destination",
        F.coalesce("transactions", F.lit(0)).cast("long").alias("transactions"),
        F.coalesce("successes", F.lit(0)).cast("long").alias("successes"),
        F.coalesce(F.col("transactions") - F.col("successes"), F.lit(0)).cast("long")
        .alias("failures"),
        (F.col("successes") / F.col("transactions")).alias("success_rate"),
        F.coalesce("pdus_sent", F.lit(0)).cast("long").alias("pdus_sent"),
        F.col("pct")[0].alias("latency_p50_ms"),
        F.col("pct")[1].alias("latency_p95_ms"),
        F.col("pct")[2].alias("latency_p99_ms"),
        F.coalesce("backoff_ms", F.lit(0)).cast("long").alias("backoff_ms"),
        F.coalesce("catchup_ms", F.lit(0)).cast("long").alias("catchup_ms"),
        F.coalesce("catchup_transactions", F.lit(0)).cast("long")
        .alias("catchup_transactions"),
        "last_successful_stream_ordering",
        "max_stream_ordering",
        F.coalesce(lag, F.lit(0)).cast("long").alias("lag_stream_positions"),
        F.coalesce("outstanding_rooms", F.lit(0)).cast("long").alias("outstanding_rooms"),
        "first_ts",
        "last_ts",
        "last_error",
        "last_error_ts",
    ]


def hourly_outcomes(txn_log: DataFrame) -> DataFrame:
    """Transactions per hour and status across all destinations. Columns: ``hour_ts``
    (ms, start of the hour), ``status``, ``transactions``."""
    return timeline_outcomes(txn_log, 3_600_000).withColumnRenamed("bucket_ts", "hour_ts")


TIMELINE_BUCKETS_MS = tuple(s * 1000 for s in (
    1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
    86400, 7 * 86400))
TIMELINE_MAX_BUCKETS = 60


def timeline_bucket_ms(span_ms: int) -> int:
    """The smallest round bucket that cuts ``span_ms`` into at most
    :data:`TIMELINE_MAX_BUCKETS` bars: seconds for a demo, hours for a month."""
    for bucket in TIMELINE_BUCKETS_MS:
        if span_ms / bucket <= TIMELINE_MAX_BUCKETS:
            return bucket
    return TIMELINE_BUCKETS_MS[-1]


def timeline_outcomes(txn_log: DataFrame, bucket_ms: int) -> DataFrame:
    """Transactions per bucket and status across all destinations, for the timeline
    chart. Columns: ``bucket_ts`` (ms, start of the bucket), ``status``,
    ``transactions``."""
    return (
        txn_log.groupBy(
            (F.floor(F.col("started_ts") / bucket_ms) * bucket_ms).cast("long")
            .alias("bucket_ts"),
            "status",
        )
        .agg(F.count(F.lit(1)).alias("transactions"))
    )
