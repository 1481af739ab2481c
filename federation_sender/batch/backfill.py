"""``batch backfill-destination-rooms``: recompute ``destination_rooms`` from the events
and the membership history, to adopt the worker on an existing database or to repair it.

Every (destination, room) gets the latest local event the destination should have
received (:func:`~federation_sender.batch.transforms.expected_destination_rooms`); rows
that disagree are upserted, rows that should not exist are deleted, all in one
transaction (:func:`~federation_sender.batch.io.apply_changes`). ``--dry-run`` reports
the differences and writes nothing. ``destinations`` positions are not touched: use
``audit --repair`` to make catch-up resend what was not delivered.
"""

from __future__ import annotations

from pyspark.sql import functions as F

from federation_sender.batch import synapse_audit
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

JOB = "backfill-destination-rooms"
PROBLEMS = ("missing", "behind", "ahead", "stale")


def run(ctx: JobContext, *, dry_run: bool) -> JobResult:
    if ctx.source.schema == "synapse":
        return synapse_audit.run_backfill(ctx, dry_run=dry_run)
    hwm = ctx.source.high_water_mark
    with ctx.progress.step("read events, memberships, destination_rooms"):
        # As the audit reads them (audit.py): the local events, kept, and the few
        # others the log names.
        events = ctx.source.table("events")
        local = t.local_candidates(events, ctx.server_name).persist()
        memberships = t.by_room_and_server(ctx.source.table("room_memberships")).persist()
        actual = ctx.source.table("destination_rooms").filter(
            F.col("stream_ordering") <= F.lit(hwm)
        )
        destinations = ctx.source.table("destinations")
        txn_log = ctx.source.table("federation_transaction_log")
    with ctx.progress.step("compute expected destination_rooms"):
        expected = t.expected_destination_rooms(local, memberships, ctx.server_name).cache()
        n_expected = expected.count()
    with ctx.progress.step("compare with destination_rooms"):
        # As the audit does: a row the worker pruned (a room the destination left after
        # the row's event, its events delivered) is not put back (catch-up would only
        # prune it again); a missing row of a room the destination stayed in is.
        undelivered = t.undelivered(
            expected, delivered_positions(txn_log, events, local, ctx.server_name),
            destinations)
        raw = t.diff_destination_rooms(expected, actual).cache()
        diff, pruned = t.split_pruned(raw, undelivered,
                                      memberships, ctx.server_name)
        diff = diff.cache()
        by_problem = counts_by(diff, "problem")
        n_pruned = pruned.count()
        samples = {"differences": sample(diff, ["destination", "room_id"])}
    summary: dict[str, object] = {
        "high_water_mark": hwm,
        "expected_rows": n_expected,
        **{p: by_problem.get(p, 0) for p in PROBLEMS},
        "pruned_after_delivery": n_pruned,
        "dry_run": dry_run,
    }
    if ctx.output_dir is not None:
        with ctx.progress.step(f"write differences to {ctx.output_dir}"):
            write_outputs(diff, ctx.output_dir, "differences")
    if not dry_run:
        db = require_db(ctx, JOB)
        with ctx.progress.step("stage and apply"):
            if sum(by_problem.values()):
                res = apply_changes(db, t.destination_room_changes(diff), None, hwm, "backfill")
                summary.update(upserted=res.upserted, deleted=res.deleted)
            else:
                summary.update(upserted=0, deleted=0)
    for df in (diff, raw, expected, local, memberships):
        df.unpersist()
    return JobResult(JOB, summary, samples)
