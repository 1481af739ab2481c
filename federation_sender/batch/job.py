"""What every job gets (:class:`JobContext`) and returns (:class:`JobResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from federation_sender.batch.io import Database, Source
from federation_sender.batch.progress import Progress
from federation_sender.clock import Clock

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SAMPLE_ROWS = 10


@dataclass
class JobContext:
    spark: SparkSession
    source: Source
    db: Database | None
    """Needed to apply results; ``None`` when reading a snapshot without a database."""
    server_name: str
    progress: Progress
    clock: Clock
    output_dir: Path | None = None


@dataclass
class JobResult:
    job: str
    summary: dict[str, Any]
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    exit_status: int = 0
    next_steps: list[str] = field(default_factory=list)
    """What the operator can do about the findings, one sentence each."""


def sample(df: DataFrame, order: list[str], n: int = SAMPLE_ROWS) -> list[dict[str, Any]]:
    return [r.asDict() for r in df.orderBy(*order).limit(n).collect()]


def counts_by(df: DataFrame, column: str) -> dict[str, int]:
    return {str(r[0]): int(r[1]) for r in df.groupBy(column).count().collect()}


def require_db(ctx: JobContext, what: str) -> Database:
    if ctx.db is None:
        raise ValueError(f"{what} needs a database (--database-url), not only a snapshot")
    return ctx.db


LOOKUP_IDS = 10_000
"""Logged PDUs that are not local events, up to which their events are fetched by id
(an ``IN`` list the database answers from the events it holds) rather than read whole."""


def delivered_positions(txn_log: DataFrame, events: DataFrame, local: DataFrame,
                        server_name: str) -> DataFrame:
    """What :func:`federation_sender.batch.transforms.delivered_positions` gives, reading
    a seventh of the events at 10M rows rather than all of them: the log's ids are
    looked up among the local events (``local``, kept by the job:
    :func:`~federation_sender.batch.transforms.local_candidates`), and the ids not found
    there, catch-up's remote extremities (few, often none), among the other events: by
    id when they are at most :data:`LOOKUP_IDS`, else by a join with every event of
    ``events`` (a frame of the source, so that the ``IN`` list reaches the database).
    Runs one action: collecting those ids."""
    from pyspark.sql import functions as F

    from federation_sender.batch import transforms as t

    sent = t.sent_event_ids(txn_log)
    ours = t.local_events(local, server_name)
    rest = [str(r[0]) for r in t.not_among(sent, ours).limit(LOOKUP_IDS + 1).collect()]
    if not rest:
        return t.delivered_among(sent, ours)
    others = events.filter(F.col("event_id").isin(rest)) if len(rest) <= LOOKUP_IDS else events
    return t.delivered_among(sent, ours, others)
