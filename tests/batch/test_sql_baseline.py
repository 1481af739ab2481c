"""The PostgreSQL baseline queries against the same plain-Python oracles as Spark."""

from __future__ import annotations

import pytest

from bench.batch_baseline import run_query

from .histories import (
    OUR,
    expected_destination_rooms,
    expected_diff,
    expected_health,
    expected_undelivered,
    load_pg,
    random_history,
    scenario,
    with_every_finding,
)

pytestmark = pytest.mark.postgres


def _url(u: str) -> str:
    return u.replace("+psycopg", "")


def test_scenario_queries(batch_db: str) -> None:
    h = scenario()
    exp = expected_destination_rooms(h)
    h.destination_rooms = dict(exp)
    h.destination_rooms[("b.example", "!r1")] = 7
    h.destination_rooms[("b.example", "!gone")] = 5
    h.destination_rooms[("b.example", "!new")] = 10_000   # past the high-water mark: ignored
    h.send("b.example", ["$e5", "$e7"], started_ts=0, duration_ms=50)
    h.send("b.example", [], status="transient", started_ts=100, duration_ms=5)
    h.send("c.example:8448", ["$e6"], started_ts=10, duration_ms=7, catchup=True)
    h.destinations = {"b.example": 12, "c.example:8448": None}
    load_pg(h, batch_db)
    url = _url(batch_db)
    got = {(r["destination"], r["room_id"]): r["stream_ordering"]
           for r in run_query(url, "expected-destination-rooms", OUR)}
    assert got == exp
    diff = {(r["destination"], r["room_id"]): r["problem"]
            for r in run_query(url, "backfill-destination-rooms", OUR)}
    assert diff == expected_diff(h)
    und = {(r["destination"], r["room_id"]): r["status"] for r in run_query(url, "audit", OUR)}
    assert und == expected_undelivered(h)
    assert run_query(url, "audit-counts", OUR) == [_counts(und, diff)]
    health = {r["destination"]: r for r in run_query(url, "health-report", OUR, 1000)}
    want = expected_health(h, 1000)
    assert set(health) == set(want)
    for d, w in want.items():
        for k in ("transactions", "successes", "backoff_ms", "catchup_ms",
                  "lag_stream_positions", "outstanding_rooms", "latency_p95_ms"):
            assert health[d][k] == (pytest.approx(w[k]) if isinstance(w[k], float) else w[k])


def _counts(undelivered: dict[tuple[str, str], str],
            diff: dict[tuple[str, str], str]) -> dict[str, int]:
    """The one-statement audit's row, from the oracle's findings."""
    out = {f"undelivered_{s}": sum(1 for v in undelivered.values() if v == s)
           for s in ("lost", "pending")}
    out.update({f"rows_{p}": sum(1 for v in diff.values() if v == p)
                for p in ("missing", "stale", "behind", "ahead")})
    return out


@pytest.mark.parametrize("seed", [7, 8])
def test_random_expected(batch_db: str, seed: int) -> None:
    h = with_every_finding(random_history(seed, rooms=5, steps=200))
    exp = expected_destination_rooms(h)
    load_pg(h, batch_db)
    url = _url(batch_db)
    got = {(r["destination"], r["room_id"]): r["stream_ordering"]
           for r in run_query(url, "expected-destination-rooms", OUR)}
    assert got == exp
    want = _counts(expected_undelivered(h), expected_diff(h))
    assert all(want.values()), want   # every class is exercised
    assert run_query(url, "audit-counts", OUR) == [want]
