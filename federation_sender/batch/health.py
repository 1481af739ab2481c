"""``batch health-report``: per destination — transactions, success rate, latency
percentiles, time spent backing off and catching up, current lag in stream positions.

Written under ``--output`` as ``health.parquet``, ``health.csv``, ``timeline.parquet`` /
``.csv`` (transactions per bucket and outcome, the bucket fitted to the run's length) and
``health.html`` (charts embedded). Definitions are in
:func:`~federation_sender.batch.transforms.destination_health`; "now" (the end of a
backoff that is still going on) is the job's start time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from federation_sender.batch import transforms as t
from federation_sender.batch.io import write_outputs
from federation_sender.batch.job import JobContext, JobResult
from federation_sender.batch.report import render_html, rounded, slowest, worst_first
from federation_sender.clock import time_ms

JOB = "health-report"


def run(ctx: JobContext, *, horizon_ms: int | None = None) -> JobResult:
    out = ctx.output_dir if ctx.output_dir is not None else Path("health-report")
    now_ms = horizon_ms if horizon_ms is not None else time_ms(ctx.clock)
    if ctx.source.schema == "synapse":
        from federation_sender.batch import synapse_health

        return synapse_health.run(ctx, out, now_ms)
    with ctx.progress.step("read transaction log, destinations, destination_rooms"):
        log = ctx.source.table("federation_transaction_log")
        dests = ctx.source.table("destinations")
        rooms = ctx.source.table("destination_rooms")
    with ctx.progress.step("compute per-destination health"):
        hp, timeline, bucket_ms = log_health(log, dests, rooms, out, now_ms)
    with ctx.progress.step("render HTML report"):
        page = render_html(hp, timeline, now_ms, bucket_ms=bucket_ms)
        (out / "health.html").write_text(page, encoding="utf-8")
    return result(hp, out)


def log_health(log: DataFrame, dests: DataFrame, rooms: DataFrame, out: Path,
               now_ms: int) -> tuple[Any, Any, int]:
    """The per-destination table and the timeline, written under ``out``: (health and
    timeline as pandas frames, the timeline's bucket)."""
    health = t.destination_health(log, dests, rooms, now_ms)
    hp: Any = write_outputs(health, out, "health")
    span = log.agg(F.min("started_ts"), F.max(F.col("started_ts") + F.col("duration_ms")))
    lo, hi = span.first() or (None, None)
    bucket_ms = t.timeline_bucket_ms(int(hi - lo) if lo is not None else 0)
    timeline: Any = write_outputs(t.timeline_outcomes(log, bucket_ms), out, "timeline")
    return hp, timeline, bucket_ms


def result(hp: Any, out: Path) -> JobResult:
    """The job's summary and worst destinations, from the per-destination table."""
    n = len(hp)
    total = int(hp["transactions"].sum()) if n else 0
    ok = int(hp["successes"].sum()) if n else 0
    summary: dict[str, object] = {
        "destinations": n,
        "transactions": total,
        "success_rate": round(ok / total, 4) if total else float("nan"),
        "destinations_lagging": int((hp["lag_stream_positions"] > 0).sum()) if n else 0,
        "report": str(out / "health.html"),
    }
    worst = rounded(worst_first(hp).head(10)) if n else hp
    samples = {"worst": worst.to_dict("records")}
    if n and "latency_p99_ms" in hp.columns:  # who is slow, busy or not (the chart's first)
        slow = rounded(slowest(hp, 10))[["destination", "transactions", "latency_p50_ms",
                                         "latency_p95_ms", "latency_p99_ms"]]
        samples["slowest"] = slow.to_dict("records")
    return JobResult(JOB, summary, samples)
