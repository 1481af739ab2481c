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
