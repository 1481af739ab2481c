"""The whole database contract as SQLAlchemy Core metadata; alembic's single source.

Tables written by the main process (or the simulator standing in for it):

* ``events``: one row per persisted event, ``stream_ordering`` is the events stream id.
* ``room_memberships``: membership history. Each membership event is a row with the
  target user's server (``server_name``), so "which servers had a joined user in room R
  at stream position S" is: for each (user) in R, the latest row with
  ``event_stream_ordering <= S``; keep servers with any user whose latest row is
  ``join``. The ``(room_id, user_id, event_stream_ordering)`` index answers that by an
  index range scan per room.
* ``event_forward_extremities``, ``partial_state_rooms``.
* ``device_federation_outbox`` (to-device messages per destination) and
  ``device_lists_outbound_pokes`` (device-list updates per destination): durable EDU
  outboxes, read by per-destination stream id.

Tables written by the worker:

* ``destinations``: backoff state and ``last_successful_stream_ordering``.
* ``destination_rooms``: for each (destination, room) the stream ordering of the latest
  event the destination should have received; catch-up walks it.
* ``stream_positions``: per (stream, writer instance) processed position.
* ``federation_transaction_log``: every transaction attempt's outcome.
* ``federation_sender_instances`` and ``destination_leases``: sharding by rendezvous
  hashing over live instances with fenced leases.

Names follow Synapse where Synapse has the same concept.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    false,
)

# Stable constraint names so migrations are identical on PostgreSQL and SQLite.
metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "pk": "pk_%(table_name)s",
    }
)

events = Table(
    "events",
    metadata,
    Column("stream_ordering", BigInteger, primary_key=True, autoincrement=False),
    Column("instance_name", Text, nullable=False, server_default="master"),
    Column("event_id", Text, nullable=False),
    Column("room_id", Text, nullable=False),
    Column("type", Text, nullable=False),
    Column("state_key", Text, nullable=True),
    Column("sender", Text, nullable=False),
    Column("origin_server_ts", BigInteger, nullable=False),
    Column("outlier", Boolean, nullable=False, server_default=false()),
    Column("rejected", Boolean, nullable=False, server_default=false()),
    Column("json", Text, nullable=False),
    UniqueConstraint("event_id"),
    Index("ix_events_room_id_stream_ordering", "room_id", "stream_ordering"),
)

room_memberships = Table(
    "room_memberships",
    metadata,
    Column("event_id", Text, nullable=False),
    Column("event_stream_ordering", BigInteger, nullable=False),
    Column("room_id", Text, nullable=False),
    Column("user_id", Text, nullable=False),
    Column("server_name", Text, nullable=False),
    Column("sender", Text, nullable=False),
    Column("membership", Text, nullable=False),
    PrimaryKeyConstraint("event_id"),
    Index(
        "ix_room_memberships_room_user_stream",
        "room_id",
        "user_id",
        "event_stream_ordering",
    ),
    Index(
        "ix_room_memberships_room_server_stream",
        "room_id",
        "server_name",
        "event_stream_ordering",
    ),
)

event_forward_extremities = Table(
    "event_forward_extremities",
    metadata,
    Column("event_id", Text, nullable=False),
    Column("room_id", Text, nullable=False),
    PrimaryKeyConstraint("event_id", "room_id"),
    Index("ix_event_forward_extremities_room_id", "room_id"),
)

partial_state_rooms = Table(
    "partial_state_rooms",
    metadata,
    Column("room_id", Text, primary_key=True),
)

device_federation_outbox = Table(
    "device_federation_outbox",
    metadata,
    Column("destination", Text, nullable=False),
    Column("stream_id", BigInteger, nullable=False),
    Column("queued_ts", BigInteger, nullable=False),
    Column("messages_json", Text, nullable=False),
    Column("sent_ts", BigInteger, nullable=True),
    PrimaryKeyConstraint("destination", "stream_id"),
)

device_lists_outbound_pokes = Table(
    "device_lists_outbound_pokes",
    metadata,
    Column("destination", Text, nullable=False),
    Column("stream_id", BigInteger, nullable=False),
    Column("user_id", Text, nullable=False),
    Column("device_id", Text, nullable=False),
    Column("ts", BigInteger, nullable=False),
    Column("content_json", Text, nullable=False, server_default="{}"),
    Column("sent", Boolean, nullable=False, server_default=false()),
    PrimaryKeyConstraint("destination", "stream_id", "user_id", "device_id"),
    Index("ix_device_lists_outbound_pokes_dest_sent_stream", "destination", "sent", "stream_id"),
)

destinations = Table(
    "destinations",
    metadata,
    Column("destination", Text, primary_key=True),
    Column("retry_last_ts", BigInteger, nullable=True),
    Column("retry_interval", BigInteger, nullable=True),
    Column("failure_ts", BigInteger, nullable=True),
    Column("last_successful_stream_ordering", BigInteger, nullable=True),
)

destination_rooms = Table(
    "destination_rooms",
    metadata,
    Column("destination", Text, nullable=False),
    Column("room_id", Text, nullable=False),
    Column("stream_ordering", BigInteger, nullable=False),
    PrimaryKeyConstraint("destination", "room_id"),
    # Catch-up: "oldest rows of D past position P".
    Index("ix_destination_rooms_destination_stream", "destination", "stream_ordering"),
    Index("ix_destination_rooms_room_id", "room_id"),
)

stream_positions = Table(
    "stream_positions",
    metadata,
    Column("stream_name", Text, nullable=False),
    Column("instance_name", Text, nullable=False),
    Column("stream_id", BigInteger, nullable=False),
    PrimaryKeyConstraint("stream_name", "instance_name"),
)

federation_transaction_log = Table(
    "federation_transaction_log",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("txn_id", Text, nullable=False),
    Column("destination", Text, nullable=False),
    Column("instance_name", Text, nullable=False, server_default="master"),
    Column("pdu_count", Integer, nullable=False),
    Column("edu_count", Integer, nullable=False),
    Column("request_bytes", Integer, nullable=False),
    Column("status", Text, nullable=False),  # success | transient | permanent | too_large
    Column("http_status", Integer, nullable=True),
    Column("started_ts", BigInteger, nullable=False),
    Column("duration_ms", Integer, nullable=False),
    Column("catchup", Boolean, nullable=False, server_default=false()),
    Column("max_stream_ordering", BigInteger, nullable=True),
    Column("pdu_event_ids", Text, nullable=False, server_default="[]"),
    Column("error", Text, nullable=True),
    Index("ix_federation_transaction_log_dest_started", "destination", "started_ts"),
)

federation_sender_instances = Table(
    "federation_sender_instances",
    metadata,
    Column("instance_name", Text, primary_key=True),
    Column("started_ts", BigInteger, nullable=False),
    Column("heartbeat_ts", BigInteger, nullable=False),
)

destination_leases = Table(
    "destination_leases",
    metadata,
    Column("destination", Text, primary_key=True),
    Column("instance_name", Text, nullable=False),
    Column("lease_until_ts", BigInteger, nullable=False),
    Column("fencing_token", BigInteger, nullable=False),
)
