"""The batch jobs' SQL on Spark's driver: the high-water mark, how the big tables are
split into parallel reads (ranges of a column, or of heap blocks), and the lifecycle of
the UNLOGGED staging table the executors fill over JDBC.

Plain DB-API (a psycopg or sqlite3 connection, synchronous as the driver is), not the
worker's engine: the jobs read over JDBC and need only these few statements here. The
staging table's columns are :data:`~federation_sender.storage.batch_apply
.STAGING_COLUMNS`, the ones the apply statements read. Table and column names are
checked identifiers, never caller text spliced into SQL.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any, Protocol

import sqlalchemy as sa

from federation_sender.storage import schema
from federation_sender.storage.batch_apply import STAGING_COLUMNS, checked_identifier


class DriverConnection(Protocol):
    """What the driver's reads need of a DB-API connection (psycopg's and sqlite3's
    both have ``execute`` on the connection)."""

    def execute(self, query: Any, /) -> Any: ...


def high_water_mark(conn: DriverConnection) -> int:
    """The highest ``events.stream_ordering`` (0 on an empty table)."""
    row = conn.execute("SELECT max(stream_ordering) FROM events").fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def column_bounds(conn: DriverConnection, table: str, column: str) -> tuple[int, int] | None:
    """``(min, max)`` of ``table.column``, ``None`` when the table is empty."""
    t, c = checked_identifier(table), checked_identifier(column)
    row = conn.execute(f"SELECT min({c}), max({c}) FROM {t}").fetchone()
    if row is None or row[0] is None:
        return None
    return int(row[0]), int(row[1])


BLOCK_RANGES_SINCE = 140000
"""``server_version_num`` from which PostgreSQL reads a ``ctid`` range with a TID range
scan (14); an older server would scan the whole table for each range."""

MIN_BLOCKS_PER_RANGE = 128
"""A range of blocks is at least 1 MB of heap: a small table is read in fewer ranges."""


def block_predicates(conn: DriverConnection, table: str, parts: int) -> list[str] | None:
    """WHERE clauses that split ``table``'s heap into up to ``parts`` disjoint ranges of
    blocks (``ctid``), for parallel reads that together read each block once.

    A range of a column is read with a sequential scan of the whole table when the
    column does not follow the rows' physical order (the planner will not fetch a
    scattered tenth of a table through an index), so N ranges read the table N times;
    a range of blocks is a TID range scan of its own blocks whatever the order. The
    last range is open, so rows in blocks added since are read too. Each clause fails
    its read, naming the table, if the table was rewritten since these ranges were cut
    (``VACUUM FULL``, ``CLUSTER`` and pg_repack give every row a new ``ctid``: a read
    across the rewrite would miss rows or read some twice). None on PostgreSQL before
    14, or with ``parts`` < 2, or for a table with no blocks.
    """
    t = checked_identifier(table)
    row = conn.execute(
        "SELECT current_setting('server_version_num')::int,"
        f" pg_relation_size('{t}') / current_setting('block_size')::int,"
        f" pg_relation_filenode('{t}')"
    ).fetchone()
    version, blocks, filenode = int(row[0]), int(row[1]), row[2]
    parts = min(parts, blocks // MIN_BLOCKS_PER_RANGE)
    if version < BLOCK_RANGES_SINCE or parts < 2 or filenode is None:
        return None
    guard = (
        f"((SELECT pg_relation_filenode('{t}')) = {int(filenode)} OR "
        f"('table {t} was rewritten (VACUUM FULL, CLUSTER or pg_repack) while the job "
        "read it: run the job again; filenode ' "
        f"|| pg_relation_filenode('{t}'))::int = 0)"
    )
    cuts = [blocks * i // parts for i in range(1, parts)]
    bounds = [f"ctid < '({cuts[0]},0)'::tid"]
    bounds += [f"ctid >= '({a},0)'::tid AND ctid < '({b},0)'::tid"
               for a, b in pairwise(cuts)]
    bounds.append(f"ctid >= '({cuts[-1]},0)'::tid")
    return [f"{b} AND {guard}" for b in bounds]


def estimated_rows(conn: DriverConnection, tables: list[str], *, sqlite: bool) -> int:
    """The rows of ``tables`` together, cheaply, for sizing a run before Spark starts:
    PostgreSQL's planner estimates (``pg_class.reltuples``, kept by ANALYZE and
    autovacuum; an exact count for a table never analyzed), SQLite's ``count(*)``. A
    table that does not exist counts 0."""
    total = 0
    for table in tables:
        name = ".".join(checked_identifier(part) for part in table.split("."))
        if sqlite:
            if "." in name:
                continue
            found = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                                 f"name = '{name}'").fetchone()
            row = conn.execute(f"SELECT count(*) FROM {name}").fetchone() if found else None
        else:
            row = conn.execute(f"SELECT reltuples::bigint FROM pg_class "
                               f"WHERE oid = to_regclass('{name}')").fetchone()
            if row is not None and int(row[0]) < 0:  # never analyzed
                row = conn.execute(f"SELECT count(*) FROM {name}").fetchone()
        total += int(row[0]) if row else 0
    return total


def create_staging_table(conn: DriverConnection, name: str) -> None:
    """An UNLOGGED table (PostgreSQL) the executors append a job's result to."""
    conn.execute(f"CREATE UNLOGGED TABLE {checked_identifier(name)} {STAGING_COLUMNS}")


def drop_staging_table(conn: DriverConnection, name: str) -> None:
    conn.execute(f"DROP TABLE IF EXISTS {checked_identifier(name)}")


def _spark_type(column: sa.Column[Any]) -> str | None:
    kind = column.type
    if isinstance(kind, sa.Boolean):
        return "boolean"
    if isinstance(kind, sa.BigInteger):
        return "bigint"
    if isinstance(kind, sa.SmallInteger):
        return "smallint"
    if isinstance(kind, sa.Integer):
        return "int"
    if isinstance(kind, sa.String):  # Text too
        return "string"
    return None


def spark_column_types(table: str) -> dict[str, str]:
    """The Spark SQL type PostgreSQL's JDBC reads give each column of one of our tables
    (the schema of :mod:`federation_sender.storage.schema`), for the columns of types the
    jobs read: what a read from SQLite, whose JDBC driver reports declared types loosely,
    is cast to."""
    columns = schema.metadata.tables[table].c
    return {c.name: t for c in columns if (t := _spark_type(c)) is not None}
