"""The pure transforms against results computed in plain Python from the definitions."""

from __future__ import annotations

from typing import Any

import pytest
from pyspark.sql import functions as F

from federation_sender.batch import transforms as t

from .histories import (
    OUR,
    expected_destination_rooms,
    expected_diff,
    expected_health,
    expected_undelivered,
    frames,
    random_history,
    scenario,
)

pytestmark = pytest.mark.spark


def _dr(df: Any) -> dict[tuple[str, str], int]:
    return {(r.destination, r.room_id): r.stream_ordering for r in df.collect()}


def test_server_of(spark: Any) -> None:
    df = spark.createDataFrame([("@a:b.example",), ("@a:c.example:8448",), ("nocolon",)],
                               "u string")
    got = [r[0] for r in df.select(t.server_of(F.col("u"))).collect()]
    assert got == ["b.example", "c.example:8448", ""]


def test_scenario_destination_rooms(spark: Any) -> None:
    h = scenario()
    src = frames(spark, h)
    got = _dr(t.expected_destination_rooms(src.table("events"), src.table("room_memberships"),
                                           OUR))
    # Spelled out, so that a wrong oracle can not hide a wrong transform.
    assert got == {
        ("b.example", "!r1"): 11,        # rejoined: gets the event after its rejoin
        ("c.example:8448", "!r1"): 6,    # kicked: its kick is the last it gets
        ("b.example", "!r2"): 20,        # bert's ban: the last b gets after bob left
        ("c.example:8448", "!p"): 26,    # partial-state room, from known memberships
    }
    assert got == expected_destination_rooms(h)


@pytest.mark.parametrize("seed", range(6))
def test_random_histories_destination_rooms(spark: Any, seed: int) -> None:
    h = random_history(seed)
    src = frames(spark, h)
    got = _dr(t.expected_destination_rooms(src.table("events"), src.table("room_memberships"),
                                           OUR))
    assert got == expected_destination_rooms(h)


def _with_table(h: Any) -> Any:
    exp = expected_destination_rooms(h)
    h.destination_rooms = dict(exp)
    h.destination_rooms[("b.example", "!r1")] = 7          # behind
    h.destination_rooms[("c.example:8448", "!r1")] = 9     # ahead (after the kick)
    del h.destination_rooms[("b.example", "!r2")]          # missing
    h.destination_rooms[("b.example", "!gone")] = 5        # stale: purged room
    return h


def test_diff(spark: Any) -> None:
    h = _with_table(scenario())
    src = frames(spark, h)
    exp = t.expected_destination_rooms(src.table("events"), src.table("room_memberships"), OUR)
    diff = t.diff_destination_rooms(exp, src.table("destination_rooms"))
    got = {(r.destination, r.room_id): r.problem for r in diff.collect()}
    assert got == expected_diff(h) == {
        ("b.example", "!r1"): "behind", ("c.example:8448", "!r1"): "ahead",
        ("b.example", "!r2"): "missing", ("b.example", "!gone"): "stale",
    }
    changes = {(r.destination, r.room_id): (r.action, r.stream_ordering)
               for r in t.destination_room_changes(diff).collect()}
    assert changes[("b.example", "!gone")] == ("delete", None)
    assert changes[("c.example:8448", "!r1")] == ("upsert", 6)


def test_undelivered_and_superseded(spark: Any) -> None:
    h = scenario()
    h.send("b.example", ["$e5", "$e7"])          # not $e11 in !r1
    h.send("b.example", ["$e20"], status="transient")  # failed: not delivered
    h.send("c.example:8448", ["$e6"])            # the kick itself
    h.send("c.example:8448", ["$e9999"])         # unknown event id: ignored
    # !p for c: superseded by a later (remote) event of the room.
    h.msg("!p", "@carol:c.example:8448")
    h.send("c.example:8448", [f"$e{h.next_so - 1}"], catchup=True)
    h.destinations = {"b.example": 12, "c.example:8448": 3}
    src = frames(spark, h)
    exp = t.expected_destination_rooms(src.table("events"), src.table("room_memberships"), OUR)
    delivered = t.delivered_positions(src.table("federation_transaction_log"),
                                      src.table("events"))
    und = t.undelivered(exp, delivered, src.table("destinations"))
    got = {(r.destination, r.room_id): r.status for r in und.collect()}
    assert got == expected_undelivered(h) == {
        ("b.example", "!r1"): "lost",       # 11 <= position 12, never sent
        ("b.example", "!r2"): "pending",    # 20 > 12: catch-up will send it
    }
    pos = {r.destination: r.position for r in t.position_repairs(und).collect()}
    assert pos == {"b.example": 10}


@pytest.mark.parametrize("seed", range(3))
def test_random_undelivered(spark: Any, seed: int) -> None:
    import random

    h = random_history(100 + seed)
    rng = random.Random(seed)
    sent = [e["event_id"] for e in h.events if rng.random() < 0.3]
    for d in ("b.example", "c.example", "d.example:8448"):
        h.send(d, rng.sample(sent, min(len(sent), 15)))
        h.destinations[d] = rng.choice([None, h.high_water_mark // 2, h.high_water_mark])
    src = frames(spark, h)
    exp = t.expected_destination_rooms(src.table("events"), src.table("room_memberships"), OUR)
    delivered = t.delivered_positions(src.table("federation_transaction_log"),
                                      src.table("events"))
    und = t.undelivered(exp, delivered, src.table("destinations"))
    got = {(r.destination, r.room_id): r.status for r in und.collect()}
    assert got == expected_undelivered(h)


def test_destination_health(spark: Any) -> None:
    h = scenario()
    # b: ok, fail, fail, ok (backoff 1000..5000), catch-up run of 2, then failing.
    h.send("b.example", ["$e5"], started_ts=0, duration_ms=100)
    h.send("b.example", [], status="transient", started_ts=1000, duration_ms=30000)
    h.send("b.example", [], status="transient", started_ts=3000, duration_ms=50)
    h.send("b.example", ["$e7"], started_ts=5000, duration_ms=200, catchup=True)
    h.send("b.example", ["$e11"], started_ts=6000, duration_ms=300, catchup=True)
    h.send("b.example", ["$e19"], started_ts=9000, duration_ms=40)
    h.send("b.example", [], status="permanent", started_ts=10000, duration_ms=40)
    h.send("c.example:8448", ["$e6"], started_ts=100, duration_ms=70, catchup=True)
    h.destinations = {"b.example": 11, "c.example:8448": None, "e.example": 3}
    h.destination_rooms = {("b.example", "!r1"): 11, ("b.example", "!r2"): 20,
                           ("c.example:8448", "!r1"): 6, ("f.example", "!r1"): 2}
    src = frames(spark, h)
    horizon = 20_000
    got = {r.destination: r.asDict() for r in t.destination_health(
        src.table("federation_transaction_log"), src.table("destinations"),
        src.table("destination_rooms"), horizon).collect()}
    want = expected_health(h, horizon)
    assert set(got) == set(want) == {"b.example", "c.example:8448", "e.example", "f.example"}
    for d, w in want.items():
        for k, v in w.items():
            assert got[d][k] == (pytest.approx(v) if isinstance(v, float) else v), (d, k)
    assert got["b.example"]["backoff_ms"] == (5000 - 1000) + (horizon - 10000)
    assert got["b.example"]["catchup_ms"] == 6300 - 5000
    assert got["b.example"]["lag_stream_positions"] == 9
    assert got["c.example:8448"]["lag_stream_positions"] == 6


def test_hourly_outcomes(spark: Any) -> None:
    h = scenario()
    for i, ts in enumerate([0, 10, 3_600_000, 3_700_000]):
        h.send("b.example", [], status="success" if i % 2 == 0 else "transient", started_ts=ts)
    src = frames(spark, h)
    got = {(r.hour_ts, r.status): r.transactions
           for r in t.hourly_outcomes(src.table("federation_transaction_log")).collect()}
    assert got == {(0, "success"): 1, (0, "transient"): 1, (3_600_000, "success"): 1,
                   (3_600_000, "transient"): 1}


@pytest.mark.parametrize("case", ["local ids only", "by id", "by a join"])
def test_delivered_positions_looked_up_among_local_events_first(
        spark: Any, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The jobs' lookup (``job.delivered_positions``: the local events first, the rest
    by id or by a join) gives what the plain join with every event gives."""
    import random

    from federation_sender.batch import job

    h = random_history(200)
    rng = random.Random(1)
    local = [e["event_id"] for e in h.events
             if e["sender"].endswith(f":{OUR}") and not e["outlier"] and not e["rejected"]]
    others = [e["event_id"] for e in h.events if e["event_id"] not in set(local)]
    pool = local if case == "local ids only" else local + others
    for d in ("b.example", "c.example", "d.example:8448"):
        h.send(d, [*rng.sample(pool, 20), "$unknown"])
    if case == "by a join":
        monkeypatch.setattr(job, "LOOKUP_IDS", 1)
    src = frames(spark, h)
    txn_log, events = src.table("federation_transaction_log"), src.table("events")
    plain = {tuple(r) for r in t.delivered_positions(txn_log, events).collect()}
    ours = t.local_candidates(events, OUR)
    rest = {r[0] for r in t.not_among(t.sent_event_ids(txn_log), t.local_events(ours, OUR))
            .collect()}
    if case == "local ids only":
        assert rest == {"$unknown"}
    else:   # ids of remote, outlier or rejected events, which only the second lookup finds
        assert len(rest) > 2, rest
    got = {tuple(r) for r in job.delivered_positions(txn_log, events, ours, OUR).collect()}
    assert got == plain and plain
