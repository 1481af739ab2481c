"""The audit's bilateral check (federation_sender/batch/bilateral.py) without a receiver:
the sampler's bounds and fairness, the request rate on a fake clock, the answers'
classes, the repair's writes on both databases, and the hook inside the audit job.
tests/batch/test_bilateral_synapse.py asks a real Synapse."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import json
import random
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from federation_sender.batch.arguments import EXIT_FINDINGS, EXIT_USAGE, add_batch_parser
from federation_sender.batch.bilateral import (
    AskLimits,
    DeliveredPair,
    Holding,
    PairAnswer,
    ask_receivers,
    fair_candidates,
    hand_back,
    hand_back_rooms,
    rank_cut,
    sample_pairs,
)
from federation_sender.batch.cli import run_batch
from federation_sender.batch.io import Database, DataFrameSource
from federation_sender.batch.job import JobContext
from federation_sender.batch.progress import Progress
from federation_sender.clock import Clock, SystemClock
from federation_sender.config import DatabaseSettings, Settings
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.clock import FakeClock
from federation_sender.transport.result import EventHeld, EventProbe

from .histories import (
    OUR,
    History,
    expected_destination_rooms,
    load_pg,
    read_destination_rooms,
    read_positions,
    scenario,
)


def pairs_of(counts: Mapping[str, int]) -> list[DeliveredPair]:
    return [DeliveredPair(d, f"!r{i}:{d}", f"$e{i}-{d}", i + 1)
            for d, n in counts.items() for i in range(n)]


def taken(sample: list[DeliveredPair]) -> Counter[str]:
    return Counter(p.destination for p in sample)


# -- the sampler ------------------------------------------------------------------------
def test_sample_is_bounded_and_shared_fairly() -> None:
    counts = {"a.example": 100, "b.example": 3, "c.example": 50, "d.example": 1}
    sample = sample_pairs(pairs_of(counts), 40, random.Random(1))
    assert len(sample) == len(set(sample)) == 40
    # The small ones whole, the rest shared evenly: 3 + 1 + 18 + 18.
    assert taken(sample) == {"a.example": 18, "b.example": 3, "c.example": 18, "d.example": 1}


def test_every_destination_is_sampled_when_the_total_allows() -> None:
    counts = {f"s{i}.example": 1 + i % 7 for i in range(30)}
    sample = sample_pairs(pairs_of(counts), 30, random.Random(5))
    assert taken(sample) == dict.fromkeys(counts, 1)


def test_sample_depends_on_the_seed_and_the_set_only() -> None:
    pairs = pairs_of({"a.example": 40, "b.example": 40, "c.example": 5})
    shuffled = list(pairs)
    random.Random(9).shuffle(shuffled)
    first = sample_pairs(pairs, 20, random.Random(7))
    assert sample_pairs(shuffled + pairs[:3], 20, random.Random(7)) == first
    assert sample_pairs(pairs, 20, random.Random(8)) != first


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text("abcdefgh", min_size=1, max_size=3), st.integers(1, 30),
                       max_size=12),
       st.integers(0, 150), st.integers(0, 2**31))
def test_sample_property(counts: dict[str, int], total: int, seed: int) -> None:
    pairs = pairs_of(counts)
    sample = sample_pairs(pairs, total, random.Random(seed))
    got = taken(sample)
    assert len(sample) == min(total, len(pairs)) and set(sample) <= set(pairs)
    # Water-filling: a destination has fewer than another, less one, only when it ran out.
    for x in counts:
        for y in counts:
            assert got[x] >= min(counts[x], got[y] - 1), (x, y, got)


def test_rank_cut() -> None:
    per_rank = {1: 5, 2: 3, 3: 1}
    assert [rank_cut(per_rank, n) for n in (1, 5, 6, 8, 9, 100)] == [1, 1, 2, 2, 3, 3]
    assert rank_cut({}, 10) == 0


@pytest.mark.spark
def test_the_candidates_spark_keeps_allow_the_same_fair_sample(spark: Any) -> None:
    counts = {"a.example": 60, "b.example": 2, "c.example": 25, "d.example": 9}
    pairs = pairs_of(counts)
    df = spark.createDataFrame(
        [(p.destination, p.room_id, p.event_id, p.stream_ordering) for p in pairs],
        "destination string, room_id string, event_id string, stream_ordering long")
    for total in (5, 40, 500):
        kept, population = fair_candidates(df, total, seed=4)
        assert population == len(pairs)
        assert len(kept) <= total + len(counts)
        fair = taken(sample_pairs(pairs, total, random.Random(4)))
        assert taken(sample_pairs(kept, total, random.Random(4))) == fair, total


def test_hand_back_lowers_below_each_destinations_earliest_event() -> None:
    lost = [DeliveredPair("b.example", "!r2", "$x", 30),
            DeliveredPair("b.example", "!r1", "$y", 12),
            DeliveredPair("c.example", "!r1", "$z", 7)]
    assert hand_back(lost) == (
        [("b.example", "!r1", 12, "upsert"), ("b.example", "!r2", 30, "upsert"),
         ("c.example", "!r1", 7, "upsert")],
        [("b.example", 11), ("c.example", 6)],
    )


# -- the requests, on a fake clock ------------------------------------------------------
class RecordingProbe:
    """Answers from a table (event id -> answer, YES otherwise) after ``latency_s`` on
    the clock, NO_ANSWER for a destination in ``down``, never for one in ``silent``.
    Records each request's start."""

    def __init__(self, clock: Clock, answers: Mapping[str, EventHeld] | None = None,
                 latency_s: float = 0.1, silent: frozenset[str] = frozenset(),
                 down: frozenset[str] = frozenset()) -> None:
        self.clock = clock
        self.answers = dict(answers or {})
        self.latency_s = latency_s
        self.silent = silent
        self.down = down
        self.starts: dict[str, list[float]] = defaultdict(list)
        self.in_flight = 0
        self.most_in_flight = 0

    async def event_persisted(self, destination: str, event_id: str) -> EventHeld:
        self.starts[destination].append(self.clock.monotonic_s())
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if destination in self.silent:
                await asyncio.Event().wait()
            await self.clock.sleep(self.latency_s)
            if destination in self.down:
                return EventHeld.NO_ANSWER
            return self.answers.get(event_id, EventHeld.YES)
        finally:
            self.in_flight -= 1


async def run_on(clock: FakeClock, pairs: list[DeliveredPair], probe: EventProbe,
                 limits: AskLimits) -> tuple[list[PairAnswer], float]:
    """Run the check, advancing the fake clock 10 ms at a time; (answers, seconds)."""
    task = asyncio.ensure_future(ask_receivers(pairs, probe, clock, limits))
    started = clock.monotonic_s()
    for _ in range(100_000):
        if task.done():
            break
        await clock.advance_and_settle(0.01, rounds=5)
    return task.result(), clock.monotonic_s() - started


async def test_requests_to_one_destination_keep_the_rate_and_the_total_holds() -> None:
    clock = FakeClock()
    counts = {"a.example": 30, "b.example": 4, "c.example": 12}
    limits = AskLimits(total=25, per_destination_per_s=2.0)
    sample = sample_pairs(pairs_of(counts), limits.total, random.Random(3))
    probe = RecordingProbe(clock)
    answers, took_s = await run_on(clock, sample, probe, limits)
    assert [a.pair for a in answers] == sample
    assert sum(len(s) for s in probe.starts.values()) == len(sample) == 25
    # b.example whole, a and c sharing the rest (the odd one to whichever came first).
    assert probe.starts["b.example"] and len(probe.starts["b.example"]) == 4
    assert sorted(len(probe.starts[d]) for d in ("a.example", "c.example")) == [10, 11]
    for destination, starts in probe.starts.items():
        gaps = [b - a for a, b in itertools.pairwise(starts)]
        assert min(gaps) >= 0.5 - 1e-9, (destination, gaps)
    # Destinations in parallel: the longest share (11 at 2/s) sets the time.
    assert 5.0 <= took_s < 5.5
    assert {a.holding for a in answers} == {Holding.HELD}


async def test_parallel_requests_are_bounded() -> None:
    clock = FakeClock()
    sample = pairs_of({f"s{i}.example": 2 for i in range(20)})
    probe = RecordingProbe(clock, latency_s=1.0)
    _, took_s = await run_on(clock, sample, probe,
                             AskLimits(total=40, per_destination_per_s=100.0, parallel=4))
    assert probe.most_in_flight == 4
    assert took_s >= 10.0  # 40 requests of 1 s, 4 at a time


async def test_answers_are_classified_and_a_silent_destination_is_given_up() -> None:
    clock = FakeClock()
    pairs = pairs_of({"a.example": 4, "quiet.example": 6})
    table = {"$e0-a.example": EventHeld.NOT_YET, "$e1-a.example": EventHeld.NO_ANSWER,
             "$e2-a.example": EventHeld.UNSUPPORTED}
    probe = RecordingProbe(clock, table, silent=frozenset({"quiet.example"}))
    limits = AskLimits(total=10, request_timeout_s=3.0, give_up_after=2)
    answers, took_s = await run_on(clock, pairs, probe, limits)
    got = {a.pair.event_id: (a.holding, a.asked) for a in answers}
    assert [got[f"$e{i}-a.example"] for i in range(4)] == [
        (Holding.NOT_HELD, True), (Holding.UNREACHABLE, True), (Holding.UNSUPPORTED, True),
        (Holding.HELD, True)]
    # Two requests timed out after 3 s each; the other four were not asked.
    assert len(probe.starts["quiet.example"]) == 2
    assert [got[f"$e{i}-quiet.example"] for i in range(6)] == (
        [(Holding.UNREACHABLE, True)] * 2 + [(Holding.UNREACHABLE, False)] * 4)
    assert 6.0 <= took_s < 6.5  # two timeouts of 3 s, back to back


def test_limits_refuse_nonsense() -> None:
    for bad in ({"total": -1}, {"per_destination_per_s": 0.0}, {"request_timeout_s": 0.0},
                {"give_up_after": 0}, {"parallel": 0}):
        with pytest.raises(ValueError):
            AskLimits(**bad)


# -- the repair on both databases -------------------------------------------------------
async def _prepare(url: str) -> None:
    engine = create_engine(url)
    try:
        await upgrade(engine)
        async with engine.begin() as conn:
            await conn.execute(text(
                "INSERT INTO destination_rooms (destination, room_id, stream_ordering) VALUES "
                "('b.example', '!r1', 40), ('b.example', '!r2', 90), ('c.example', '!r1', 5)"))
            await conn.execute(text(
                "INSERT INTO destinations (destination, last_successful_stream_ordering) "
                "VALUES ('b.example', 95), ('c.example', 2)"))
    finally:
        await engine.dispose()


async def _read(url: str) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(text(
                "SELECT destination, room_id, stream_ordering FROM destination_rooms"))).all()
            pos = (await conn.execute(text(
                "SELECT destination, last_successful_stream_ordering FROM destinations"))).all()
    finally:
        await engine.dispose()
    return {(d, r): so for d, r, so in rows}, {d: p for d, p in pos}


@pytest.mark.spark
def test_hand_back_only_lowers_positions_and_keeps_newer_rows(
        spark: Any, db_url: str, tmp_path: Path) -> None:
    asyncio.run(_prepare(db_url))
    lost = [DeliveredPair("b.example", "!r1", "$a", 40),   # row = the event: stays
            DeliveredPair("b.example", "!r2", "$b", 50),   # row past the mark: kept
            DeliveredPair("b.example", "!r3", "$c", 60),   # no row: made
            DeliveredPair("c.example", "!r1", "$d", 5)]    # position already below
    ctx = JobContext(spark, DataFrameSource({}, 80), Database.from_urls(db_url), OUR,
                     Progress("audit", FakeClock(), enabled=False), FakeClock())
    counts = hand_back_rooms(ctx, lost, high_water_mark=80)
    rows, pos = asyncio.run(_read(db_url))
    assert rows == {("b.example", "!r1"): 40, ("b.example", "!r2"): 90,
                    ("b.example", "!r3"): 60, ("c.example", "!r1"): 5}
    assert pos == {"b.example": 39, "c.example": 2}
    assert counts["bilateral_positions_lowered"] == 1


# -- the hook in the audit job ----------------------------------------------------------
def delivered_history() -> History:
    """The scenario with destination_rooms right and every expected event delivered."""
    h = scenario()
    h.destination_rooms = dict(expected_destination_rooms(h))
    by_so = {e["stream_ordering"]: e["event_id"] for e in h.events}
    for (dest, _room), so in sorted(h.destination_rooms.items()):
        h.send(dest, [by_so[so]])
    h.destinations = {d: h.high_water_mark for d, _ in h.destination_rooms}
    return h


def audit(spark: Any, url: str, probe: EventProbe | None, *argv: str,
          output: Path | None = None) -> tuple[int, dict[str, Any]]:
    parser = argparse.ArgumentParser()
    add_batch_parser(parser.add_subparsers(dest="command"))
    extra = ["--output", str(output)] if output else []
    args = parser.parse_args(["batch", "audit", "--json", "--quiet", "--database-url", url,
                              *extra, *argv])

    @contextlib.asynccontextmanager
    async def opened(_clock: Clock) -> AsyncIterator[EventProbe]:
        assert probe is not None
        yield probe

    out = io.StringIO()
    status = run_batch(args, Settings(server_name=OUR, database=DatabaseSettings(url=url)),
                       spark=spark, clock=SystemClock(), out=out,
                       receivers=None if probe is None else opened)
    return status, json.loads(out.getvalue()) if out.getvalue() else {}


@pytest.mark.spark
@pytest.mark.postgres
def test_the_audit_asks_reports_and_hands_back(spark: Any, batch_db: str,
                                               tmp_path: Path) -> None:
    h = delivered_history()
    load_pg(h, batch_db)
    by_so = {e["stream_ordering"]: e["event_id"] for e in h.events}
    expected = {(d, r): by_so[so] for (d, r), so in expected_destination_rooms(h).items()}
    lost_pair = ("b.example", "!r1")
    table = {expected[lost_pair]: EventHeld.NOT_YET}
    probe = RecordingProbe(SystemClock(), table, latency_s=0.0,
                           down=frozenset({"c.example:8448"}))
    # Clean on our side, so only the receivers' answers are findings.
    status, doc = audit(spark, batch_db, probe, "--ask-receivers", "--ask-rate", "50",
                        "--ask-seed", "3", output=tmp_path)
    s = doc["summary"]
    c_pairs = sum(1 for d, _ in expected if d == "c.example:8448")
    assert status == EXIT_FINDINGS and s["undelivered_lost"] == 0, s
    assert s["bilateral_delivered_pairs"] == len(expected)
    assert (s["bilateral_not_held"], s["bilateral_unreachable"], s["bilateral_held"]) == (
        1, c_pairs, len(expected) - 1 - c_pairs)
    assert s["bilateral_seed"] == 3 and "bilateral_rows_upserted" not in s
    [row] = doc["samples"]["bilateral_not_held"]
    assert (row["destination"], row["room_id"], row["event_id"]) == (
        *lost_pair, expected[lost_pair])
    assert set(probe.starts) == {d for d, _ in expected}  # every destination asked
    assert (tmp_path / "bilateral.csv").read_text().count("\n") == len(expected) + 1

    before = read_positions(batch_db)
    status, doc = audit(spark, batch_db, probe, "--ask-receivers", "--ask-rate", "50",
                        "--repair")
    s = doc["summary"]
    assert status == EXIT_FINDINGS
    assert (s["bilateral_rows_upserted"], s["bilateral_positions_lowered"]) == (1, 1)
    so = expected_destination_rooms(h)[lost_pair]
    assert read_positions(batch_db) == {**before, "b.example": so - 1}
    assert read_destination_rooms(batch_db)[lost_pair] == so


@pytest.mark.spark
@pytest.mark.postgres
def test_ask_receivers_needs_the_client_and_sane_numbers(spark: Any, batch_db: str) -> None:
    assert audit(spark, batch_db, None, "--ask-receivers", "5")[0] == EXIT_USAGE
    probe = RecordingProbe(SystemClock())
    assert audit(spark, batch_db, probe, "--ask-receivers", "-1")[0] == EXIT_USAGE
    assert audit(spark, batch_db, probe, "--ask-receivers", "--ask-rate", "0")[0] == EXIT_USAGE
