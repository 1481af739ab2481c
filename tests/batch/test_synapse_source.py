"""The Synapse source's checks at open, on real databases: a bare Synapse schema (made by
Synapse itself; our schema never migrated: only Synapse's own sender has run) reads with
an empty transaction log, and a database that is not Synapse's is refused in one line."""

from __future__ import annotations

from typing import Any

import pytest

from federation_sender.batch import synapse_transforms as st
from federation_sender.batch.io import Database
from federation_sender.batch.synapse_source import SynapseJdbcSource
from federation_sender.errors import SchemaVersionError
from federation_sender.storage.synapse.batch_reads import READS
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
