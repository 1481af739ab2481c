"""``health-report`` on a Synapse deployment: the report of our transaction log (the
same table and charts as on our own schema, :mod:`.health`) with Synapse's view of
the destinations beside it.

Written under ``--output`` besides ``health.*`` and ``timeline.*``:

* ``down.{parquet,csv}``: every destination with a backoff recorded
  (``retry_interval > 0``), since when (``failure_ts``), when it is retried next and
  whether that is still ahead;
* ``catchup_debt.{parquet,csv}``: per destination with ``destination_rooms`` rows past
  its ``last_successful_stream_ordering``, the rooms and sendable events behind;
* ``rooms_unreachable.{parquet,csv}``: every room with a joined server that is down
  (current state), those with the most first.

``health.html`` gets a section with the top of each (definitions:
:mod:`.synapse_transforms`).
"""

from __future__ import annotations

import html
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd

from federation_sender.batch import synapse_transforms as st
from federation_sender.batch.health import log_health, result
from federation_sender.batch.io import write_outputs
from federation_sender.batch.job import JobContext, JobResult
from federation_sender.batch.report import render_html

TOP_N = 25


def run(ctx: JobContext, out: Path, now_ms: int) -> JobResult:
    with ctx.progress.step("read transaction log, destinations, destination_rooms, "
                           "current state"):
        log = ctx.source.table("federation_transaction_log")
        dests = ctx.source.table("destinations").cache()
        rooms = ctx.source.table("destination_rooms")
        members = ctx.source.table("current_members")
        events = ctx.source.table("events")
    with ctx.progress.step("compute per-destination health"):
        hp, timeline, bucket_ms = log_health(log, dests, rooms, out, now_ms)
    with ctx.progress.step("compute Synapse's view: down, catch-up debt, rooms"):
        down: Any = write_outputs(
            st.down_destinations(dests, now_ms).orderBy("down_since_ts", "destination"),
            out, "down")
        debt: Any = write_outputs(
            st.catchup_debt(rooms, dests, st.sendable_events(events, ctx.server_name))
            .orderBy("events_behind", "destination", ascending=[False, True]), out,
            "catchup_debt")
        worst_rooms: Any = write_outputs(
            st.rooms_most_unreachable(members, dests, ctx.server_name), out,
            "rooms_unreachable")
    dests.unpersist()
    with ctx.progress.step("render HTML report"):
        page = render_html(hp, timeline, now_ms, bucket_ms=bucket_ms)
        page = page.replace("</body>", _section(down, debt, worst_rooms) + "</body>", 1)
        (out / "health.html").write_text(page, encoding="utf-8")
    res = result(hp, out)
    backing_off = int(down["backing_off"].sum()) if len(down) else 0
    res.summary.update({
        "schema": "synapse",
        "destinations_down": len(down),
        "destinations_backing_off": backing_off,
        "destinations_behind": len(debt),
        "rooms_behind": int(debt["rooms_behind"].sum()) if len(debt) else 0,
        "events_behind": int(debt["events_behind"].sum()) if len(debt) else 0,
    })
    res.samples.update({
        "down": _records(down.head(10)),
        "catchup_debt": _records(debt.head(10)),
        "rooms_unreachable": _records(worst_rooms.head(10)),
    })
    return res


def _missing(v: Any) -> bool:
    """None, NaN or pandas' NA (the nullable integer columns of :func:`write_outputs`)."""
    return v is None or (not hasattr(v, "__len__") and bool(pd.isna(v)))


def _records(pdf: Any) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = pdf.to_dict("records")
    for row in rows:
        for k, v in row.items():
            if hasattr(v, "tolist"):  # numpy arrays (the examples column), numpy scalars
                row[k] = v.tolist()
            elif _missing(v):
                row[k] = None
    return rows


def _when(ms: Any) -> str:
    if _missing(ms):
        return "-"
    return datetime.fromtimestamp(int(ms) / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _table(title: str, note: str, heads: list[str], rows: list[list[str]]) -> str:
    if not rows:
        return f"<h2>{html.escape(title)}</h2><p>None.</p>"
    head = "".join(f"<th>{html.escape(h)}</th>" for h in heads)
    body = "\n".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return (f"<h2>{html.escape(title)}</h2><p>{html.escape(note)}</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>")


def _section(down: Any, debt: Any, rooms: Any) -> str:
    e = html.escape
    parts = [
        _table("Destinations down (Synapse's retry state)",
               f"{len(down)} with a backoff recorded, longest down first (UTC).",
               ["Destination", "Down since", "Retry interval", "Next retry", "Backing off"],
               [[e(str(r["destination"])), _when(r["down_since_ts"]),
                 f"{int(r['retry_interval_ms']) / 1000:,.0f} s", _when(r["next_retry_ts"]),
                 "yes" if r["backing_off"] else "no"]
                for r in down.head(TOP_N).to_dict("records")]),
        _table("Catch-up debt",
               f"{len(debt)} destinations with destination_rooms rows past their position.",
               ["Destination", "Rooms behind", "Events behind", "Position"],
               [[e(str(r["destination"])), f"{int(r['rooms_behind']):,}",
                 f"{int(r['events_behind']):,}", f"{int(r['position']):,}"]
                for r in debt.head(TOP_N).to_dict("records")]),
        _table("Rooms with the most unreachable servers",
               "Joined servers now (current state) that have a backoff recorded.",
               ["Room", "Joined servers", "Unreachable", "For example"],
               [[e(str(r["room_id"])), f"{int(r['joined_servers']):,}",
                 f"{int(r['unreachable_servers']):,}",
                 e(", ".join(str(x) for x in r["examples"]))]
                for r in rooms.head(TOP_N).to_dict("records")]),
    ]
    return "\n".join(parts) + "\n"
