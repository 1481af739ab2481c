"""Synapse's tables as far as a federation sender uses them, and the version check.

These definitions are *not* alembic's: Synapse owns and migrates these tables, and
``federation-sender migrate`` never creates or alters them (our own tables live in the
``federation_sender`` schema, migrated by their own alembic chain in
``storage/synapse/migrations/``). Only the
columns we read or write are declared. ``destinations`` and ``destination_rooms`` are not
here: ours have Synapse's columns, and the Synapse backend uses their declarations
(:mod:`federation_sender.storage.schema`).

We write exactly what Synapse's own federation sender writes: ``destinations``,
``destination_rooms``, ``federation_stream_position`` and
``cache_invalidation_stream_by_instance`` (plus, once EDUs are sent from the outboxes,
their deletes and ``device_lists_outbound_last_success``).

The version check accepts exactly the schema range this code has been tested against
(:data:`TESTED_SCHEMA_VERSIONS`, those of the releases of :data:`SYNAPSE_RELEASE_WINDOW`,
which ``scripts/synapse-compat.sh`` runs), and, as Synapse's own rule for a worker, a
``schema_compat_version`` (the oldest code version that can still use the database)
no newer than the newest of them. Every release of the window has
``SCHEMA_VERSION`` 94 and ``SCHEMA_COMPAT_VERSION`` 84; what differs between them within
schema 94 is in docs/synapse.md ("Synapse releases").
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

TESTED_SCHEMA_VERSIONS = (94, 94)
"""The lowest and highest ``schema_version`` accepted: those of the tested releases."""

SYNAPSE_RELEASE_WINDOW = (
    "1.158.0", "1.159.0", "1.160.0", "1.161.0", "1.162.0", "1.163.0", "1.163.1", "1.163.2",
)
"""Every Synapse release the tests have run against, oldest first: the one list
(``scripts/synapse-compat.sh`` runs this window; the suite's pinned release,
``testing/synapse_install.py``'s ``SYNAPSE_VERSION``, is its newest; docs/synapse.md)."""

TESTED_SYNAPSE_RELEASES = (SYNAPSE_RELEASE_WINDOW[0], SYNAPSE_RELEASE_WINDOW[-1])
"""The oldest and newest of :data:`SYNAPSE_RELEASE_WINDOW`."""

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
    low, high = TESTED_SCHEMA_VERSIONS
    if not low <= int(version) <= high or compat_v > high:
        first, last = TESTED_SYNAPSE_RELEASES
        tested = f"schema {low}" if low == high else f"schemas {low} to {high}"
        advice = (
            "upgrade Synapse" if int(version) < low
            else "upgrade federation-sender or run Synapse's own federation sender"
        )
        raise SchemaVersionError(
            f"Synapse database schema {version} (compat version {compat_v}) is not one "
            f"this federation sender was tested against ({tested}, compat version at "
            f"most {high}: Synapse {first} to {last}); {advice}"
        )
    return int(version), compat_v
