"""The health report as one self-contained HTML file: a table per destination and
matplotlib charts embedded as base64 PNGs, so an operator can open or mail one file.

Made to be read: the table lists the worst destinations first (lowest success rate,
then most lag, then most failures) with their last error; the latency chart shows the
slowest destinations (highest p99: a slow server is usually a quiet one, which a chart of
the busiest would leave out), each labelled with its transactions and the busiest marked,
and the busiest destinations' latencies are a chart of their own when they are others;
latency is drawn on a log scale (a 30 s timeout beside 20 ms answers); the lag chart is
left out when nothing lags; the timeline's buckets fit the run (seconds for a demo, hours
for a month); every figure is rounded to what it means."""

from __future__ import annotations

import base64
import html
import io
from datetime import UTC, datetime
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt

TOP_N = 25

_COLUMNS = [
    ("destination", "Destination"),
    ("transactions", "Txns"),
    ("success_rate", "Success"),
    ("latency_p50_ms", "p50 ms"),
    ("latency_p95_ms", "p95 ms"),
    ("latency_p99_ms", "p99 ms"),
    ("backoff_ms", "Backing off"),
    ("catchup_ms", "Catching up"),
    ("lag_stream_positions", "Lag"),
    ("outstanding_rooms", "Rooms behind"),
    ("last_error", "Last error"),
]

_ROUNDING = {"success_rate": 4, "latency_p50_ms": 1, "latency_p95_ms": 1,
             "latency_p99_ms": 1}


def worst_first(health: Any) -> Any:
    """Lowest success rate first (destinations without traffic last), then most lag,
    then most failures; ties by name."""
    return health.sort_values(
        ["success_rate", "lag_stream_positions", "failures", "destination"],
        ascending=[True, False, False, True], na_position="last", kind="mergesort")


def busiest(health: Any, n: int = TOP_N) -> Any:
    """The ``n`` destinations with the most transactions; ties by name."""
    return health.sort_values(["transactions", "destination"], ascending=[False, True],
                              kind="mergesort").head(n)


def slowest(health: Any, n: int = TOP_N) -> Any:
    """The ``n`` destinations with the highest p99 latency (then p95, then name), among
    those with any transaction."""
    timed = health[health["latency_p99_ms"].notna()]
    return timed.sort_values(["latency_p99_ms", "latency_p95_ms", "destination"],
                             ascending=[False, False, True], kind="mergesort").head(n)


LATENCY = "Latency"
LATENCY_BUSIEST = "Latency, busiest"


def latency_charts(health: Any) -> list[tuple[str, Any]]:
    """What the latency charts are drawn from, (title, frame) each: the slowest
    destinations by p99, with ``busy`` marking those among the busiest; then the busiest
    destinations' latencies, when they are not the same destinations."""
    slow = slowest(health).copy()
    busy = busiest(health[health["latency_p99_ms"].notna()])
    slow["busy"] = slow["destination"].isin(set(busy["destination"]))
    charts: list[tuple[str, Any]] = [(LATENCY, slow)] if len(slow) else []
    if set(busy["destination"]) != set(slow["destination"]):
        charts.append((LATENCY_BUSIEST, busy))
    return charts


def rounded(health: Any) -> Any:
    """Figures rounded to what they mean (a rate to 0.01 %, latencies to 0.1 ms)."""
    return health.round({k: v for k, v in _ROUNDING.items() if k in health.columns})


def _bucket_label(bucket_ms: int) -> str:
    s = bucket_ms // 1000
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if s % size == 0 and s >= size:
            n = s // size
            return unit if n == 1 else f"{n} {unit}s"
    return "second" if s == 1 else f"{s} seconds"


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _barh(labels: list[str], series: dict[str, list[float]], title: str, xlabel: str,
          *, log: bool = False) -> str:
    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.3 * len(labels) + 1)))
    if log:
        ax.set_xscale("log")
    height = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.barh([y + i * height for y in range(len(labels))], values, height=height, label=name)
    ax.set_yticks([y + 0.4 - height / 2 for y in range(len(labels))], labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    if len(series) > 1:
        ax.legend()
    return _png(fig)


def _timeline(timeline: Any, bucket_ms: int) -> str:
    fig, ax = plt.subplots(figsize=(9, 3))
    if len(timeline):
        pivot = timeline.pivot_table(index="bucket_ts", columns="status",
                                     values="transactions", aggfunc="sum",
                                     fill_value=0).sort_index()
        starts: Any = [datetime.fromtimestamp(ms / 1000, UTC) for ms in pivot.index]
        bottom = [0.0] * len(starts)
        for status in pivot.columns:
            vals = [float(v) for v in pivot[status]]
            # Bars as wide as their bucket (matplotlib dates are in days), left-aligned.
            ax.bar(starts, vals, bottom=bottom, width=0.9 * bucket_ms / 86_400_000,
                   align="edge", label=str(status))
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.legend()
    ax.set_title(f"Transactions per {_bucket_label(bucket_ms)} by outcome (UTC)")
    fig.autofmt_xdate()
    return _png(fig)


def _cell(key: str, v: Any) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    if key == "success_rate":
        return f"{100 * float(v):.1f}%"
    if key in ("backoff_ms", "catchup_ms"):
        return f"{float(v) / 1000:,.0f} s"
    if key == "last_error":
        return f'<span class="err">{html.escape(str(v))}</span>'
    if isinstance(v, float):
        return f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return html.escape(str(v))


def _latency_png(title: str, frame: Any) -> str:
    if title == LATENCY:
        # Each slow destination with its traffic: a quiet server's p99 is few attempts.
        labels = [f"{d}{' *' if b else ''} ({int(n):,} txns)" for d, n, b in
                  zip(frame["destination"], frame["transactions"], frame["busy"], strict=True)]
        heading = (f"Latency of the {len(labels)} slowest destinations by p99 "
                   f"(log scale; * among the {TOP_N} busiest)")
    else:
        labels = [str(d) for d in frame["destination"]]
        heading = f"Latency of the {len(labels)} busiest destinations (log scale)"
    return _barh(
        labels,
        {p: [float(x) if x == x and x is not None else float("nan")
             for x in frame[f"latency_{p}_ms"]]
         for p in ("p50", "p95", "p99")},
        heading, "ms", log=True)


def _charts(health: Any, timeline: Any, bucket_ms: int) -> list[tuple[str, str]]:
    """(title, PNG in base64) of each chart: the busiest destinations' transactions, the
    latencies of the slowest (and of the busiest, when others: :func:`latency_charts`),
    the laggiest's lag (when any is behind), the timeline."""
    top = busiest(health)
    labels = [str(d) for d in top["destination"]]
    charts: list[tuple[str, str]] = []
    if labels:
        charts.append(("Transactions", _barh(
            labels,
            {"succeeded": [float(x) for x in top["successes"]],
             "failed": [float(x) for x in top["failures"]]},
            f"Transactions (busiest {len(labels)})", "transactions")))
        charts += [(title, _latency_png(title, frame))
                   for title, frame in latency_charts(health)]
        laggiest = health[health["lag_stream_positions"] > 0].sort_values(
            "lag_stream_positions", ascending=False).head(TOP_N)
        if len(laggiest):
            charts.append(("Lag", _barh(
                [str(d) for d in laggiest["destination"]],
                {"lag": [float(x) for x in laggiest["lag_stream_positions"]]},
                "Lag behind the events stream", "stream positions")))
    charts.append((f"Timeline, per {_bucket_label(bucket_ms)}", _timeline(timeline, bucket_ms)))
    return charts


def render_html(health: Any, timeline: Any, generated_at_ms: int, *,
                bucket_ms: int = 3_600_000) -> str:
    """``health`` and ``timeline`` are pandas frames of
    :func:`~federation_sender.batch.transforms.destination_health` and
    :func:`~federation_sender.batch.transforms.timeline_outcomes` (``bucket_ms``)."""
    charts = _charts(health, timeline, bucket_ms)
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in _COLUMNS)
    body = "\n".join(
        "<tr>" + "".join(f"<td>{_cell(k, row[k])}</td>" for k, _ in _COLUMNS) + "</tr>"
        for row in rounded(worst_first(health)).to_dict("records")
    )
    lagging = int((health["lag_stream_positions"] > 0).sum()) if len(health) else 0
    lag_note = ("" if lagging else
                "<p>No destination is behind the events stream: no lag chart.</p>")
    total = int(health["transactions"].sum()) if len(health) else 0
    ok = int(health["successes"].sum()) if len(health) else 0
    when = datetime.fromtimestamp(generated_at_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M UTC")
    imgs = "\n".join(
        f'<h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" '
        f'src="data:image/png;base64,{png}">'
        for title, png in charts
    )
    rate = f"{100 * ok / total:.1f}%" if total else "-"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Federation health report</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}
td:first-child,td:last-child{{text-align:left}} img{{max-width:100%}}
.err{{color:#b3261e}}</style></head><body>
<h1>Federation health report</h1>
<p>Generated {when}. {len(health)} destinations, {total:,} transactions, {rate} succeeded.</p>
{lag_note}
{imgs}
<h2>Per destination, worst first</h2>
<table><thead><tr>{head}</tr></thead><tbody>
{body}
</tbody></table></body></html>
"""
