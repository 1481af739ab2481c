"""``--room ROOM_ID``: a job on some rooms only (``audit``, ``backfill-destination-rooms``).

:class:`OnlyRooms` wraps any :class:`~federation_sender.batch.io.Source` (JDBC on either
schema, a snapshot) and keeps, of each frame with a ``room_id`` column in
:data:`~federation_sender.batch.io.SCHEMA_COLUMNS` (events, memberships,
``destination_rooms``, ``partial_state_rooms``), the rows of the given rooms. The filter
is a plain ``room_id IN (…)`` on the frame, which Spark pushes into the JDBC query (and
into a snapshot's Parquet scan), so only those rooms' rows leave the database.

Why the results stay exact: every finding is one (destination, room) and is decided by
that room's events, members and row, with what belongs to a destination and no room
(``destinations``: retry state and position; the sender's position; erased users; our
transaction log, whose start and carried event ids are matched against the room's own
events). Those frames are read whole. So a finding of a room is the same whether the
job runs on that room or on all of them; the summary counts the given rooms' pairs, and
a repair creates or raises their rows and lowers a destination's position only for what
they owe (catch-up then resends from there, as after a repair of every room).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from federation_sender.batch.io import SCHEMA_COLUMNS, Source

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

ROOM_ID = "room_id"


def room_frames(schema: str) -> frozenset[str]:
    """The frames of ``schema`` that hold rows of a room."""
    return frozenset(name for name, cols in SCHEMA_COLUMNS[schema].items() if ROOM_ID in cols)


def checked_rooms(rooms: Sequence[str]) -> tuple[str, ...]:
    """The room ids, deduplicated in their order (:class:`ValueError` for one that is
    not a room id: ``!`` and more; an alias, ``#…``, is not one)."""
    for room in rooms:
        if not room.startswith("!") or len(room) < 2:
            raise ValueError(f"--room wants a room id (!…, not an alias), not {room!r}")
    return tuple(dict.fromkeys(rooms))


class OnlyRooms:
    """``source`` with its room frames restricted to ``rooms``."""

    def __init__(self, source: Source, rooms: Sequence[str]) -> None:
        if not rooms:
            raise ValueError("no rooms to restrict the job to")
        self._source = source
        self.rooms = checked_rooms(rooms)
        self._frames = room_frames(source.schema)

    @property
    def schema(self) -> str:
        return self._source.schema

    @property
    def high_water_mark(self) -> int:
        return self._source.high_water_mark

    def table(self, name: str) -> DataFrame:
        from pyspark.sql import functions as F

        df = self._source.table(name)
        if name not in self._frames:
            return df
        return df.filter(F.col(ROOM_ID).isin(list(self.rooms)))
