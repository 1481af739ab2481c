"""Fixtures of the Synapse backend tests (test_backend_*.py): a Synapse schema made by
Synapse itself, cloned per test. Import the ``*_fixture`` functions into a test module;
the fixtures are named without the suffix."""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.synapse.database import create_synapse_engine
from federation_sender.testing.postgres import PostgresCluster
from federation_sender.testing.synapse_schema import clone_database, create_synapse_schema

_counter = itertools.count()


def synapse_python() -> Path:
    try:
        from federation_sender.testing.synapse_install import synapse_python as find
    except ImportError:
        override = os.environ.get("FEDERATION_SENDER_SYNAPSE_PYTHON")
        if override:
            return Path(override)
        python = Path.home() / ".cache/federation-sender/synapse-1.163.2/bin/python"
        if not (python.parent.parent / ".installed").exists():
            pytest.skip("Synapse 1.163.2 is not installed in the cache")
        return python
    return find()


@pytest.fixture(scope="session", name="synapse_template")
def synapse_template_fixture(pg_cluster: PostgresCluster) -> str:
    """Name of a database holding Synapse's empty schema (made once per session)."""
    create_synapse_schema(pg_cluster, "synapse_template", synapse_python())
    return "synapse_template"


@pytest.fixture(name="synapse_db_url")
def synapse_db_url_fixture(pg_cluster: PostgresCluster, synapse_template: str) -> str:
    return clone_database(pg_cluster, synapse_template, f"syn{next(_counter)}")


@pytest.fixture(name="synapse_engine")
async def synapse_engine_fixture(synapse_db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = create_synapse_engine(synapse_db_url)
    yield eng
    await eng.dispose()
