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

from pyspark.sql import functions as F

from federation_sender.batch import transforms as t
from federation_sender.batch.io import write_outputs
from federation_sender.batch.job import JobContext, JobResult
from federation_sender.batch.report import render_html, rounded, worst_first
from federation_sender.clock import time_ms

JOB = "health-report"


def run(ctx: JobContext, *, horizon_ms: int | None = None) -> JobResult:
    out = ctx.output_dir if ctx.output_dir is not None else Path("health-report")
    now_ms = horizon_ms if horizon_ms is not None else time_ms(ctx.clock)
    with ctx.progress.step("read transaction log, destinations, destination_rooms"):
        log = ctx.source.table("federation_transaction_log")
        dests = ctx.source.table("destinations")
        rooms = ctx.source.table("destination_rooms")
    with ctx.progress.step("compute per-destination health"):
        health = t.destination_health(log, dests, rooms, now_ms)
        hp: Any = write_outputs(health, out, "health")
        span = log.agg(F.min("started_ts"), F.max(F.col("started_ts") + F.col("duration_ms")))
        lo, hi = span.first() or (None, None)
        bucket_ms = t.timeline_bucket_ms(int(hi - lo) if lo is not None else 0)
        timeline: Any = write_outputs(t.timeline_outcomes(log, bucket_ms), out, "timeline")
        n = len(hp)
    with ctx.progress.step("render HTML report"):
        page = render_html(hp, timeline, now_ms, bucket_ms=bucket_ms)
        (out / "health.html").write_text(page, encoding="utf-8")
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
    return JobResult(JOB, summary, {"worst": worst.to_dict("records")})
