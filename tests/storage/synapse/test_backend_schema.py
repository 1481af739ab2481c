"""Our schema beside Synapse's: migrate never touches a Synapse table, and the start-up
check refuses databases we do not support with one line."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.cli import main
from federation_sender.errors import SchemaVersionError
from federation_sender.storage.engine import create_engine
from federation_sender.storage.synapse.database import (
    OWN_HEAD,
    OWN_SCHEMA,
    check_own_schema,
    check_synapse,
    create_synapse_engine,
    own_head,
    own_revision,
    upgrade_own_schema,
)
from tests.synapse.backend_support import (  # noqa: F401
    synapse_db_url_fixture,
    synapse_engine_fixture,
    synapse_template_fixture,
)

pytestmark = pytest.mark.postgres

_COLUMNS = text(
    "SELECT table_schema, table_name, column_name, data_type, is_nullable, "
    "column_default FROM information_schema.columns "
    "WHERE table_schema NOT IN ('pg_catalog', 'information_schema', :own) "
    "ORDER BY 1, 2, 3"
)
_INDEXES = text(
    "SELECT schemaname, tablename, indexname, indexdef FROM pg_indexes "
    "WHERE schemaname NOT IN ('pg_catalog', :own) ORDER BY 1, 2, 3"
)


async def _synapse_shape(engine: AsyncEngine) -> tuple[list[tuple[object, ...]], ...]:
    async with engine.connect() as conn:
        cols = [tuple(r) for r in await conn.execute(_COLUMNS, {"own": OWN_SCHEMA})]
        idx = [tuple(r) for r in await conn.execute(_INDEXES, {"own": OWN_SCHEMA})]
    return cols, idx


async def test_migrate_creates_only_our_schema(synapse_engine: AsyncEngine) -> None:
    before = await _synapse_shape(synapse_engine)
    assert len(before[0]) > 500  # Synapse's schema is there
    with pytest.raises(SchemaVersionError, match="not initialised"):
        await check_own_schema(synapse_engine)
    await upgrade_own_schema(synapse_engine)
    await upgrade_own_schema(synapse_engine)  # idempotent
    assert await own_revision(synapse_engine) == own_head()
    await check_own_schema(synapse_engine)
    assert await _synapse_shape(synapse_engine) == before
    async with synapse_engine.connect() as conn:
        ours = set(
            (
                await conn.execute(
                    text("SELECT table_name FROM information_schema.tables WHERE table_schema=:s"),
                    {"s": OWN_SCHEMA},
                )
            ).scalars()
        )
        assert ours == {
            "alembic_version",
            "federation_transaction_log",
            "federation_sender_instances",
            "destination_leases",
            "replication_positions",
        }
        # Unqualified names: ours first, Synapse's for everything else.
        where = text(
            "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.oid = CAST(:t AS regclass)"
        )
        assert (await conn.execute(where, {"t": "replication_positions"})).scalar() == OWN_SCHEMA
        assert (await conn.execute(where, {"t": "stream_positions"})).scalar() == "public"
        assert (await conn.execute(where, {"t": "destinations"})).scalar() == "public"
        assert (await conn.execute(where, {"t": "federation_stream_position"})).scalar() == (
            "public"
        )


async def test_senders_starting_at_once_migrate_once(synapse_db_url: str) -> None:
    """Several senders (``federation_sender_instances``) started together each migrate
    at start; before the advisory lock all but one failed in ``CREATE SCHEMA IF NOT
    EXISTS`` with a unique violation (seen with fed1 and fed2 started at once)."""
    engines = [create_synapse_engine(synapse_db_url) for _ in range(3)]
    try:
        await asyncio.gather(*(upgrade_own_schema(e) for e in engines))
        assert await own_revision(engines[0]) == own_head()
    finally:
        for e in engines:
            await e.dispose()


TESTED = (
    "is not one this federation sender was tested against (schema 94, compat version at "
    "most 94: Synapse 1.158.0 to 1.163.2)"
)


async def test_synapse_version_check(synapse_engine: AsyncEngine) -> None:
    """Exactly the tested range: schema 94 with a compat version up to 94. A newer
    schema is refused even when its compat version would let a 1.163 worker run on it
    (Synapse's own rule): nothing of ours has been tested against it."""
    assert await check_synapse(synapse_engine) == (94, 84)

    async def refused(version: int, compat: int) -> str:
        async with synapse_engine.begin() as conn:
            await conn.execute(text(f"UPDATE schema_compat_version SET compat_version = {compat}"))
            await conn.execute(text(f"UPDATE schema_version SET version = {version}"))
        with pytest.raises(SchemaVersionError) as e:
            await upgrade_own_schema(synapse_engine)
        message = str(e.value)
        assert "\n" not in message
        return message

    assert await refused(94, 95) == (
        f"Synapse database schema 94 (compat version 95) {TESTED}; upgrade "
        "federation-sender or run Synapse's own federation sender"
    )
    assert await refused(95, 84) == (
        f"Synapse database schema 95 (compat version 84) {TESTED}; upgrade "
        "federation-sender or run Synapse's own federation sender"
    )
    assert await refused(93, 84) == (
        f"Synapse database schema 93 (compat version 84) {TESTED}; upgrade Synapse"
    )
    async with synapse_engine.connect() as conn:
        assert not (
            await conn.execute(
                text("SELECT count(*) FROM pg_namespace WHERE nspname = :s"), {"s": OWN_SCHEMA}
            )
        ).scalar()


async def test_not_a_synapse_database(pg_url: str) -> None:
    engine = create_engine(pg_url)
    try:
        with pytest.raises(SchemaVersionError, match="not a Synapse database"):
            await check_synapse(engine)
    finally:
        await engine.dispose()


@pytest.mark.parametrize("restricted", [False, True])
def test_cli_migrate_with_synapse_config(
    synapse_db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], restricted: bool
) -> None:
    """``restricted``: homeserver.yaml sends outbound federation through fed1's proxy;
    migrate, run without the worker file, must not ask which instance it is (#42.6)."""
    u = make_url(synapse_db_url)
    hs = {
        "server_name": "example.org",
        "signing_key_path": str(tmp_path / "signing.key"),
        "database": {
            "name": "psycopg2",
            "args": {"user": u.username, "host": u.host, "port": u.port, "dbname": u.database},
        },
        "redis": {"enabled": True},
        "federation_sender_instances": ["fed1"],
    }
    if restricted:
        hs |= {"outbound_federation_restricted_to": ["fed1"],
               "worker_replication_secret": "s3cret",
               "instance_map": {"main": {"host": "127.0.0.1", "port": 1},
                                "fed1": {"host": "127.0.0.1", "port": 2}}}
    (tmp_path / "hs.yaml").write_text(json.dumps(hs))
    # The documented command's file names no instance when the deployment restricts
    # outbound federation (the worker file would).
    (tmp_path / "ours.yaml").write_text("{}\n" if restricted else "instance_name: fed1\n")
    ours, hs_file = str(tmp_path / "ours.yaml"), str(tmp_path / "hs.yaml")
    argv = ["migrate", "-c", ours, "--synapse-config", hs_file]
    assert main(argv) == 0
    assert "schema federation_sender migrated from empty to" in capsys.readouterr().out
    assert main(argv) == 0
    assert "already at revision" in capsys.readouterr().out


def test_cli_worker_refuses_with_one_line(
    synapse_db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing Synapse file is a configuration error (2); a Synapse schema we do not
    support stops the worker before it writes anything (3). One line each."""
    assert main(["worker", "--synapse-config", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--synapse-config" in err
    u = make_url(synapse_db_url)
    hs = {
        "server_name": "example.org",
        "signing_key_path": str(tmp_path / "signing.key"),
        "database": {
            "name": "psycopg2",
            "args": {"user": u.username, "host": u.host, "port": u.port, "dbname": u.database},
        },
        "redis": {"enabled": True, "port": 1},
        "federation_sender_instances": ["fed1"],
        "worker_name": "fed1",
    }
    (tmp_path / "hs.yaml").write_text(json.dumps(hs))
    (tmp_path / "ours.yaml").write_text(
        json.dumps({"data_dir": str(tmp_path), "database": {"connect_attempts": 1}})
    )
    subprocess.run(
        ["psql", synapse_db_url, "-c", "UPDATE schema_compat_version SET compat_version = 95"],
        check=True, capture_output=True,
    )
    argv = [
        "worker", "-c", str(tmp_path / "ours.yaml"),
        "--synapse-config", str(tmp_path / "hs.yaml"),
    ]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"federation-sender: Synapse database schema 94 (compat version 95) {TESTED}; "
        "upgrade federation-sender or run Synapse's own federation sender"
    )


def test_own_head_constant_is_alembics_head() -> None:
    """A start at head skips alembic by comparing with ``OWN_HEAD``: it must name the
    newest script of our schema beside Synapse's."""
    assert own_head() == OWN_HEAD


def _shape(sync_conn: Connection, schema: str | None, tables: Sequence[str]) -> Any:
    """Columns, primary key and indexes of ``tables``; a sequence's name in a default
    without its schema."""
    i = inspect(sync_conn)
    unqualified = f'"{schema}".'
    return {t: (
        [(c["name"], str(c["type"]), c["nullable"],
          None if c.get("default") is None else str(c["default"]).replace(unqualified, ""))
         for c in i.get_columns(t, schema=schema)],
        i.get_pk_constraint(t, schema=schema),
        sorted((x["name"], x["column_names"], x["unique"])
               for x in i.get_indexes(t, schema=schema)),
    ) for t in tables}


async def test_the_tables_both_chains_create_are_the_same(
    synapse_engine: AsyncEngine, pg_engine: AsyncEngine
) -> None:
    """The transaction log and the sharding tables are one declaration
    (``storage/shared_tables_ddl.py``) that both first revisions use: beside Synapse
    (schema ``federation_sender``) they are what the native chain makes."""
    shared = ("federation_transaction_log", "federation_sender_instances",
              "destination_leases")
    await upgrade_own_schema(synapse_engine)
    async with synapse_engine.connect() as conn:
        beside_synapse = await conn.run_sync(_shape, OWN_SCHEMA, shared)
    async with pg_engine.connect() as conn:
        native = await conn.run_sync(_shape, None, shared)
    assert beside_synapse == native
    assert native["federation_transaction_log"][2] == [
        ("ix_federation_transaction_log_dest_started", ["destination", "started_ts"], False)
    ]
