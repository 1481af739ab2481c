"""The batch jobs' SQL on Spark's driver: the high-water mark, the range of a partition
column, and the lifecycle of the UNLOGGED staging table the executors fill over JDBC.

Plain DB-API (a psycopg or sqlite3 connection, synchronous as the driver is), not the
worker's engine: the jobs read over JDBC and need only these few statements here. The
staging table's columns are :data:`~federation_sender.storage.batch_apply
.STAGING_COLUMNS`, the ones the apply statements read. Table and column names are
checked identifiers, never caller text spliced into SQL.
"""

from __future__ import annotations

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
