"""Connections to Synapse's database, and our own schema beside Synapse's.

Our tables (transaction log, sharding, replication positions) live in the PostgreSQL
schema ``federation_sender``, created and migrated by alembic with its version table
in that schema too. Every connection of ours puts that schema first on its
``search_path`` (before whatever the deployment's path is), so the package's queries on
``federation_transaction_log`` find ours, and every other name resolves to Synapse's
tables exactly as Synapse's own connections see them (none of our names is also a
Synapse table's).
``migrate`` therefore never creates or alters a Synapse table; a test compares every
Synapse table and column before and after.

Start-up order: Synapse's schema version is checked first (a database that is not
Synapse's, or a version we do not support, is refused with one line), then our own
schema is migrated or checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.errors import SchemaVersionError
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade_chain, version_row
from federation_sender.storage.synapse.schema import check_synapse_schema

if TYPE_CHECKING:
    from alembic.config import Config

OWN_SCHEMA = "federation_sender"
_MIGRATIONS = Path(__file__).resolve().parent / "migrations"

OWN_HEAD = "s0001"
"""The newest revision of our schema beside Synapse's: a start at head reads the version
row with plain SQL and never loads alembic (see :mod:`federation_sender.storage.migrate`);
a test compares it with alembic's head."""

MIGRATE_LOCK_KEY = 0x66656453656E6472
"""The PostgreSQL advisory lock ``migrate`` holds for its transaction (``fedSendr``)."""


def create_synapse_engine(url: str, *, pool_size: int = 10) -> AsyncEngine:
    """An engine on Synapse's database whose connections see our schema first."""
    engine = create_engine(url, pool_size=pool_size)
    if engine.url.get_backend_name() != "postgresql":
        raise SchemaVersionError("a Synapse deployment needs a PostgreSQL database")

    @event.listens_for(engine.sync_engine, "connect")
    def _search_path(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("SHOW search_path")
        current = cur.fetchone()[0]
        cur.execute(f"SET search_path TO {OWN_SCHEMA}, {current}")
        cur.close()
        # Leave no transaction open: the pool's reset would roll back the SET.
        dbapi_conn.commit()

    return engine


def alembic_config() -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    return cfg


def own_head() -> str:
    """alembic's head, read from the scripts (loads alembic; :data:`OWN_HEAD` does not)."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def _own_revision(conn: Connection) -> str | None:
    return version_row(conn, OWN_SCHEMA)


async def own_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(_own_revision)


async def check_synapse(engine: AsyncEngine) -> tuple[int, int]:
    async with engine.connect() as conn:
        return await check_synapse_schema(conn)


async def upgrade_own_schema(engine: AsyncEngine, revision: str = "head") -> None:
    """Check Synapse's schema, then create or upgrade ours (idempotent)."""
    await check_synapse(engine)
    await upgrade_chain(engine, alembic_config, OWN_HEAD, _own_revision, revision,
                        lock_key=MIGRATE_LOCK_KEY)


async def check_own_schema(engine: AsyncEngine) -> None:
    current = await own_revision(engine)
    head = OWN_HEAD
    if current == head:
        return
    if current is None:
        raise SchemaVersionError(
            f"schema {OWN_SCHEMA} is not initialised; run "
            "`federation-sender migrate --synapse-config homeserver.yaml` first"
        )
    from alembic.script import ScriptDirectory

    known = {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if current in known:
        raise SchemaVersionError(
            f"schema {OWN_SCHEMA} is at revision {current}, this version needs {head}; run "
            "`federation-sender migrate --synapse-config homeserver.yaml`"
        )
    raise SchemaVersionError(
        f"schema {OWN_SCHEMA} revision {current} is newer than this federation-sender "
        f"knows (head {head}); upgrade federation-sender"
    )
