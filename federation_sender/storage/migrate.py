"""Schema migrations (alembic) driven from our async engines, and the start-up check.

``upgrade`` is idempotent: on a database at head it does nothing. ``check_schema``
refuses to run against a database that was never migrated, is behind, or carries a
revision this code does not know (a newer release migrated it).

alembic (with mako and pygments under it, about 11 MB resident) is imported only when a
migration has to run or a revision has to be looked up in the scripts: the version row
is read with plain SQL and compared with :data:`HEAD`, so a worker starting on a
database already at head never loads it. ``tests/storage/test_migrations.py`` pins
:data:`HEAD` to alembic's own head.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.errors import SchemaVersionError

if TYPE_CHECKING:
    from alembic.config import Config

_MIGRATIONS = Path(__file__).resolve().parent / "migrations"
"""Shipped inside the package, so an installed wheel migrates as a checkout does."""

HEAD = "0001"
"""The newest revision in ``migrations/versions`` (a test compares it with alembic's)."""


def alembic_config() -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    # A module name may not start with a digit (check-wheel-contents W004).
    cfg.set_main_option("file_template", "r%%(rev)s_%%(slug)s")
    return cfg


def head_revision() -> str:
    """alembic's head, read from the scripts (loads alembic; :data:`HEAD` does not)."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def known_revisions() -> set[str]:
    from alembic.script import ScriptDirectory

    return {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def version_row(conn: Connection, schema: str | None = None) -> str | None:
    """The revision in alembic's version table (in ``schema``), ``None`` if the table is
    absent or empty, read without alembic."""
    if not inspect(conn).has_table("alembic_version", schema=schema):
        return None
    table = f"{schema}.alembic_version" if schema else "alembic_version"
    rows = conn.execute(text(f"SELECT version_num FROM {table}")).scalars().all()
    if len(rows) > 1:
        raise SchemaVersionError(
            f"{table} holds {len(rows)} revisions ({', '.join(sorted(rows))}); "
            "this version of federation-sender has one line of migrations")
    return rows[0] if rows else None


async def upgrade_chain(
    engine: AsyncEngine,
    config: Callable[[], Config],
    head: str,
    current: Callable[[Connection], str | None],
    revision: str = "head",
    *,
    lock_key: int | None = None,
) -> None:
    """Upgrade one alembic chain (ours, or ours beside Synapse) to ``revision``, loading
    alembic only when ``current`` is not already ``head``. ``lock_key``: a PostgreSQL
    advisory lock taken first, for the whole transaction, so that processes starting at
    once migrate one after the other (the first migrates, the others find the head)."""

    def _do(conn: Connection) -> None:
        if lock_key is not None:
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": lock_key})
        if revision in ("head", head) and current(conn) == head:
            return  # already there: no need to load alembic
        from alembic import command

        cfg = config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)

    async with engine.begin() as conn:
        await conn.run_sync(_do)


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    await upgrade_chain(engine, alembic_config, HEAD, version_row, revision)


async def downgrade(engine: AsyncEngine, revision: str) -> None:
    def _do(conn: Connection) -> None:
        from alembic import command

        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)

    async with engine.begin() as conn:
        await conn.run_sync(_do)


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(version_row)


async def check_schema(engine: AsyncEngine) -> None:
    """Raise :class:`SchemaVersionError` unless the database is exactly at head."""
    current = await current_revision(engine)
    if current == HEAD:
        return
    if current is None:
        raise SchemaVersionError(
            "database schema is not initialised; run `federation-sender migrate` first"
        )
    if current in known_revisions():
        raise SchemaVersionError(
            f"database schema is at revision {current}, this version needs {HEAD}; "
            "run `federation-sender migrate`"
        )
    raise SchemaVersionError(
        f"database schema revision {current} is newer than this version of "
        f"federation-sender knows (head {HEAD}); upgrade federation-sender"
    )
