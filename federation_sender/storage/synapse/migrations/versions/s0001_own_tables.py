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

revision = "s0001"
down_revision = None
branch_labels = None
depends_on = None

SCHEMA = "federation_sender"


def upgrade() -> None:
    op.create_table(
        "federation_transaction_log",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("txn_id", sa.Text(), nullable=False),
        sa.Column("destination", sa.Text(), nullable=False),
        sa.Column("instance_name", sa.Text(), server_default="master", nullable=False),
        sa.Column("pdu_count", sa.Integer(), nullable=False),
        sa.Column("edu_count", sa.Integer(), nullable=False),
        sa.Column("request_bytes", sa.Integer(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("http_status", sa.Integer(), nullable=True),
        sa.Column("started_ts", sa.BigInteger(), nullable=False),
        sa.Column("duration_ms", sa.Integer(), nullable=False),
        sa.Column("catchup", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("max_stream_ordering", sa.BigInteger(), nullable=True),
        sa.Column("pdu_event_ids", sa.Text(), server_default="[]", nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_federation_transaction_log"),
        schema=SCHEMA,
    )
    op.create_index(
        "ix_federation_transaction_log_dest_started",
        "federation_transaction_log",
        ["destination", "started_ts"],
        schema=SCHEMA,
    )
    op.create_table(
        "federation_sender_instances",
        sa.Column("instance_name", sa.Text(), nullable=False),
        sa.Column("started_ts", sa.BigInteger(), nullable=False),
        sa.Column("heartbeat_ts", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("instance_name", name="pk_federation_sender_instances"),
        schema=SCHEMA,
    )
    op.create_table(
        "destination_leases",
        sa.Column("destination", sa.Text(), nullable=False),
        sa.Column("instance_name", sa.Text(), nullable=False),
        sa.Column("lease_until_ts", sa.BigInteger(), nullable=False),
        sa.Column("fencing_token", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("destination", name="pk_destination_leases"),
        schema=SCHEMA,
    )
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
    op.drop_table("destination_leases", schema=SCHEMA)
    op.drop_table("federation_sender_instances", schema=SCHEMA)
    op.drop_index(
        "ix_federation_transaction_log_dest_started",
        table_name="federation_transaction_log",
        schema=SCHEMA,
    )
    op.drop_table("federation_transaction_log", schema=SCHEMA)
