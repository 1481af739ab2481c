"""``batch_reads.block_predicates``: the batch jobs' parallel reads as ranges of heap
blocks, on a real PostgreSQL (the suite's cluster is 14 or later)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from federation_sender.storage import batch_reads

pytestmark = pytest.mark.postgres


@pytest.fixture
def conn(pg_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A table of 20,000 rows stored in an order unrelated to ``id`` (as a bulk load or
    a CLUSTER on another index leaves a table), about 100 blocks of heap."""
    with psycopg.connect(pg_url.replace("+psycopg", ""), autocommit=True) as c:
        c.execute("CREATE TABLE t (id bigint PRIMARY KEY, pad text NOT NULL)")
        c.execute("INSERT INTO t SELECT g, repeat('x', 20) FROM generate_series(1, 20000) g"
                  " ORDER BY md5(g::text)")
        c.execute("ANALYZE t")
        yield c


def _ids(conn: psycopg.Connection[tuple[object, ...]], predicate: str) -> list[int]:
    return [int(r[0]) for r in conn.execute(f"SELECT id FROM t WHERE {predicate}")]  # type: ignore[call-overload]


def test_ranges_read_every_row_once_rows_added_since_included(
        conn: psycopg.Connection[tuple[object, ...]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_reads, "MIN_BLOCKS_PER_RANGE", 8)
    predicates = batch_reads.block_predicates(conn, "t", 5)
    assert predicates is not None and len(predicates) == 5
    conn.execute("INSERT INTO t SELECT g, 'y' FROM generate_series(20001, 20500) g")
    parts = [_ids(conn, p) for p in predicates]
    seen = [i for part in parts for i in part]
    assert sorted(seen) == list(range(1, 20501))          # each row once, the new ones too
    assert all(part for part in parts)
    sizes = [len(part) for part in parts[:-1]]
    assert max(sizes) - min(sizes) < 0.1 * max(sizes)     # even ranges
    # Each range reads its own blocks only, whatever the order of the rows.
    plan = "\n".join(str(r[0]) for r in conn.execute(
        f"EXPLAIN SELECT id FROM t WHERE {predicates[2]} AND id <= 20500"))
    assert "Tid Range Scan" in plan, plan


def test_a_read_after_a_rewrite_fails_naming_the_table(
        conn: psycopg.Connection[tuple[object, ...]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_reads, "MIN_BLOCKS_PER_RANGE", 8)
    predicates = batch_reads.block_predicates(conn, "t", 3)
    assert predicates is not None
    conn.execute("VACUUM FULL t")   # every row gets a new ctid
    for p in predicates:
        with pytest.raises(psycopg.errors.InvalidTextRepresentation,
                           match=r"table t was rewritten .*run the job again"):
            _ids(conn, p)


def test_no_ranges_for_one_part_or_a_small_table(
        conn: psycopg.Connection[tuple[object, ...]]) -> None:
    assert batch_reads.block_predicates(conn, "t", 1) is None
    # About 100 blocks: below two ranges of MIN_BLOCKS_PER_RANGE.
    assert batch_reads.block_predicates(conn, "t", 8) is None
    conn.execute("CREATE TABLE empty_t (id bigint)")
    assert batch_reads.block_predicates(conn, "empty_t", 8) is None
    with pytest.raises(ValueError):
        batch_reads.block_predicates(conn, "t; DROP TABLE t", 4)
