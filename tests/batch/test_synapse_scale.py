"""``bench/synapse_scale.py``'s generator at a tiny size, on the suite's PostgreSQL and a
schema Synapse itself created: what it loads is consistent, and the audit as one plain
query (``bench/synapse_batch_baseline.py``) finds exactly the classes the generator
planted, every one of them.

The tiny world has 120 destinations and 60 rooms (the benchmark's sizes have 1 per 200
and 1 per 50 rows) and raised planting rates (2 % of the pairs each with no row, an older
row, lost), so that each class has pairs; the benchmark's sizes use the defaults.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import psycopg
import pytest

from bench.synapse_batch_baseline import FINDINGS, run_counts
from bench.synapse_scale import DANGLING, OUR, derive, expected, generate, table_counts
from federation_sender.storage.synapse.database import create_synapse_engine, upgrade_own_schema
from tests.synapse.backend_support import synapse_db_url_fixture, synapse_template_fixture

pytestmark = [pytest.mark.postgres]

__all__ = ["synapse_db_url_fixture", "synapse_template_fixture"]

CLASSES = {("delivered", "in_log"), ("delivered", "before_log"), ("lost", "not_in_log"),
           ("missing_row", "no_row"), ("missing_row", "row_behind"), ("pending", "backoff"),
           ("pending", "catch_up"), ("pending", "sender_behind")}


async def _migrate(url: str) -> None:
    engine = create_synapse_engine(url)
    try:
        await upgrade_own_schema(engine)
    finally:
        await engine.dispose()


def test_plain_audit_finds_exactly_the_planted_classes(synapse_db_url: str) -> None:
    t0 = time.monotonic()
    asyncio.run(_migrate(synapse_db_url))
    world = derive(2_000, seed=7, destinations=120, rooms=60)
    params = dataclasses.replace(world, p_no_row=0.02, p_row_behind=0.02, p_lost=0.02)
    report = generate(synapse_db_url, params, log=lambda _line: None)

    with psycopg.connect(synapse_db_url) as conn:
        assert conn.execute(DANGLING).fetchone() == (0, 0, 0, 0)
        counts = table_counts(conn)
        # The skew: small rooms of a few servers beside rooms of most of them.
        sizes = [int(n) for (n,) in conn.execute(
            "SELECT count(*) FROM current_state_events WHERE type = 'm.room.member'"
            " AND membership = 'join' GROUP BY room_id ORDER BY 1").fetchall()]
    assert counts["destination_rooms"] >= 1_500
    assert counts["events"] > counts["destination_rooms"]
    assert sizes[0] <= 5 and sizes[-1] >= 60

    want = expected(synapse_db_url)
    assert {k for k, (n, _) in want.items() if n > 0} == CLASSES
    got = run_counts(synapse_db_url, OUR, params.now_ms)
    assert got == want

    # The findings themselves: each lost pair's destination is past its event, which no
    # successful transaction carried; each missing row is missing or older.
    with psycopg.connect(synapse_db_url) as conn:
        hwm = report["params"]["hwm"]
        rows = conn.execute(FINDINGS, {"server": OUR, "hwm": hwm,
                                       "now_ms": params.now_ms}).fetchall()
    for dest, _room, _eid, so, row_so, position, delivered_so, status, reason in rows:
        assert dest != OUR
        if status == "lost":
            assert position >= so and (delivered_so is None or delivered_so < so)
        if reason == "no_row":
            assert row_so is None
        if reason == "row_behind":
            assert row_so < so
    assert time.monotonic() - t0 < 30
