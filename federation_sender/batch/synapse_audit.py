"""``audit`` and ``backfill-destination-rooms`` on a Synapse deployment
(``--synapse-config``): Synapse's tables and our transaction log, classified by
:func:`~federation_sender.batch.synapse_transforms.audit_findings`.

Every (destination, room) with an event the destination should have is one finding:
``delivered``, ``pending`` (``backoff``, ``catch_up``, ``sender_behind``), ``lost`` or
``missing_row`` (``no_row``, ``row_behind``); the rules are the table
:data:`~federation_sender.batch.synapse_transforms.RULES`. The summary counts each
class and reason, and the next steps say what to do about them. Exit status 1 (the
command line's 4) when anything is lost or a row is missing; pending is reported, not a
failure.

``audit --repair`` creates or raises the missing rows and lowers the position of each
destination with an owed event it is past; ``backfill-destination-rooms`` only
creates or raises rows (``--dry-run``: neither). Both apply in one transaction with
Synapse's sender's upsert rules (:mod:`federation_sender.storage.synapse.batch_apply`),
safe while Synapse and the worker run: a row the worker wrote for a newer event is
kept, a position only goes down. The worker acts on a lowered position at its next
wake-up sweep: a live queue reads it again and catches up from it, and one is started
in catch-up mode for a destination with none.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from federation_sender.batch import bilateral
from federation_sender.batch import synapse_transforms as st
from federation_sender.batch.io import apply_changes, write_outputs
from federation_sender.batch.job import JobContext, JobResult, require_db, sample
from federation_sender.clock import time_ms
from federation_sender.storage.synapse.batch_reads import READS

RESET = "POST /_synapse/admin/v1/federation/destinations/{d}/reset_connection"
_EXAMPLES = 3


def findings(ctx: JobContext) -> DataFrame:
    """Every finding, cached (the caller unpersists)."""
    with ctx.progress.step("read Synapse's tables and our transaction log"):
        tables = {name: ctx.source.table(name) for name in READS}
    return st.audit_findings(tables, ctx.server_name, time_ms(ctx.clock)).cache()


@dataclass(frozen=True)
class Count:
    """The findings of one class and reason."""

    pairs: int
    destinations: int
    examples: tuple[str, ...]
    partial_state: int = 0
    """Of the pairs, those in partial-state rooms (our view of who is in them may be
    incomplete)."""


Counts = dict[tuple[str, str], Count]


def _counts(f: DataFrame) -> Counts:
    """(status, reason) -> their count, with a few destinations."""
    rows = f.groupBy("status", "reason").agg(
        F.count(F.lit(1)).alias("n"),
        F.countDistinct("destination").alias("d"),
        F.slice(F.sort_array(F.collect_set("destination")), 1, _EXAMPLES).alias("ex"),
        F.count(F.when(F.col("partial_state"), F.lit(1))).alias("p"),
    ).collect()
    return {(str(r["status"]), str(r["reason"])): Count(
        int(r["n"]), int(r["d"]), tuple(str(x) for x in r["ex"]), int(r["p"])) for r in rows}


def _of(counts: Counts, status: str, reason: str | None = None) -> Count:
    hits = [v for (s, r), v in counts.items() if s == status and reason in (None, r)]
    return Count(sum(h.pairs for h in hits), sum(h.destinations for h in hits),
                 tuple(sorted({d for h in hits for d in h.examples})[:_EXAMPLES]),
                 sum(h.partial_state for h in hits))


def _summary(hwm: int, counts: Counts) -> dict[str, object]:
    out: dict[str, object] = {"schema": "synapse", "high_water_mark": hwm,
                              "pairs": sum(v.pairs for v in counts.values())}
    for status in st.STATUSES:
        out[status] = _of(counts, status).pairs
        reasons = [r.reason for r in st.RULES if r.status == status]
        if len(reasons) > 1:
            out.update({f"{status}_{r}": _of(counts, status, r).pairs for r in reasons})
        if status != "delivered":
            out[f"{status}_destinations"] = _of(counts, status).destinations
    return out


def next_steps(hwm: int, counts: Counts, *, repaired: bool) -> list[str]:
    """One sentence per thing to do, from the counts."""
    steps: list[str] = []
    lost, missing = _of(counts, "lost"), _of(counts, "missing_row")
    if (lost.pairs or missing.pairs) and not repaired:
        some = ", ".join(sorted({*lost.examples, *missing.examples})[:_EXAMPLES])
        steps.append(
            f"{lost.pairs} lost and {missing.pairs} missing rows ({some}…): run "
            "`federation-sender batch audit --repair --synapse-config homeserver.yaml` "
            "(rows created, positions lowered; the worker resends from its next wake-up "
            "sweep, queue.wakeup_interval_s), then audit again")
    elif lost.pairs or missing.pairs:
        steps.append("repaired: the worker resends from its next wake-up sweep "
                     "(queue.wakeup_interval_s); audit again to see it")
    backoff = _of(counts, "pending", "backoff")
    if backoff.pairs:
        steps.append(
            f"{backoff.destinations} destinations backing off hold {backoff.pairs} rooms; "
            "to retry one now: " + RESET.format(d=backoff.examples[0]))
    catch_up = _of(counts, "pending", "catch_up")
    if catch_up.pairs:
        steps.append(
            f"{catch_up.pairs} rooms of {catch_up.destinations} destinations wait for "
            "catch-up with no backoff: the worker's wake-up sweep sends them "
            f"(queue.wakeup_interval_s); if they stay, see the worker's log for "
            f"{catch_up.examples[0]}")
    behind = _of(counts, "pending", "sender_behind")
    if behind.pairs:
        steps.append(
            f"{behind.pairs} rooms wait for the sender, whose events position "
            "(federation_stream_position) is below their event (the newest is "
            f"{hwm}): is the federation sender running?")
    return steps


def run_audit(ctx: JobContext, *, repair: bool,
              receivers: bilateral.ReceiverCheck | None = None) -> JobResult:
    hwm = ctx.source.high_water_mark
    f = findings(ctx)
    with ctx.progress.step("classify (destination, room) pairs"):
        counts = _counts(f)
    summary = _summary(hwm, counts)
    summary["partial_state"] = sum(
        v.partial_state for (status, _), v in counts.items() if status != "delivered")
    open_ = f.filter(F.col("status") != "delivered")
    order = ["status", "reason", "destination", "room_id"]
    samples = {"findings": sample(open_.select(
        "status", "reason", "destination", "room_id", "event_id", "stream_ordering",
        "row_so", "last_successful_stream_ordering"), order)}
    if ctx.output_dir is not None:
        with ctx.progress.step(f"write findings to {ctx.output_dir}"):
            write_outputs(open_.orderBy(*order), ctx.output_dir, "findings")
    if repair:
        summary.update(_apply(ctx, f, hwm, "audit", positions=True))
    not_held = 0
    if receivers is not None:
        # The receivers' side of the pairs our records call delivered (--ask-receivers).
        delivered = f.filter(F.col("status") == "delivered").select(
            "destination", "room_id", "event_id", "stream_ordering")
        checked = bilateral.check_receivers(ctx, delivered, receivers, repair=repair,
                                            high_water_mark=hwm)
        summary.update(checked.summary)
        samples.update(checked.samples)
        not_held = checked.not_held
    steps = next_steps(hwm, counts, repaired=repair)
    f.unpersist()
    bad = _of(counts, "lost").pairs + _of(counts, "missing_row").pairs + not_held
    return JobResult("audit", summary, samples, exit_status=1 if bad else 0, next_steps=steps)


def run_backfill(ctx: JobContext, *, dry_run: bool) -> JobResult:
    hwm = ctx.source.high_water_mark
    f = findings(ctx)
    with ctx.progress.step("find missing destination_rooms rows"):
        counts = _counts(f)
        missing = f.filter(F.col("status") == "missing_row")
        samples = {"missing_rows": sample(missing.select(
            "reason", "destination", "room_id", "event_id", "stream_ordering", "row_so"),
            ["destination", "room_id"])}
    summary = {k: v for k, v in _summary(hwm, counts).items()
               if k in ("schema", "high_water_mark", "pairs") or k.startswith("missing_row")}
    summary["dry_run"] = dry_run
    if ctx.output_dir is not None:
        with ctx.progress.step(f"write missing rows to {ctx.output_dir}"):
            write_outputs(missing.orderBy("destination", "room_id"), ctx.output_dir,
                          "missing_rows")
    if not dry_run:
        summary.update(_apply(ctx, f, hwm, "backfill", positions=False))
    f.unpersist()
    return JobResult("backfill-destination-rooms", summary, samples)


def _apply(ctx: JobContext, f: DataFrame, hwm: int, job: str, *,
           positions: bool) -> dict[str, object]:
    db = require_db(ctx, f"{job} on Synapse's schema")
    with ctx.progress.step("stage and apply"):
        rows = st.row_repairs(f)
        lower = st.position_repairs(f) if positions else None
        upserted = lowered = 0
        if not rows.isEmpty() or (lower is not None and not lower.isEmpty()):
            applied = apply_changes(db, rows, lower, hwm, job, schema="synapse")
            upserted, lowered = applied.upserted, applied.positions_lowered
    res: dict[str, object] = {"upserted": upserted}
    if positions:
        res["positions_lowered"] = lowered
    return res
