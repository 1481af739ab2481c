"""The jobs' source on a Synapse deployment: Synapse's tables (and our transaction log
beside them) read over JDBC as the frames of :mod:`federation_sender.storage.synapse
.batch_reads`, which names the tables, columns, queries and splits; this module only
turns them into Spark reads.

At open, on the driver: the database must be a Synapse database of a schema version the
worker supports (:func:`federation_sender.storage.synapse.database.check_synapse`, one
line otherwise), the high-water mark is fixed, and each split read gets its bounds or
room-id ranges. Without our schema (only Synapse's own sender has run) the transaction
log is an empty frame: nothing is then vouched for by the log, and the audit trusts
the positions.

Consistency: ``events`` is bounded by the high-water mark as on our own schema; the
current state and ``destination_rooms`` are read as they are when each executor task
runs (the worker and Synapse keep writing), which can only make a pair look newer than
the events the job sees, never older: a newer row counts as at or past the event.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from federation_sender.batch.io import Database
from federation_sender.storage import batch_reads
from federation_sender.storage.synapse import batch_reads as syn
from federation_sender.storage.synapse.database import check_synapse, create_synapse_engine

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SCHEMA = "synapse"


def check_database(db: Database) -> None:
    """Refuse (:class:`~federation_sender.errors.SchemaVersionError`, one line) a
    database that is not Synapse's or whose schema version we were not tested on."""

    async def check() -> None:
        engine = create_synapse_engine(db.url, pool_size=1)
        try:
            await check_synapse(engine)
        finally:
            await engine.dispose()

    asyncio.run(check())


class SynapseJdbcSource:
    """Implements :class:`federation_sender.batch.io.Source` on Synapse's schema."""

    schema = SCHEMA

    def __init__(self, spark: SparkSession, db: Database, partitions: int) -> None:
        if db.sqlite:
            raise ValueError("a Synapse deployment's database is PostgreSQL")
        check_database(db)
        self._spark = spark
        self._db = db
        self._partitions = max(1, partitions)
        self._bounds: dict[str, tuple[int, int] | None] = {}
        self._rooms: list[str] = []
        with db.read() as conn:
            self._hwm = batch_reads.high_water_mark(conn)
            self.own_schema = syn.has_own_schema(conn)
            for name, read in syn.READS.items():
                if isinstance(read.split, syn.RangeSplit) and self._readable(name):
                    self._bounds[name] = syn.range_bounds(conn, read.split)
            self._rooms = syn.room_predicates(conn, self._partitions)

    def _readable(self, name: str) -> bool:
        return self.own_schema or name != "federation_transaction_log"

    @property
    def high_water_mark(self) -> int:
        return self._hwm

    def table(self, name: str) -> DataFrame:
        from pyspark.sql import functions as F

        read = syn.READS[name]
        if not self._readable(name):
            return self._spark.createDataFrame([], syn.TXN_LOG_DDL)
        opts = {**self._db.jdbc_options(), "fetchsize": "10000"}
        if isinstance(read.split, syn.RoomSplit) and self._rooms:
            props = {k: v for k, v in opts.items() if k != "url"}
            df = self._spark.read.jdbc(self._db.jdbc_url, syn.subquery(name),
                                       predicates=self._rooms, properties=props)
        else:
            reader = self._spark.read.format("jdbc").options(**opts, dbtable=syn.subquery(name))
            split = read.split
            bounds = self._bounds.get(name)
            if isinstance(split, syn.RangeSplit) and bounds is not None and self._partitions > 1:
                lo, hi = bounds
                if split.bounded_by_high_water_mark:
                    hi = min(hi, self._hwm)
                reader = reader.options(partitionColumn=split.column, lowerBound=str(lo),
                                        upperBound=str(max(hi, lo + 1)),
                                        numPartitions=str(self._partitions))
            df = reader.load()
        df = df.select(*read.columns)
        split = read.split
        if isinstance(split, syn.RangeSplit) and split.bounded_by_high_water_mark:
            df = df.filter(F.col(split.column) <= F.lit(self._hwm))
        return df
