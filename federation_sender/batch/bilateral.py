"""The audit's bilateral check: ask the receivers whether they hold what we delivered.

Theory of operation
-------------------
The audit proper compares our own records with each other: a (destination, room) is
*delivered* when its newest local event the destination should have (the expected
``destination_rooms`` row) went out in a successful transaction, or a later event of
the room did. That is one replica's word. Anti-entropy in the trtl sense compares both
replicas, so for a sample of delivered pairs the driver asks the receiver, with the
worker's own signed federation client and egress rules,
``GET /_matrix/federation/v1/event/{eventId}`` for that event, and classifies the
answer (:data:`HOLDINGS`): ``held`` (200), ``not_held`` (Synapse's 404), ``unreachable``
(no answer within the bound, a refused connection, or any other status: a 403 or a 5xx
says nothing about the event) and ``unsupported`` (a 404 ``M_UNRECOGNIZED``: the
receiver does not serve the request). Only ``not_held`` is a finding: the receiver
acknowledged a transaction carrying the event (or its successor) and no longer has it,
e.g. it lost a database, was restored from a backup, or purged.

Bounds. The sample is at most ``total`` pairs, shared fairly among the destinations
(:func:`sample_pairs`: round-robin over the destinations, each one's rooms in random
order, so two destinations' shares differ by at most one unless one runs out); requests
to one destination start at least ``1 / per_destination_per_s`` apart and one at a
time, each bounded by ``request_timeout_s`` on the injected clock; after
``give_up_after`` unanswered requests in a row a destination is not asked again in this
run (its remaining pairs are ``unreachable``, marked not asked). At most ``parallel``
requests are in flight in all. The randomness is a ``random.Random`` seeded from the
run's seed (reported, so a run can be repeated), and the input is sorted first, so a
seed and a set of pairs give one sample.

Where it runs: the Spark part (:func:`delivered_pairs`, :func:`fair_candidates`) finds the
delivered pairs and keeps only the ranks a fair sample can reach (at most ``total`` plus
one row per destination reach the driver); the driver then samples, asks with asyncio,
and repairs. Never the executors: they hold no signing key and may not reach the
receivers.

Repair (``--repair``): each ``not_held`` pair goes back to catch-up, in one transaction
through the storage boundary with the audit's own repair of the source's schema
(:func:`federation_sender.batch.io.apply_changes`): the pair's ``destination_rooms`` row
ends at or above the event (ours: set to it when at or below the audit's high-water
mark, a newer row the worker wrote kept; Synapse's: created or raised, never lowered),
and the destination's ``last_successful_stream_ordering`` is lowered to one below its
earliest such event, never raised. The worker's catch-up resends the event from its
next wake-up sweep, whether the destination's queue is live (it reads the lowered
position again, and its own writes apply only over the position it knows) or not (it
starts in catch-up mode). Receivers deduplicate by event id: resending what another
room's row covers costs bandwidth only.

docs/batch.md ("Bilateral check") has the options and a measured run.
"""

from __future__ import annotations

import asyncio
import enum
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from federation_sender.aio.timing import AttemptDeadline
from federation_sender.batch.arguments import AskLimits
from federation_sender.batch.io import apply_changes, write_outputs
from federation_sender.batch.job import SAMPLE_ROWS, JobContext, require_db
from federation_sender.clock import Clock
from federation_sender.transport.result import EventHeld, EventProbe

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


class Holding(enum.Enum):
    """What a receiver said about one delivered pair's event."""

    HELD = "held"
    NOT_HELD = "not_held"
    UNREACHABLE = "unreachable"
    UNSUPPORTED = "unsupported"


HOLDINGS: Mapping[EventHeld, Holding] = {
    EventHeld.YES: Holding.HELD,
    EventHeld.NOT_YET: Holding.NOT_HELD,
    EventHeld.NO_ANSWER: Holding.UNREACHABLE,
    EventHeld.UNSUPPORTED: Holding.UNSUPPORTED,
}
"""The client's answer to ``GET /event`` -> the class reported."""

ProbeOpener = Callable[[Clock], AbstractAsyncContextManager[EventProbe]]
"""Opens the worker's federation client for the check (started on entry, closed on
exit); the composition root supplies it (the batch layer does not build clients)."""


@dataclass(frozen=True, order=True)
class DeliveredPair:
    """A (destination, room) the audit marks delivered, with the room's newest local
    event the destination should hold."""

    destination: str
    room_id: str
    event_id: str
    stream_ordering: int


@dataclass(frozen=True)
class PairAnswer:
    pair: DeliveredPair
    holding: Holding
    asked: bool = True
    """False: not asked, the destination had stopped answering (``give_up_after``)."""


@dataclass(frozen=True)
class ReceiverCheck:
    """What the audit needs to run the check: its bounds, its seed and the client."""

    open_probe: ProbeOpener
    limits: AskLimits = field(default_factory=AskLimits)
    seed: int = 0


@dataclass
class CheckResult:
    """The check's figures for the audit's summary, its samples, and the finding count."""

    summary: dict[str, object]
    samples: dict[str, list[dict[str, Any]]]
    not_held: int


# -- the pure core ----------------------------------------------------------------------
def sample_pairs(pairs: Iterable[DeliveredPair], total: int,
                 rng: random.Random) -> list[DeliveredPair]:
    """At most ``total`` of ``pairs``, fair among destinations: round-robin over the
    destinations (in an order drawn from ``rng``), each one's rooms shuffled by ``rng``.
    Sorted first, so the result depends on the set of pairs and ``rng``'s state only."""
    by_destination: dict[str, list[DeliveredPair]] = {}
    for p in sorted(set(pairs)):
        by_destination.setdefault(p.destination, []).append(p)
    order = list(by_destination)
    rng.shuffle(order)
    for rooms in by_destination.values():
        rng.shuffle(rooms)
    out: list[DeliveredPair] = []
    depth = 0
    while order and len(out) < total:
        left = []
        for d in order:
            if len(out) == total:
                break
            rooms = by_destination[d]
            out.append(rooms[depth])
            if depth + 1 < len(rooms):
                left.append(d)
        order, depth = left, depth + 1
    return out


def rank_cut(rows_per_rank: Mapping[int, int], total: int) -> int:
    """The deepest per-destination rank a fair sample of ``total`` can reach, given how
    many destinations have a row at each rank (1, 2, ...): the first rank at which the
    rows so far reach ``total``, else the last rank."""
    seen = 0
    for rank in sorted(rows_per_rank):
        seen += rows_per_rank[rank]
        if seen >= total:
            return rank
    return max(rows_per_rank, default=0)


def tally(answers: Sequence[PairAnswer]) -> dict[Holding, int]:
    counts = dict.fromkeys(Holding, 0)
    for a in answers:
        counts[a.holding] += 1
    return counts


RowChange = tuple[str, str, int, str]
"""(destination, room_id, stream_ordering, action): :func:`apply_changes`' changes."""
Position = tuple[str, int]
"""(destination, position): :func:`apply_changes`' positions."""


def hand_back(not_held: Sequence[DeliveredPair]) -> tuple[list[RowChange], list[Position]]:
    """The repair of ``not_held`` pairs as the audit's changes: each pair's
    ``destination_rooms`` row to its event, each destination's position one below its
    earliest such event (applied only downwards)."""
    earliest: dict[str, int] = {}
    for p in not_held:
        earliest[p.destination] = min(earliest.get(p.destination, p.stream_ordering),
                                      p.stream_ordering)
    rows = [(p.destination, p.room_id, p.stream_ordering, "upsert") for p in sorted(not_held)]
    return rows, [(d, so - 1) for d, so in sorted(earliest.items())]


# -- the asyncio shell ------------------------------------------------------------------
async def ask_receivers(pairs: Sequence[DeliveredPair], probe: EventProbe, clock: Clock,
                        limits: AskLimits) -> list[PairAnswer]:
    """Ask for every pair's event within ``limits``; the answers in ``pairs``' order."""
    by_destination: dict[str, list[DeliveredPair]] = {}
    for p in pairs:
        by_destination.setdefault(p.destination, []).append(p)
    gate = asyncio.Semaphore(limits.parallel)
    found: dict[DeliveredPair, PairAnswer] = {}
    async with asyncio.TaskGroup() as tasks:
        for destination, rooms in by_destination.items():
            tasks.create_task(_ask_destination(destination, rooms, probe, clock, limits,
                                               gate, found))
    return [found[p] for p in pairs]


async def _ask_destination(destination: str, pairs: Sequence[DeliveredPair],
                           probe: EventProbe, clock: Clock, limits: AskLimits,
                           gate: asyncio.Semaphore,
                           found: dict[DeliveredPair, PairAnswer]) -> None:
    """One destination's pairs, one request at a time, starts ``1 / rate`` apart."""
    interval_s = 1.0 / limits.per_destination_per_s
    deadline = AttemptDeadline(clock, limits.request_timeout_s)
    next_start: float | None = None
    unanswered = 0
    try:
        for pair in pairs:
            if unanswered >= limits.give_up_after:
                found[pair] = PairAnswer(pair, Holding.UNREACHABLE, asked=False)
                continue
            if next_start is not None:
                wait_s = next_start - clock.monotonic_s()
                if wait_s > 0:
                    await clock.sleep(wait_s)
            async with gate:
                # Spaced from when the request really starts, after any wait for the gate.
                next_start = clock.monotonic_s() + interval_s
                holding = HOLDINGS[await _ask(probe, destination, pair.event_id, deadline)]
            unanswered = unanswered + 1 if holding is Holding.UNREACHABLE else 0
            found[pair] = PairAnswer(pair, holding)
    finally:
        deadline.close()


async def _ask(probe: EventProbe, destination: str, event_id: str,
               deadline: AttemptDeadline) -> EventHeld:
    try:
        async with asyncio.timeout(None) as timeout:
            deadline.watch(timeout)
            try:
                return await probe.event_persisted(destination, event_id)
            finally:
                deadline.unwatch()
    except TimeoutError:
        return EventHeld.NO_ANSWER


async def _ask_all(check: ReceiverCheck, pairs: Sequence[DeliveredPair],
                   clock: Clock) -> list[PairAnswer]:
    if not pairs:
        return []
    async with check.open_probe(clock) as probe:
        return await ask_receivers(pairs, probe, clock, check.limits)


# -- the audit's hook (Spark, then the driver) ------------------------------------------
def delivered_pairs(expected: DataFrame, undelivered: DataFrame, events: DataFrame,
                    server_name: str) -> DataFrame:
    """The audit's delivered pairs: the expected rows (:func:`~federation_sender.batch
    .transforms.expected_destination_rooms`) minus the undelivered ones, with the event
    at each row's stream ordering. Columns: ``destination``, ``room_id``, ``event_id``,
    ``stream_ordering``."""
    from federation_sender.batch import transforms as t

    ours = t.local_events(events, server_name).select("stream_ordering", "event_id", "room_id")
    return (
        expected.join(undelivered.select("destination", "room_id"),
                      ["destination", "room_id"], "left_anti")
        .join(ours, ["room_id", "stream_ordering"])
        .select("destination", "room_id", "event_id", "stream_ordering")
    )


def fair_candidates(delivered: DataFrame, total: int,
                    seed: int) -> tuple[list[DeliveredPair], int]:
    """The rows of ``delivered`` a fair sample of ``total`` can take, collected (each
    destination's rooms ranked in a seeded hash order, ranks up to :func:`rank_cut`: at
    most ``total`` rows plus one per destination), and how many delivered pairs there
    are in all."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    order = Window.partitionBy("destination").orderBy(
        F.xxhash64(F.lit(seed), F.col("room_id")), F.col("room_id"))
    ranked = delivered.withColumn("rank", F.row_number().over(order)).cache()
    try:
        per_rank = {int(r[0]): int(r[1]) for r in ranked.groupBy("rank").count().collect()}
        cut = rank_cut(per_rank, total)
        rows = ranked.filter(F.col("rank") <= F.lit(cut)).select(
            "destination", "room_id", "event_id", "stream_ordering").collect()
    finally:
        ranked.unpersist()
    pairs = [DeliveredPair(str(r[0]), str(r[1]), str(r[2]), int(r[3])) for r in rows]
    return pairs, sum(per_rank.values())


def check_receivers(ctx: JobContext, delivered: DataFrame, check: ReceiverCheck, *,
                    repair: bool, high_water_mark: int) -> CheckResult:
    """The audit's hook: sample ``delivered`` (:func:`delivered_pairs`), ask the
    receivers, report, and with ``repair`` hand the ``not_held`` pairs back to
    catch-up."""
    limits = check.limits
    with ctx.progress.step("sample delivered pairs to ask the receivers about"):
        candidates, population = fair_candidates(delivered, limits.total, check.seed)
        pairs = sample_pairs(candidates, limits.total, random.Random(check.seed))
    n_dest = len({p.destination for p in pairs})
    with ctx.progress.step(f"ask {n_dest} receivers about {len(pairs)} events "
                           f"(at most {limits.per_destination_per_s:g}/s each)"):
        answers = asyncio.run(_ask_all(check, pairs, ctx.clock))
    if ctx.output_dir is not None:
        with ctx.progress.step(f"write the receivers' answers to {ctx.output_dir}"):
            write_outputs(_answers_frame(ctx, answers), ctx.output_dir, "bilateral")
    by_class = tally(answers)
    summary: dict[str, object] = {
        "bilateral_delivered_pairs": population,
        "bilateral_asked": sum(1 for a in answers if a.asked),
        "bilateral_destinations": n_dest,
        **{f"bilateral_{h.value}": by_class[h] for h in Holding},
        "bilateral_seed": check.seed,
    }
    if repair:
        lost = [a.pair for a in answers if a.holding is Holding.NOT_HELD]
        summary.update(hand_back_rooms(ctx, lost, high_water_mark))
    return CheckResult(summary, _samples(answers), by_class[Holding.NOT_HELD])


def hand_back_rooms(ctx: JobContext, not_held: Sequence[DeliveredPair],
                    high_water_mark: int) -> dict[str, object]:
    """``--repair``: :func:`hand_back`'s changes applied in one transaction, as the
    audit applies its own; the counts of what changed."""
    db = require_db(ctx, "audit --repair")
    with ctx.progress.step(f"hand the rooms receivers lack back to catch-up ({len(not_held)})"):
        upserted = lowered = 0
        if not_held:
            rows, positions = hand_back(not_held)
            res = apply_changes(
                db,
                ctx.spark.createDataFrame(rows, "destination string, room_id string, "
                                          "stream_ordering long, action string"),
                ctx.spark.createDataFrame(positions, "destination string, position long"),
                high_water_mark, "audit-bilateral", schema=ctx.source.schema)
            upserted, lowered = res.upserted, res.positions_lowered
    return {"bilateral_rows_upserted": upserted, "bilateral_positions_lowered": lowered}


def _samples(answers: Sequence[PairAnswer]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for h in (Holding.NOT_HELD, Holding.UNREACHABLE, Holding.UNSUPPORTED, Holding.HELD):
        of = sorted((a for a in answers if a.holding is h), key=lambda a: a.pair)
        out[f"bilateral_{h.value}"] = [_row(a) for a in of[:SAMPLE_ROWS]]
    return out


def _row(a: PairAnswer) -> dict[str, Any]:
    p = a.pair
    return {"destination": p.destination, "room_id": p.room_id, "event_id": p.event_id,
            "stream_ordering": p.stream_ordering, "answer": a.holding.value, "asked": a.asked}


def _answers_frame(ctx: JobContext, answers: Sequence[PairAnswer]) -> DataFrame:
    schema = ("destination string, room_id string, event_id string, stream_ordering long, "
              "answer string, asked boolean")
    return ctx.spark.createDataFrame([tuple(_row(a).values()) for a in answers], schema)
