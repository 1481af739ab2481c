from __future__ import annotations

import pytest
from sqlalchemy import insert, select, text

from federation_sender.errors import SchemaVersionError
from federation_sender.storage import schema
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import (
    check_schema,
    current_revision,
    downgrade,
    head_revision,
    upgrade,
)


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


async def test_newer_schema_is_refused(db_url: str) -> None:
    eng = create_engine(db_url)
    try:
        await upgrade(eng)
        async with eng.begin() as conn:
            await conn.execute(text("UPDATE alembic_version SET version_num='9999_future'"))
        with pytest.raises(SchemaVersionError, match="newer"):
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
