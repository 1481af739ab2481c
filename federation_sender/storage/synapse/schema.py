"""Synapse's tables as far as a federation sender uses them, and the version check.

These definitions are *not* alembic's: Synapse owns and migrates these tables, and
``federation-sender migrate`` never creates or alters them (our own tables live in the
``federation_sender`` schema, see :mod:`federation_sender.synapse.migrate`). Only the
columns we read or write are declared.

We write exactly what Synapse's own federation sender writes: ``destinations``,
``destination_rooms``, ``federation_stream_position`` and
``cache_invalidation_stream_by_instance`` (plus, once EDUs are sent from the outboxes,
their deletes and ``device_lists_outbound_last_success``).

The version check follows Synapse's rule for a worker: the database must be at least at
the schema version this code was written against (:data:`SCHEMA_VERSION`), and its
``schema_compat_version`` (the oldest code version that can still use it) must not be
newer than that version.
"""

from __future__ import annotations

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    Column,
    MetaData,
    Table,
    Text,
    select,
)
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.errors import SchemaVersionError

SCHEMA_VERSION = 94
"""Synapse 1.163's ``SCHEMA_VERSION``: the schema these queries were written against."""

synapse_metadata = MetaData()

schema_version = Table(
    "schema_version",
    synapse_metadata,
    Column("version", BigInteger),
    Column("upgraded", Boolean),
)

schema_compat_version = Table(
    "schema_compat_version",
    synapse_metadata,
    Column("compat_version", BigInteger),
)

events = Table(
    "events",
    synapse_metadata,
    Column("stream_ordering", BigInteger),
    Column("event_id", Text),
    Column("room_id", Text),
    Column("type", Text),
    Column("state_key", Text),
    Column("sender", Text),
    Column("outlier", Boolean),
    Column("rejection_reason", Text),
    Column("received_ts", BigInteger),
    Column("origin_server_ts", BigInteger),
)

event_json = Table(
    "event_json",
    synapse_metadata,
    Column("event_id", Text),
    Column("room_id", Text),
    Column("internal_metadata", Text),
    Column("json", Text),
    Column("format_version", BigInteger),
)

destinations = Table(
    "destinations",
    synapse_metadata,
    Column("destination", Text, primary_key=True),
    Column("retry_last_ts", BigInteger),
    Column("retry_interval", BigInteger),
    Column("failure_ts", BigInteger),
    Column("last_successful_stream_ordering", BigInteger),
)

destination_rooms = Table(
    "destination_rooms",
    synapse_metadata,
    Column("destination", Text, primary_key=True),
    Column("room_id", Text, primary_key=True),
    Column("stream_ordering", BigInteger),
)

federation_stream_position = Table(
    "federation_stream_position",
    synapse_metadata,
    Column("type", Text),
    Column("stream_id", BigInteger),
    Column("instance_name", Text),
)

event_forward_extremities = Table(
    "event_forward_extremities",
    synapse_metadata,
    Column("event_id", Text),
    Column("room_id", Text),
)

partial_state_rooms = Table(
    "partial_state_rooms",
    synapse_metadata,
    Column("room_id", Text),
)

partial_state_rooms_servers = Table(
    "partial_state_rooms_servers",
    synapse_metadata,
    Column("room_id", Text),
    Column("server_name", Text),
)

event_to_state_groups = Table(
    "event_to_state_groups",
    synapse_metadata,
    Column("event_id", Text),
    Column("state_group", BigInteger),
)

room_memberships = Table(
    "room_memberships",
    synapse_metadata,
    Column("event_id", Text),
    Column("user_id", Text),
    Column("room_id", Text),
    Column("membership", Text),
    Column("event_stream_ordering", BigInteger),
)

cache_invalidation_stream_by_instance = Table(
    "cache_invalidation_stream_by_instance",
    synapse_metadata,
    Column("stream_id", BigInteger),
    Column("instance_name", Text),
    Column("cache_func", Text),
    Column("keys", ARRAY(Text)),
    Column("invalidation_ts", BigInteger),
)

SYNAPSE_WRITTEN_TABLES = (
    "destinations",
    "destination_rooms",
    "federation_stream_position",
    "cache_invalidation_stream_by_instance",
)


async def check_synapse_schema(conn: AsyncConnection) -> tuple[int, int]:
    """Return (version, compat_version); raise :class:`SchemaVersionError` (one line)
    unless this is a Synapse database these queries support."""
    try:
        version = (await conn.execute(select(schema_version.c.version))).scalar()
        compat = (await conn.execute(select(schema_compat_version.c.compat_version))).scalar()
    except ProgrammingError as e:
        raise SchemaVersionError(
            "this is not a Synapse database (no schema_version table); check "
            "database in homeserver.yaml"
        ) from e
    if version is None:
        raise SchemaVersionError("Synapse's schema_version table is empty")
    compat_v = int(compat) if compat is not None else int(version)
    if int(version) < SCHEMA_VERSION:
        raise SchemaVersionError(
            f"Synapse database schema {version} is older than {SCHEMA_VERSION} (Synapse "
            "1.163); upgrade Synapse before running this federation sender"
        )
    if compat_v > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"Synapse database schema {version} (compat version {compat_v}) is newer "
            f"than this federation sender supports ({SCHEMA_VERSION}); upgrade "
            "federation-sender"
        )
    return int(version), compat_v
