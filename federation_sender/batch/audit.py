"""``batch audit``: the anti-entropy check of what was sent against what should have been.

Two kinds of finding:

* *undelivered*: a (destination, room) whose latest event the destination should have
  received was neither delivered (its id in a successful transaction to the destination)
  nor superseded by a later event of the room delivered to it (catch-up sends the
  room's latest extremities instead of every missed event). ``lost`` when the
  destination's ``last_successful_stream_ordering`` is already past it, so catch-up
  would never send it; ``pending`` while catch-up still has it ahead.
* *mismatches*: ``destination_rooms`` rows that disagree with the events (see
  :func:`~federation_sender.batch.transforms.diff_destination_rooms`); a missing row
  is no mismatch only when the destination has left the room and its events were
  delivered (:func:`~federation_sender.batch.transforms.split_pruned`).

On Synapse's schema (``--synapse-config``) the audit is :mod:`.synapse_audit`.

``--repair`` makes ``destination_rooms`` right and lowers each affected destination's
``last_successful_stream_ordering`` below its earliest undelivered row, in one
transaction; the worker's catch-up then does the sending. Exit status 1 when anything
was lost or mismatched (also after a repair: audit again to see it clean), else 0;
``pending`` rows are counted but are not a failure (a destination that is down has them).

With a :class:`~federation_sender.batch.bilateral.ReceiverCheck` (``--ask-receivers``)
the delivered pairs are then checked on the receivers' side too
(:mod:`federation_sender.batch.bilateral`); a pair the receiver does not hold is a
finding like a lost row, and ``--repair`` hands it back to catch-up.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from federation_sender.batch import bilateral, synapse_audit
from federation_sender.batch import transforms as t
from federation_sender.batch.io import apply_changes, write_outputs
from federation_sender.batch.job import (
    JobContext,
    JobResult,
    counts_by,
    delivered_positions,
    require_db,
    sample,
)

JOB = "audit"


def run(ctx: JobContext, *, repair: bool,
        receivers: bilateral.ReceiverCheck | None = None) -> JobResult:
    if ctx.source.schema == "synapse":
        return synapse_audit.run_audit(ctx, repair=repair, receivers=receivers)
    hwm = ctx.source.high_water_mark
    with ctx.progress.step("read events, memberships, destinations, transaction log"):
        # The events are read narrowed by the database: the local ones (a seventh of
        # them at 10M), kept for their three uses, and the few others the log names.
        # The memberships are used twice (the join intervals and the departures): read
        # once over JDBC, kept in memory or on local disk for the second use,
        # partitioned once for all their windows.
        events = ctx.source.table("events")
        local = t.local_candidates(events, ctx.server_name).persist()
        memberships = t.by_room_and_server(ctx.source.table("room_memberships")).persist()
        actual = ctx.source.table("destination_rooms").filter(
            F.col("stream_ordering") <= F.lit(hwm)
        )
        destinations = ctx.source.table("destinations")
        txn_log = ctx.source.table("federation_transaction_log")
        partial = ctx.source.table("partial_state_rooms").withColumn(
            "partial_state", F.lit(True)
        )
    with ctx.progress.step("compute expected destination_rooms"):
        expected = t.expected_destination_rooms(local, memberships, ctx.server_name).cache()
        n_expected = expected.count()
    with ctx.progress.step("find undelivered events"):
        delivered = delivered_positions(txn_log, events, local, ctx.server_name)
        missing = (
            t.undelivered(expected, delivered, destinations)
            .join(partial, "room_id", "left")
            .withColumn("partial_state", F.coalesce(F.col("partial_state"), F.lit(False)))
            .cache()
        )
        by_status = counts_by(missing, "status")
    with ctx.progress.step("compare destination_rooms"):
        # The rows that differ are few: kept, so that counting the pruned ones does not
        # join destination_rooms with the expected rows a second time.
        raw = t.diff_destination_rooms(expected, actual).cache()
        # A row the worker pruned (a room the destination left after the row's event,
        # its events delivered) is missing on purpose.
        diff, pruned = t.split_pruned(raw, missing,
                                      memberships, ctx.server_name)
        diff = diff.cache()
        by_problem = counts_by(diff, "problem")
        n_pruned = pruned.count()
    lost = by_status.get("lost", 0)
    mismatched = sum(by_problem.values())
    summary: dict[str, object] = {
        "high_water_mark": hwm,
        "expected_rows": n_expected,
        "undelivered_lost": lost,
        "undelivered_pending": by_status.get("pending", 0),
        "undelivered_destinations": missing.select("destination").distinct().count(),
        **{f"rows_{p}": by_problem.get(p, 0) for p in ("missing", "behind", "ahead", "stale")},
        "rows_pruned_after_delivery": n_pruned,
        "repair": repair,
    }
    samples = {
        "undelivered": sample(missing, ["status", "destination", "room_id"]),
        "mismatches": sample(diff, ["destination", "room_id"]),
    }
    if ctx.output_dir is not None:
        with ctx.progress.step(f"write findings to {ctx.output_dir}"):
            write_outputs(missing, ctx.output_dir, "undelivered")
            write_outputs(diff, ctx.output_dir, "mismatches")
    if repair:
        summary.update(_repair(ctx, diff, missing, hwm, needed=bool(mismatched or by_status)))
    not_held = 0
    if receivers is not None:
        # Delivered: the expected rows the audit did not find undelivered.
        checked = bilateral.check_receivers(
            ctx, bilateral.delivered_pairs(expected, missing, local, ctx.server_name),
            receivers, repair=repair, high_water_mark=hwm)
        summary.update(checked.summary)
        samples.update(checked.samples)
        not_held = checked.not_held
    for df in (missing, diff, raw, expected, local, memberships):
        df.unpersist()
    return JobResult(JOB, summary, samples,
                     exit_status=1 if lost or mismatched or not_held else 0)


def _repair(
    ctx: JobContext, diff: DataFrame, missing: DataFrame, hwm: int, *, needed: bool
) -> dict[str, object]:
    """``--repair``: ``destination_rooms`` made right and the positions lowered, in one
    transaction; the counts of what changed."""
    db = require_db(ctx, "audit --repair")
    with ctx.progress.step("stage and apply repair"):
        if not needed:
            return {"upserted": 0, "deleted": 0, "positions_lowered": 0}
        res = apply_changes(
            db, t.destination_room_changes(diff), t.position_repairs(missing), hwm, "audit",
        )
        return {"upserted": res.upserted, "deleted": res.deleted,
                "positions_lowered": res.positions_lowered}
