"""Schema migrations (alembic) driven from our async engines, and the start-up check.

``upgrade`` is idempotent: on a database at head it does nothing. ``check_schema``
refuses to run against a database that was never migrated, is behind, or carries a
revision this code does not know (a newer release migrated it).
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.errors import SchemaVersionError

_ROOT = Path(__file__).resolve().parents[2]


def alembic_config() -> Config:
    cfg = Config(str(_ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(_ROOT / "migrations"))
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def known_revisions() -> set[str]:
    return {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    def _do(conn: Connection) -> None:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)

    async with engine.begin() as conn:
        await conn.run_sync(_do)


async def downgrade(engine: AsyncEngine, revision: str) -> None:
    def _do(conn: Connection) -> None:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)

    async with engine.begin() as conn:
        await conn.run_sync(_do)


async def current_revision(engine: AsyncEngine) -> str | None:
    def _do(conn: Connection) -> str | None:
        return MigrationContext.configure(conn).get_current_revision()

    async with engine.connect() as conn:
        return await conn.run_sync(_do)


async def check_schema(engine: AsyncEngine) -> None:
    """Raise :class:`SchemaVersionError` unless the database is exactly at head."""
    current = await current_revision(engine)
    head = head_revision()
    if current is None:
        raise SchemaVersionError(
            "database schema is not initialised; run `federation-sender migrate` first"
        )
    if current == head:
        return
    if current in known_revisions():
        raise SchemaVersionError(
            f"database schema is at revision {current}, this version needs {head}; "
            "run `federation-sender migrate`"
        )
    raise SchemaVersionError(
        f"database schema revision {current} is newer than this version of "
        f"federation-sender knows (head {head}); upgrade federation-sender"
    )
