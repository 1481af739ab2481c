"""``batch health-report``: per destination — transactions, success rate, latency
percentiles, time spent backing off and catching up, current lag in stream positions.

Written under ``--output`` as ``health.parquet``, ``health.csv``, ``hourly.parquet`` /
``.csv`` and ``health.html`` (charts embedded). Definitions are in
:func:`~federation_sender.batch.transforms.destination_health`; "now" (the end of a
backoff that is still going on) is the job's start time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from federation_sender.batch import transforms as t
from federation_sender.batch.io import write_outputs
from federation_sender.batch.job import JobContext, JobResult
from federation_sender.batch.report import render_html
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
        hourly: Any = write_outputs(t.hourly_outcomes(log), out, "hourly")
        n = len(hp)
    with ctx.progress.step("render HTML report"):
        page = render_html(hp, hourly, now_ms)
        (out / "health.html").write_text(page, encoding="utf-8")
    total = int(hp["transactions"].sum()) if n else 0
    ok = int(hp["successes"].sum()) if n else 0
    summary: dict[str, object] = {
        "destinations": n,
        "transactions": total,
        "success_rate": ok / total if total else float("nan"),
        "destinations_lagging": int((hp["lag_stream_positions"] > 0).sum()) if n else 0,
        "report": str(out / "health.html"),
    }
    worst = hp.sort_values("lag_stream_positions", ascending=False).head(10) if n else hp
    return JobResult(JOB, summary, {"most_lagging": worst.to_dict("records")})
