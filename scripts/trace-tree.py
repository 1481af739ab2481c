#!/usr/bin/env python3
"""Print the spans of OpenTelemetry's console exporter as trees, one per trace.

Usage: federation-sender worker -c config.yaml  (telemetry.tracing_exporter: console)
       | scripts/trace-tree.py
The console exporter writes each span as an indented JSON object on stdout; this reads
them all (other lines are skipped) and prints each root with its children, durations
and the attributes an operator looks at first.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from datetime import datetime
from typing import Any

SHOWN = ("matrix.destination", "matrix.pdu_count", "matrix.edu_count", "federation.catchup",
         "federation.outcome", "http.response.status_code", "server.address", "server.port",
         "federation.catchup.rooms", "federation.catchup.events", "replication.stream",
         "replication.token", "replication.rows")


def read_spans(text: str) -> list[dict[str, Any]]:
    decoder = json.JSONDecoder()
    spans, i = [], 0
    while (start := text.find('{\n    "name"', i)) >= 0:
        span, i = decoder.raw_decode(text, start)
        spans.append(span)
    return spans


def _ms(span: dict[str, Any]) -> float:
    def at(s: str) -> datetime:
        return datetime.fromisoformat(s.replace("Z", "+00:00"))

    return (at(span["end_time"]) - at(span["start_time"])).total_seconds() * 1000


def render(spans: list[dict[str, Any]]) -> list[str]:
    children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        children[s["parent_id"]].append(s)
    lines: list[str] = []

    def walk(span: dict[str, Any], depth: int) -> None:
        attrs = span.get("attributes", {})
        shown = " ".join(f"{k}={attrs[k]}" for k in SHOWN if k in attrs)
        status = span.get("status", {}).get("status_code", "UNSET")
        lines.append(f"{'  ' * depth}{span['name']}  {_ms(span):.1f} ms  {status}  {shown}")
        for child in sorted(children[span["context"]["span_id"]], key=lambda c: c["start_time"]):
            walk(child, depth + 1)

    for root in sorted(children[None], key=lambda s: s["start_time"]):
        walk(root, 0)
    return lines


if __name__ == "__main__":
    print("\n".join(render(read_spans(sys.stdin.read()))))
