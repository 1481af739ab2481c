"""Alembic environment for our own tables beside Synapse's (schema ``federation_sender``).

Run only through :func:`federation_sender.storage.synapse.database.upgrade_own_schema`, which
passes an open connection. Alembic's version table lives in our schema too
(``version_table_schema``), so nothing of ours appears among Synapse's tables.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

OWN_SCHEMA = "federation_sender"

config = context.config


def _run(connection: Connection) -> None:
    connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {OWN_SCHEMA}"))
    context.configure(
        connection=connection,
        target_metadata=None,
        version_table_schema=OWN_SCHEMA,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is None:  # pragma: no cover - only run programmatically
    raise RuntimeError("run through `federation-sender migrate --synapse-config ...`")
_run(connection)
