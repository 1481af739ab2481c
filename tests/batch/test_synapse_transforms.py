"""The Synapse audit's transforms on hand-built frames (no database): one destination per
rule of the decision table, the sending rules, a relayed join, and the health report's
catch-up debt. The same frames a generated workload would give (:data:`READS`'
columns)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from federation_sender.batch import synapse_transforms as st
from federation_sender.batch.io import DataFrameSource, SnapshotSource, write_snapshot
from federation_sender.storage.synapse.batch_reads import READS, TXN_LOG_DDL

pytestmark = [pytest.mark.spark]

US = "us.example"
NOW = 10_000_000
ALICE = f"@a:{US}"
ERASED = f"@e:{US}"

_DDL = {
    "events": "stream_ordering long, event_id string, room_id string, sender string, "
              "depth long, outlier boolean, rejected boolean, internal_metadata string",
    "current_members": "room_id string, user_id string, stream_ordering long",
    "destination_rooms": "destination string, room_id string, stream_ordering long",
    "destinations": "destination string, retry_last_ts long, retry_interval long, "
                    "failure_ts long, last_successful_stream_ordering long",
    "sender_positions": "instance_name string, stream_id long",
    "erased_users": "user_id string",
    "partial_state_rooms": "room_id string",
    "federation_transaction_log": TXN_LOG_DDL,
}


def d(n: int) -> str:
    return f"d{n}.example"


def ev(so: int, room: str, sender: str = ALICE, *, meta: dict[str, Any] | None = None,
       outlier: bool = False, rejected: bool = False) -> tuple[Any, ...]:
    return (so, f"${so}", room, sender, 1, outlier, rejected, json.dumps(meta or {}))


def txn(i: int, dest: str, event_ids: list[str], max_so: int | None, *,
        catchup: bool = False) -> tuple[Any, ...]:
    return (i, dest, "success", 200, i, 10, catchup, len(event_ids), max_so,
            json.dumps(event_ids), None)


def tables(spark: Any) -> dict[str, Any]:
    events = [
        ev(60, "!r1"), ev(2, "!r2"), ev(10, "!r3"), ev(10 + 1000, "!zz"),  # !zz: no member
        ev(11, "!r4"), ev(3, "!r5"), ev(20, "!r6"), ev(21, "!r7"), ev(22, "!r8"),
        # !r9: only 23 is sendable; each later one is excused by one rule.
        ev(23, "!r9"), ev(24, "!r9", meta={"proactively_send": False}),
        ev(25, "!r9", ERASED), ev(26, "!r9", rejected=True), ev(27, "!r9", outlier=True),
        ev(28, "!r9", meta={"out_of_band_membership": True}),
        ev(29, "!r9", f"@x:{d(99)}"),
        # !r10: d11 joins through us last; its relayed join goes to d10 only.
        ev(39, "!r10"), ev(40, "!r10", f"@u:{d(11)}", meta={"send_on_behalf_of": d(11)}),
    ]
    members = [(f"!r{n}", f"@u:{d(n)}", 1) for n in range(1, 9)]
    members += [("!r9", f"@u:{d(8)}", 1), ("!r10", f"@u:{d(10)}", 1),
                ("!r10", f"@u:{d(11)}", 40), ("!r1", ALICE, 1)]
    rows = [(d(3), "!r3", 5), (d(4), "!r4", 11), (d(5), "!r5", 3), (d(6), "!r6", 20),
            (d(7), "!r7", 21), (d(8), "!r8", 22), (d(8), "!r9", 29), (d(10), "!r10", 40)]
    dests = [(d(4), 0, 0, None, 5), (d(5), 0, 0, None, 3), (d(6), NOW - 10, 1000, 1, 10),
             (d(7), NOW - 5000, 1000, 1, 10), (d(8), 0, 0, None, 30), (d(10), 0, 0, None, 40)]
    log = [txn(1, d(9), [], 4),  # the first live transaction: the log vouches from 4
           txn(2, d(4), ["$11"], 11), txn(3, d(8), ["$23"], 23, catchup=True),
           txn(4, d(10), ["$40"], 40)]
    data = {
        "events": events, "current_members": members, "destination_rooms": rows,
        "destinations": dests, "sender_positions": [("fed1", 50)],
        "erased_users": [(ERASED,)], "partial_state_rooms": [("!r6",)],
        "federation_transaction_log": log,
    }
    out = {name: spark.createDataFrame(data[name], _DDL[name]) for name in READS}
    assert {n: tuple(out[n].columns) for n in READS} == {n: r.columns for n, r in READS.items()}
    return out


def test_each_rule_of_the_decision_table(spark: Any) -> None:
    f = st.audit_findings(tables(spark), US, NOW).cache()
    got = {(r["destination"], r["room_id"]): (r["status"], r["reason"], r["stream_ordering"])
           for r in f.collect()}
    assert got == {
        (d(1), "!r1"): ("pending", "sender_behind", 60),
        (d(2), "!r2"): ("missing_row", "no_row", 2),
        (d(3), "!r3"): ("missing_row", "row_behind", 10),
        (d(4), "!r4"): ("delivered", "in_log", 11),
        (d(5), "!r5"): ("delivered", "before_log", 3),
        (d(6), "!r6"): ("pending", "backoff", 20),
        (d(7), "!r7"): ("pending", "catch_up", 21),
        (d(8), "!r8"): ("lost", "not_in_log", 22),
        (d(8), "!r9"): ("delivered", "in_log", 23),   # 24-29 are not sent
        (d(10), "!r10"): ("delivered", "in_log", 40),  # d11's join, relayed to d10
    }  # and nothing for d11: its own join never goes back to it
    assert {r["room_id"] for r in f.filter("partial_state").collect()} == {"!r6"}
    assert {(r["destination"], r["room_id"], r["stream_ordering"])
            for r in st.row_repairs(f).collect()} == {(d(2), "!r2", 2), (d(3), "!r3", 10)}
    assert {(r["destination"], r["position"]) for r in st.position_repairs(f).collect()} == {
        (d(8), 21)}
    f.unpersist()


def test_health_figures(spark: Any) -> None:
    t = tables(spark)
    down = {r["destination"]: r["backing_off"]
            for r in st.down_destinations(t["destinations"], NOW).collect()}
    assert down == {d(6): True, d(7): False}
    debt = {r["destination"]: (r["rooms_behind"], r["events_behind"])
            for r in st.catchup_debt(t["destination_rooms"], t["destinations"],
                                     st.sendable_events(t["events"], US)).collect()}
    # d3 has no position (its row is behind, though at no event: the event is past the
    # row); d4, d6 and d7 are one event behind each; d8 is past both of its rows.
    assert debt == {d(3): (1, 0), d(4): (1, 1), d(6): (1, 1), d(7): (1, 1)}
    rooms = st.rooms_most_unreachable(t["current_members"], t["destinations"], US).collect()
    assert [(r["room_id"], r["unreachable_servers"], list(r["examples"])) for r in rooms] == [
        ("!r6", 1, [d(6)]), ("!r7", 1, [d(7)])]


def test_a_snapshot_of_synapse_frames_keeps_its_schema(spark: Any, tmp_path: Path) -> None:
    t = tables(spark)
    counts = write_snapshot(spark, DataFrameSource(t, 60, schema="synapse"), str(tmp_path))
    assert set(counts) == set(READS)
    snap = SnapshotSource(spark, str(tmp_path))
    assert (snap.schema, snap.high_water_mark) == ("synapse", 60)
    cols = ["destination", "room_id", "status", "reason"]
    again = st.audit_findings({n: snap.table(n) for n in READS}, US, NOW).select(*cols)
    assert sorted(again.collect()) == sorted(
        st.audit_findings(t, US, NOW).select(*cols).collect())


def test_the_docs_draw_the_decision_table() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "batch.md").read_text()
    table = doc.split("<!-- synapse-rules -->")[1].split("<!-- /synapse-rules -->")[0]
    rows = [[c.strip().strip("`") for c in ln.strip("|").split("|")]
            for ln in table.strip().splitlines()[2:]]
    assert [(int(n), s, r) for n, s, r, _ in rows] == [
        (i + 1, rule.status, rule.reason) for i, rule in enumerate(st.RULES)]
