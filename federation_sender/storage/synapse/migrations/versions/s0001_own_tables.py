"""our tables beside Synapse's, in schema federation_sender

Revision ID: s0001
Revises:
Create Date: 2026-11-23

The transaction log, the sharding registry and leases, and the replication client's
positions (``replication_positions``: not Synapse's ``stream_positions``, whose rows
belong to Synapse's id generators). No name here is also a Synapse table's, so nothing
of Synapse's is shadowed on our connections' search path.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from federation_sender.storage import shared_tables_ddl

revision = "s0001"
down_revision = None
branch_labels = None
depends_on = None

SCHEMA = "federation_sender"


def upgrade() -> None:
    # The tables the native chain creates too, from one declaration.
    shared_tables_ddl.create_r1(schema=SCHEMA)
    op.create_table(
        "replication_positions",
        sa.Column("stream_name", sa.Text(), nullable=False),
        sa.Column("instance_name", sa.Text(), nullable=False),
        sa.Column("stream_id", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("stream_name", "instance_name", name="pk_replication_positions"),
        schema=SCHEMA,
    )


def downgrade() -> None:
    op.drop_table("replication_positions", schema=SCHEMA)
    shared_tables_ddl.drop_r1(schema=SCHEMA)
