"""The Synapse source's checks at open, on real databases: a bare Synapse schema (made by
Synapse itself; our schema never migrated: only Synapse's own sender has run) reads with
an empty transaction log, and a database that is not Synapse's is refused in one line;
the big reads' partitions are even and, together, every row once."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from bench.synapse_scale import derive, generate
from federation_sender.batch import synapse_transforms as st
from federation_sender.batch.io import Database
from federation_sender.batch.synapse_source import SynapseJdbcSource
from federation_sender.errors import SchemaVersionError
from federation_sender.storage.synapse.batch_reads import READS
from federation_sender.storage.synapse.database import create_synapse_engine, upgrade_own_schema
from tests.synapse.backend_support import synapse_db_url_fixture, synapse_template_fixture

__all__ = ["synapse_db_url_fixture", "synapse_template_fixture"]

pytestmark = [pytest.mark.spark, pytest.mark.postgres]


def test_a_synapse_database_without_our_schema_reads_an_empty_log(
        spark: Any, synapse_db_url: str) -> None:
    src = SynapseJdbcSource(spark, Database.from_urls(synapse_db_url), 2)
    assert (src.schema, src.own_schema, src.high_water_mark) == ("synapse", False, 0)
    log = src.table("federation_transaction_log")
    assert tuple(log.columns) == READS["federation_transaction_log"].columns
    tables = {name: src.table(name) for name in READS}
    assert st.audit_findings(tables, "example.org", 0).count() == 0


def test_a_database_that_is_not_synapses_is_refused(spark: Any, batch_db: str) -> None:
    with pytest.raises(SchemaVersionError, match="not a Synapse database"):
        SynapseJdbcSource(spark, Database.from_urls(batch_db), 2)


async def _migrate(url: str) -> None:
    engine = create_synapse_engine(url)
    try:
        await upgrade_own_schema(engine)
    finally:
        await engine.dispose()


KEYS = {"events": ("stream_ordering", "event_id"),
        "current_members": ("room_id", "user_id", "stream_ordering"),
        "destination_rooms": ("destination", "room_id", "stream_ordering")}


def test_the_big_reads_split_into_even_partitions_of_every_row_once(
        spark: Any, synapse_db_url: str) -> None:
    """On the scale benchmark's generator (2,000 rows: 60 rooms, from DMs to rooms of
    all 120 servers), ``--partitions 4`` gives each big read 4 partitions of similar
    size, and together they are the read's query: no row lost or read twice.

    ``destination_rooms`` was split by ``stream_ordering`` ranges: a row is its room's
    newest event, so the rows crowd the top of the stream (here 162-1,285 rows per
    range); ``room_id`` ranges at quantiles of ``rooms`` hold 424-577."""
    asyncio.run(_migrate(synapse_db_url))
    generate(synapse_db_url, derive(2_000, seed=7, destinations=120, rooms=60),
             log=lambda _line: None)
    src = SynapseJdbcSource(spark, Database.from_urls(synapse_db_url), 4)
    for name, keys in KEYS.items():
        bound = f" WHERE stream_ordering <= {src.high_water_mark}" if name == "events" else ""
        with psycopg.connect(synapse_db_url) as conn:
            want = conn.execute(
                f"SELECT {', '.join(keys)} FROM ({READS[name].sql}) AS t{bound}").fetchall()
        df = src.table(name).select(*keys)
        assert df.rdd.getNumPartitions() == 4, name
        parts = df.rdd.glom().map(lambda rows: [tuple(r) for r in rows]).collect()
        sizes = sorted(len(p) for p in parts)
        assert sorted(r for p in parts for r in p) == sorted(want), name  # each row once
        assert sizes[-1] <= 2 * sizes[0], (name, sizes)
