"""The events stream's rows from writers older and newer than us parse alike, and a
malformed row is one protocol error, whichever path (fast or general) reads it."""

from __future__ import annotations

import pytest

from federation_sender.errors import ProtocolError
from federation_sender.replication.rows_tagged import (
    AllStateRow,
    CurrentStateRow,
    EventsStreamRow,
    parse_events_row,
)

FULL = EventsStreamRow("$e", "!r:l", "m.room.member", "@u:l", None, None, "join", False, True)


def test_rows_of_every_writer_length_parse_to_one_row() -> None:
    wire = FULL.wire()
    assert parse_events_row(wire) == FULL
    data = wire[1]  # type: ignore[index]
    assert parse_events_row(["ev", [*data, "a newer field"]]) == FULL
    older = parse_events_row(["ev", data[:5]])
    assert older == FULL._replace(membership=None, outlier=False)
    assert parse_events_row(["state", ["!r:l", "m.room.name", "", "$n"]]) == CurrentStateRow(
        "!r:l", "m.room.name", "", "$n"
    )
    assert parse_events_row(["state-all", ["!r:l"]]) == AllStateRow("!r:l")


@pytest.mark.parametrize("row", [
    ["ev", ["$e", "!r:l", "m.room.message", None]],  # too short
    ["ev", ["$e", "!r:l", "m.room.message", None, None, None, None, "no", False]],
    ["ev", [1, "!r:l", "m.room.message", None, None]],
    ["redacted", ["$e"]],
    "ev",
])
def test_a_malformed_row_is_a_protocol_error(row: object) -> None:
    with pytest.raises(ProtocolError, match=r"^invalid events row: "):
        parse_events_row(row)  # type: ignore[arg-type]
