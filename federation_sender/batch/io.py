"""Reading and writing for the batch jobs: JDBC reads partitioned on the stream
ordering, Parquet snapshots, and the staging table + single upsert that applies results.

Consistency
-----------
A job first fixes a *high-water mark* H, the highest ``events.stream_ordering`` when it
starts, and only looks at events and memberships up to H. The worker keeps running
meanwhile and writes ``destination_rooms`` rows for newer events; the apply step never
overwrites or deletes a row whose stream ordering is past H, so a batch result can not
undo the worker's newer writes.

Apply
-----
Results are written by Spark (in parallel, from the executors) into a fresh UNLOGGED
staging table (made and dropped by :mod:`federation_sender.storage.batch_reads`, which
also holds the driver's reads of the high-water mark and partition bounds), then
applied in one transaction through the storage boundary
(``tx.destinations.apply_staged_batch``, the statements of
:mod:`federation_sender.storage.batch_apply`): one ``INSERT … ON CONFLICT DO UPDATE``
for upserts, one ``DELETE`` for stale rows, one upsert of destination positions (only
ever lowered). A run that fails before that transaction commits
changes nothing but the staging table, which is dropped on the way out; the result of a
run is a function of the data, so running again is idempotent.

On the embedded SQLite database (the default configuration and the demo use one) the
jobs read through Debian's SQLite JDBC driver (``libxerial-sqlite-jdbc-java``), and the
apply step collects the (small) result on the driver and applies it in one SQLite
transaction with the same statements (``tx.destinations.apply_batch``).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
from sqlalchemy.engine import make_url

from federation_sender.batch.session import JDBC_DRIVER, SQLITE_JDBC_DRIVER
from federation_sender.storage import batch_reads
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.batch_apply import BatchCounts, StagedChange
from federation_sender.storage.engine import create_engine, run_in_transaction
from federation_sender.storage.protocols import Tx
from federation_sender.storage.synapse import batch_apply as synapse_apply
from federation_sender.storage.synapse import batch_reads as synapse_reads
from federation_sender.storage.synapse.database import create_synapse_engine

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

TABLE_COLUMNS: Mapping[str, tuple[str, ...]] = {
    "events": ("stream_ordering", "event_id", "room_id", "sender", "outlier", "rejected"),
    "room_memberships": (
        "event_stream_ordering", "room_id", "user_id", "server_name", "membership",
    ),
    "destination_rooms": ("destination", "room_id", "stream_ordering"),
    "destinations": ("destination", "last_successful_stream_ordering"),
    "federation_transaction_log": (
        "id", "destination", "status", "http_status", "started_ts", "duration_ms", "catchup",
        "pdu_count", "max_stream_ordering", "pdu_event_ids", "error",
    ),
    "partial_state_rooms": ("room_id",),
}
"""The columns each job reads (never ``events.json``: it is most of the table's bytes)."""

PARTITION_COLUMNS: Mapping[str, str] = {
    "events": "stream_ordering",
    "room_memberships": "event_stream_ordering",
    "federation_transaction_log": "id",
    "destination_rooms": "stream_ordering",
}
"""Big tables are read in ``--partitions`` parallel reads: ranges of these columns where
the heap cannot be split into ranges of blocks (SQLite, PostgreSQL before 14)."""

BOUNDED_BY_HIGH_WATER_MARK: Mapping[str, str] = {
    "events": "stream_ordering",
    "room_memberships": "event_stream_ordering",
}

SNAPSHOT_META = "_snapshot.json"

SCHEMA_COLUMNS: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    "native": TABLE_COLUMNS,
    "synapse": {name: read.columns for name, read in synapse_reads.READS.items()},
}
"""The frames each schema's source gives the jobs (``synapse``: Synapse's tables as
:mod:`federation_sender.storage.synapse.batch_reads` reads them)."""


@dataclass(frozen=True)
class Database:
    """Where the database is, for psycopg (``url``) and for Spark's JDBC reader."""

    url: str
    jdbc_url: str
    user: str | None
    password: str | None
    sqlite: bool = False
    """``url`` is then the database file's absolute path."""

    @classmethod
    def from_urls(cls, database_url: str, jdbc_url: str | None = None) -> Database:
        """``database_url`` is a SQLAlchemy/libpq URL (``postgresql[+psycopg]://…`` or
        ``sqlite:///path``); ``jdbc_url`` overrides the address Spark's executors use
        (``jdbc:postgresql://…``), for clusters that reach the database by another name."""
        u = make_url(database_url)
        if u.get_backend_name() == "sqlite":
            if not u.database or u.database == ":memory:":
                raise ValueError("batch jobs need an SQLite database file, not memory")
            path = Path(u.database).resolve()
            if not path.is_file():
                raise ValueError(f"no SQLite database at {path}")
            return cls(url=str(path), jdbc_url=jdbc_url or f"jdbc:sqlite:{path}", user=None,
                       password=None, sqlite=True)
        if u.get_backend_name() != "postgresql":
            raise ValueError("batch jobs need PostgreSQL or SQLite, not "
                             f"{u.get_backend_name()!r}")
        plain = u.set(drivername="postgresql")
        host = u.host or "localhost"
        port = f":{u.port}" if u.port else ""
        return cls(
            url=plain.render_as_string(hide_password=False),
            jdbc_url=jdbc_url or f"jdbc:postgresql://{host}{port}/{u.database or ''}",
            user=u.username,
            password=u.password,
        )

    def connect(self) -> psycopg.Connection[tuple[object, ...]]:
        if self.sqlite:
            raise ValueError("PostgreSQL only; use read() for either database")
        return psycopg.connect(self.url)

    @contextmanager
    def read(self) -> Iterator[Any]:
        """A DB-API connection for the driver's small reads (psycopg or sqlite3)."""
        if self.sqlite:
            conn = sqlite3.connect(f"file:{self.url}?mode=ro", uri=True)
            try:
                yield conn
            finally:
                conn.close()
        else:
            with psycopg.connect(self.url) as pg:
                yield pg

    def jdbc_options(self) -> dict[str, str]:
        if self.sqlite:
            return {"url": self.jdbc_url, "driver": SQLITE_JDBC_DRIVER}
        opts = {"url": self.jdbc_url, "driver": JDBC_DRIVER}
        if self.user:
            opts["user"] = self.user
        if self.password:
            opts["password"] = self.password
        return opts


class Source(Protocol):
    """Tables as DataFrames, bounded by one high-water mark."""

    @property
    def schema(self) -> str:
        """Whose tables: ``native`` (ours) or ``synapse`` (:data:`SCHEMA_COLUMNS`)."""
        ...

    @property
    def high_water_mark(self) -> int: ...

    def table(self, name: str) -> DataFrame: ...


class JdbcSource:
    """Reads tables over JDBC; the big ones in ``partitions`` parallel reads: ranges of
    heap blocks on PostgreSQL 14 and later (each block read once, whatever the rows'
    physical order: :func:`~federation_sender.storage.batch_reads.block_predicates`),
    else ranges of :data:`PARTITION_COLUMNS`."""

    schema = "native"

    def __init__(self, spark: SparkSession, db: Database, partitions: int) -> None:
        self._spark = spark
        self._db = db
        self._partitions = max(1, partitions)
        self._bounds: dict[str, tuple[int, int] | None] = {}
        self._blocks: dict[str, list[str]] = {}
        with db.read() as conn:
            self._hwm = batch_reads.high_water_mark(conn)
            for table, col in PARTITION_COLUMNS.items():
                blocks = None if db.sqlite else batch_reads.block_predicates(
                    conn, table, self._partitions)
                if blocks is not None:
                    self._blocks[table] = blocks
                else:
                    self._bounds[table] = batch_reads.column_bounds(conn, table, col)

    @property
    def high_water_mark(self) -> int:
        return self._hwm

    def table(self, name: str) -> DataFrame:
        opts = {**self._db.jdbc_options(), "fetchsize": "10000"}
        blocks = self._blocks.get(name)
        if blocks is not None:
            props = {k: v for k, v in opts.items() if k != "url"}
            df = self._spark.read.jdbc(self._db.jdbc_url, name, predicates=blocks,
                                       properties=props).select(*TABLE_COLUMNS[name])
            return df.filter(self._bounded(name))
        reader = self._spark.read.format("jdbc").options(**opts, dbtable=name)
        bounds = self._bounds.get(name)
        if bounds is not None and self._partitions > 1:
            lo, hi = bounds
            bound_col = BOUNDED_BY_HIGH_WATER_MARK.get(name)
            if bound_col is not None:
                hi = min(hi, self._hwm)
            reader = reader.options(
                partitionColumn=PARTITION_COLUMNS[name],
                lowerBound=str(lo),
                upperBound=str(max(hi, lo + 1)),
                numPartitions=str(self._partitions),
            )
        df = reader.load().select(*TABLE_COLUMNS[name])
        if self._db.sqlite:
            df = _sqlite_types(df, name)
        return df.filter(self._bounded(name))

    def _bounded(self, name: str) -> Column:
        """The rows of ``name`` at or below the high-water mark (every row of a table
        it does not bound)."""
        from pyspark.sql import functions as F

        bound_col = BOUNDED_BY_HIGH_WATER_MARK.get(name)
        if bound_col is None:
            return F.lit(True)
        return F.col(bound_col) <= F.lit(self._hwm)


def _sqlite_types(df: DataFrame, name: str) -> DataFrame:
    """SQLite's JDBC driver reports declared types loosely (a ``BIGINT`` as unsigned, which
    Spark reads as ``decimal(20,0)``; booleans may be integers): cast each column to the
    type of the storage schema's column, the one PostgreSQL's reads have, so every job's
    outputs (Parquet, CSV, ``--json``) carry integers, not decimals or strings."""
    from pyspark.sql import functions as F

    types = batch_reads.spark_column_types(name)
    for col, kind in df.dtypes:
        want = types.get(col)
        if want is not None and kind != want:
            df = df.withColumn(col, F.col(col).cast(want))
    return df


class SnapshotSource:
    """Reads a Parquet snapshot directory written by :func:`write_snapshot` (for cluster
    runs, from storage every executor can read: HDFS, S3, a shared file system)."""

    def __init__(self, spark: SparkSession, path: str) -> None:
        self._spark = spark
        self._path = path.rstrip("/")
        meta = json.loads(_read_text(spark, f"{self._path}/{SNAPSHOT_META}"))
        self._hwm = int(meta["high_water_mark"])
        self.schema = str(meta.get("schema", "native"))
        if self.schema not in SCHEMA_COLUMNS:
            raise ValueError(f"snapshot of an unknown schema {self.schema!r}")

    @property
    def high_water_mark(self) -> int:
        return self._hwm

    def table(self, name: str) -> DataFrame:
        return _present(self._spark.read.parquet(f"{self._path}/{name}"), name, self.schema)


class DataFrameSource:
    """Tables given as DataFrames (tests, notebooks, callers that read elsewhere)."""

    def __init__(self, tables: Mapping[str, DataFrame], high_water_mark: int,
                 schema: str = "native") -> None:
        self._tables = dict(tables)
        self._hwm = high_water_mark
        self.schema = schema

    @property
    def high_water_mark(self) -> int:
        return self._hwm

    def table(self, name: str) -> DataFrame:
        return _present(self._tables[name], name, self.schema)


OPTIONAL_COLUMNS = frozenset({"error"})
"""Read when present: snapshots written before they were read, and hand-made frames."""


def _present(df: DataFrame, name: str, schema: str = "native") -> DataFrame:
    return df.select(*[c for c in SCHEMA_COLUMNS[schema][name]
                       if c not in OPTIONAL_COLUMNS or c in df.columns])


def _read_text(spark: SparkSession, path: str) -> str:
    # Through Spark, so that hdfs:// and s3a:// snapshot locations work too.
    rows = spark.read.text(path, wholetext=True).collect()
    if not rows:
        raise FileNotFoundError(path)
    return str(rows[0][0])


def write_snapshot(spark: SparkSession, source: Source, path: str) -> dict[str, int]:
    """Write every table the jobs read as Parquet under ``path``; returns row counts."""
    path = path.rstrip("/")
    counts: dict[str, int] = {}
    for name in SCHEMA_COLUMNS[source.schema]:
        df = source.table(name)
        df.write.mode("overwrite").parquet(f"{path}/{name}")
        counts[name] = spark.read.parquet(f"{path}/{name}").count()
    meta = json.dumps({"high_water_mark": source.high_water_mark, "rows": counts,
                       "schema": source.schema})
    spark.createDataFrame([(meta,)], "value string").coalesce(1).write.mode("overwrite").text(
        f"{path}/{SNAPSHOT_META}"
    )
    return counts


@dataclass(frozen=True)
class ApplyResult:
    upserted: int
    deleted: int
    positions_lowered: int


def apply_changes(
    db: Database,
    changes: DataFrame,
    positions: DataFrame | None,
    high_water_mark: int,
    job: str,
    schema: str = "native",
) -> ApplyResult:
    """Stage ``changes`` (``destination``, ``room_id``, ``stream_ordering``, ``action``
    upsert|delete) and ``positions`` (``destination``, ``position``), then apply them in
    one transaction. See the module docstring. On Synapse's schema the staging table is
    in our schema and the apply is Synapse's rule
    (:mod:`federation_sender.storage.synapse.batch_apply`: rows only created or raised,
    positions only lowered)."""
    from pyspark.sql import functions as F

    if db.sqlite:
        return _apply_sqlite(db, changes, positions, high_water_mark)
    synapse = schema == "synapse"
    staging = f"batch_staging_{job.replace('-', '_')}_{uuid.uuid4().hex[:12]}"
    with db.connect() as conn:
        if synapse:
            synapse_apply.create_staging_table(conn, staging)
        else:
            batch_reads.create_staging_table(conn, staging)
    try:
        staged = changes.select("destination", "room_id", "stream_ordering", "action")
        if positions is not None:
            staged = staged.unionByName(
                positions.select(
                    "destination",
                    F.lit(None).cast("string").alias("room_id"),
                    F.col("position").cast("long").alias("stream_ordering"),
                    F.lit("position").alias("action"),
                )
            )
        target = synapse_apply.staging_table(staging) if synapse else staging
        staged.write.format("jdbc").options(
            **db.jdbc_options(), dbtable=target, batchsize="10000"
        ).mode("append").save()
        if synapse:
            return _apply_synapse(db, staging)
        return _apply_staged(db, staging, high_water_mark)
    finally:
        with db.connect() as conn:
            if synapse:
                synapse_apply.drop_staging_table(conn, staging)
            else:
                batch_reads.drop_staging_table(conn, staging)


def _apply_synapse(db: Database, staging: str) -> ApplyResult:
    """One transaction on Synapse's database, through the Synapse storage's statements."""

    async def run() -> BatchCounts:
        engine = create_synapse_engine(db.url, pool_size=1)
        try:
            return await run_in_transaction(
                engine, lambda conn: synapse_apply.apply_staged(conn, staging))
        finally:
            await engine.dispose()

    counts = asyncio.run(run())
    return ApplyResult(counts.upserted, counts.deleted, counts.positions_lowered)


def _through_storage(db: Database, fn: Callable[[Tx], Awaitable[BatchCounts]]) -> ApplyResult:
    """Run ``fn`` in one transaction of the native backend on ``db``: the batch jobs
    write through the same tables as the worker (:mod:`federation_sender.storage
    .batch_apply`)."""
    url = f"sqlite:///{db.url}" if db.sqlite else db.url

    async def run() -> BatchCounts:
        engine = create_engine(url, pool_size=1)
        try:
            return await NativeBackend(engine).run(fn)
        finally:
            await engine.dispose()

    counts = asyncio.run(run())
    return ApplyResult(counts.upserted, counts.deleted, counts.positions_lowered)


def _apply_staged(db: Database, staging: str, hwm: int) -> ApplyResult:
    return _through_storage(db, lambda tx: tx.destinations.apply_staged_batch(staging, hwm))


def _apply_sqlite(db: Database, changes: DataFrame, positions: DataFrame | None,
                  hwm: int) -> ApplyResult:
    """The embedded database is small: collect on the driver, apply in one transaction
    with the same statements as :func:`_apply_staged`."""
    rows = changes.select("destination", "room_id", "stream_ordering", "action").collect()
    pos = [] if positions is None else positions.select("destination", "position").collect()
    staged: list[StagedChange] = [
        (str(r[0]), r[1], None if r[2] is None else int(r[2]), str(r[3])) for r in rows
    ]
    staged += [(str(d), None, int(p), "position") for d, p in pos]
    return _through_storage(db, lambda tx: tx.destinations.apply_batch(staged, hwm))


def write_outputs(df: DataFrame, out_dir: str | Path, name: str) -> Any:
    """Write a report-sized result on the driver as ``<out>/<name>.parquet`` and
    ``<out>/<name>.csv`` (single files an operator can open; the driver's file system,
    not the executors'). Returns the pandas frame written.

    Integer columns stay integers (pandas' nullable ``Int64``; ``None`` in
    ``to_dict``): ``toPandas`` makes a column with a null a float one, which Parquet
    would store as ``double``, CSV print as ``12.0`` and ``--json`` as a float."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pdf: Any = df.toPandas()
    # Spark Connect attaches its query metrics (PlanMetrics objects) as pandas attrs,
    # which pandas then tries to store as JSON in the Parquet metadata and fails.
    pdf.attrs.clear()
    files = pdf.astype({col: _PANDAS_INTEGERS[kind] for col, kind in df.dtypes
                        if kind in _PANDAS_INTEGERS and col in pdf.columns})
    files.to_parquet(out / f"{name}.parquet", index=False)
    files.to_csv(out / f"{name}.csv", index=False)
    return files


_PANDAS_INTEGERS = {"bigint": "Int64", "int": "Int32", "smallint": "Int16", "tinyint": "Int8"}
