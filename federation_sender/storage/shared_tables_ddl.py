"""The DDL of our tables that both alembic chains create, written once.

Three of our tables exist in both deployments: ``federation_transaction_log`` (with its
index), ``federation_sender_instances`` and ``destination_leases``. The native chain
(``storage/migrations/``) makes them in the database's default schema; the chain beside
Synapse (``storage/synapse/migrations/``) makes them in schema ``federation_sender``.
The first revision of each (``0001``, ``s0001``) calls :func:`create_r1` with its
schema, so the two can not drift apart.

This module is part of those revisions and is frozen as they are: a database at
``0001`` or ``s0001`` already holds what :func:`create_r1` made. A later change to
these tables is a new revision in each chain, which may share a new function added
here (``create_r2``...), never an edit of this one. Runs only inside an alembic
migration (it uses ``alembic.op``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

TXNLOG_INDEX = "ix_federation_transaction_log_dest_started"


def create_r1(schema: str | None) -> None:
    """The shared tables as revision 1 of either chain creates them."""
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
        sa.PrimaryKeyConstraint("id", name=op.f("pk_federation_transaction_log")),
        schema=schema,
    )
    op.create_index(
        TXNLOG_INDEX, "federation_transaction_log", ["destination", "started_ts"],
        unique=False, schema=schema,
    )
    op.create_table(
        "federation_sender_instances",
        sa.Column("instance_name", sa.Text(), nullable=False),
        sa.Column("started_ts", sa.BigInteger(), nullable=False),
        sa.Column("heartbeat_ts", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("instance_name", name=op.f("pk_federation_sender_instances")),
        schema=schema,
    )
    op.create_table(
        "destination_leases",
        sa.Column("destination", sa.Text(), nullable=False),
        sa.Column("instance_name", sa.Text(), nullable=False),
        sa.Column("lease_until_ts", sa.BigInteger(), nullable=False),
        sa.Column("fencing_token", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("destination", name=op.f("pk_destination_leases")),
        schema=schema,
    )


def drop_r1(schema: str | None) -> None:
    """Undo :func:`create_r1`."""
    op.drop_table("destination_leases", schema=schema)
    op.drop_table("federation_sender_instances", schema=schema)
    op.drop_index(TXNLOG_INDEX, table_name="federation_transaction_log", schema=schema)
    op.drop_table("federation_transaction_log", schema=schema)
