"""Fixtures of the storage contract (``test_backend_contract*.py``).

* ``subject``: any backend (``native-sqlite``, ``native-postgresql``,
  ``synapse-postgresql`` on a schema Synapse made itself), for tests that need no
  main-process rows;
* ``seeded``: the backends with a ``MainWriter`` (native: ``HomeserverWriter``); a
  writer into Synapse's tables would add the Synapse backend here.

The Synapse schema is made once per session under its own name (the Synapse tests'
template is another session fixture; two fixtures creating one database would clash).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import pytest
from contract_support import Seeded, Subject, open_subject

from federation_sender.testing.postgres import PostgresCluster
from federation_sender.testing.synapse_install import synapse_python
from federation_sender.testing.synapse_schema import clone_database, create_synapse_schema

_clones = itertools.count()
TEMPLATE = "synapse_contract_template"


@pytest.fixture(scope="session")
def contract_synapse_template(pg_cluster: PostgresCluster) -> str:
    create_synapse_schema(pg_cluster, TEMPLATE, synapse_python())
    return TEMPLATE


def _url(kind: str, request: pytest.FixtureRequest) -> str:
    if kind == "native-sqlite":
        return str(request.getfixturevalue("sqlite_url"))
    if kind == "native-postgresql":
        return str(request.getfixturevalue("pg_url"))
    cluster: PostgresCluster = request.getfixturevalue("pg_cluster")
    template = str(request.getfixturevalue("contract_synapse_template"))
    return clone_database(cluster, template, f"contract{next(_clones)}")


@pytest.fixture(params=["native-sqlite", "native-postgresql", "synapse-postgresql"])
async def subject(request: pytest.FixtureRequest) -> AsyncIterator[Subject]:
    """Any backend (the test needs no main-process rows)."""
    async with open_subject(request.param, _url(request.param, request)) as s:
        yield s


@pytest.fixture(params=["native-sqlite", "native-postgresql"])
async def seeded(request: pytest.FixtureRequest) -> AsyncIterator[Seeded]:
    """A backend with a writer of the main process's rows."""
    async with open_subject(request.param, _url(request.param, request)) as s:
        assert isinstance(s, Seeded)
        yield s
