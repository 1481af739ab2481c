from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import sys
from pathlib import Path

import pytest
from sqlalchemy import insert, select, text

from federation_sender.errors import SchemaVersionError
from federation_sender.storage import schema
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import (
    HEAD,
    check_schema,
    current_revision,
    downgrade,
    head_revision,
    upgrade,
)

RELEASED_R0001 = Path(__file__).with_name("r0001_native_sqlite.sql")


async def test_upgrade_is_idempotent_and_check_passes(db_url: str) -> None:
    eng = create_engine(db_url)
    try:
        with pytest.raises(SchemaVersionError, match="not initialised"):
            await check_schema(eng)
        await upgrade(eng)
        await upgrade(eng)
        assert await current_revision(eng) == head_revision()
        await check_schema(eng)
        async with eng.begin() as conn:
            await conn.execute(
                insert(schema.destinations).values(destination="a.example", retry_interval=0)
            )
            rows = (await conn.execute(select(schema.destinations.c.destination))).all()
        assert [r[0] for r in rows] == ["a.example"]
    finally:
        await eng.dispose()


async def test_downgrade_of_first_revision_drops_everything(db_url: str) -> None:
    eng = create_engine(db_url)
    try:
        await upgrade(eng)
        await downgrade(eng, "base")
        assert await current_revision(eng) is None
        async with eng.connect() as conn:
            if eng.dialect.name == "sqlite":
                q = "SELECT name FROM sqlite_master WHERE type='table' AND name='events'"
            else:
                q = "SELECT tablename FROM pg_tables WHERE tablename='events'"
            assert (await conn.execute(text(q))).first() is None
        await upgrade(eng)
        await check_schema(eng)
    finally:
        await eng.dispose()


@pytest.mark.parametrize(("tamper", "refusal"), [
    ("UPDATE alembic_version SET version_num='9999_future'", "newer"),
    ("INSERT INTO alembic_version VALUES ('0002_branch')", "2 revisions"),
], ids=["newer", "two heads"])
async def test_an_unknown_version_row_is_refused(db_url: str, tamper: str, refusal: str
                                                 ) -> None:
    eng = create_engine(db_url)
    try:
        await upgrade(eng)
        async with eng.begin() as conn:
            await conn.execute(text(tamper))
        with pytest.raises(SchemaVersionError, match=refusal):
            await check_schema(eng)
    finally:
        await eng.dispose()


async def test_schema_matches_metadata(db_url: str) -> None:
    """The migrations produce exactly what schema.py describes (no drift)."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    eng = create_engine(db_url)
    try:
        await upgrade(eng)

        def _diff(conn: object) -> list[object]:
            ctx = MigrationContext.configure(conn)  # type: ignore[arg-type]
            return list(compare_metadata(ctx, schema.metadata))

        async with eng.connect() as conn:
            diff = await conn.run_sync(_diff)
        assert diff == []
    finally:
        await eng.dispose()


def test_head_constant_is_alembics_head() -> None:
    """``HEAD`` lets a start at head skip alembic: it must name the newest script."""
    assert head_revision() == HEAD


async def test_a_start_at_head_never_loads_alembic(sqlite_url: str) -> None:
    """The worker's start-up path (upgrade, then check) on a database at head reads the
    version row itself: alembic, mako and pygments stay unloaded (about 11 MB)."""
    eng = create_engine(sqlite_url)
    try:
        await upgrade(eng)
    finally:
        await eng.dispose()
    script = (
        "import asyncio, sys\n"
        "from federation_sender.storage.engine import create_engine\n"
        "from federation_sender.storage.migrate import check_schema, upgrade\n"
        "import federation_sender.app, federation_sender.cli\n"
        "async def main():\n"
        f"    eng = create_engine({sqlite_url!r})\n"
        "    await upgrade(eng)\n"
        "    await check_schema(eng)\n"
        "    await eng.dispose()\n"
        "asyncio.run(main())\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'alembic', 'mako'}))\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0
    assert out.decode().strip() == "[]"


def _schema_sql(path: Path) -> list[str]:
    """Every table's and index's DDL as SQLite stored it, in name order (the order of
    creation is not part of the schema)."""
    with contextlib.closing(sqlite3.connect(path)) as c, c:
        return sorted(r[0] for r in c.execute(
            "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL ORDER BY name"
        ))


async def test_a_database_made_by_the_first_revision_as_released_upgrades_to_head(
    tmp_path: Path,
) -> None:
    """Revision 0001's DDL is frozen (part of it is shared with the Synapse-side chain,
    ``storage/shared_tables_ddl.py``): it still makes exactly the schema it made when
    released (``r0001_native_sqlite.sql``), and a database holding that schema is
    upgraded to head and passes the start-up check."""
    released = tmp_path / "released.db"
    with contextlib.closing(sqlite3.connect(released)) as c, c:
        c.executescript(RELEASED_R0001.read_text())
    fresh = tmp_path / "fresh.db"
    eng = create_engine(f"sqlite:///{fresh}")
    try:
        await upgrade(eng, "0001")
    finally:
        await eng.dispose()
    assert _schema_sql(fresh) == _schema_sql(released)
    eng = create_engine(f"sqlite:///{released}")
    try:
        await upgrade(eng)
        assert await current_revision(eng) == head_revision()
        await check_schema(eng)
    finally:
        await eng.dispose()
