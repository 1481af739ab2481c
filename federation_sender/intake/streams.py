"""The replication streams the worker consumes: one table, each name written once.

:data:`STREAMS` maps a stream's name to its :class:`Stream`: how its rows are parsed
(:mod:`federation_sender.replication.rows`), what the intake does with them (its hook,
below), and what a gap in it skips where the backend has no fetcher. Everything else
that names the consumed streams is derived from it:

* :data:`ROW_PARSERS` (and :func:`parse_row`): what the replication client is given to
  parse; a stream missing from it is not consumed (its rows are skipped unparsed);
* :data:`CONSUMED_STREAMS`: the names, in the table's order;
* the intake's dispatch (:class:`federation_sender.intake.ReplicationIntake` looks the
  stream up here);
* :func:`gap_notes`: what the replication client logs for a gap no fetcher fills, the
  table's notes with the backend's own (what its schema keeps or its writer never
  writes, :mod:`federation_sender.storage.stream_fetchers`).

The storage layer sits below the intake (``[tool.importlinter]`` in pyproject.toml), so
the backends' gap fetchers and notes are still keyed by name there;
``tests/intake/test_streams.py`` checks that each of those names is a consumed stream,
that the parsers are the ones of the table's streams, and that no consumed stream is
among the streams the client skips.

A new stream whose rows become EDUs: its row type and parser in ``replication/rows.py``,
its fan-out in ``edus/`` (and a field of :class:`federation_sender.edus.fanouts.EduFanouts`
built in :func:`~federation_sender.edus.fanouts.edu_fanouts`), and its entry here, with a
hook that hands the rows to the fan-out.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from federation_sender.clock import time_ms
from federation_sender.edus.presence import presence_json
from federation_sender.errors import ProtocolError
from federation_sender.queue.federation_stream import FederationEdu
from federation_sender.replication.client import ROWS_SKIPPED, GapNote
from federation_sender.replication.commands import JsonValue
from federation_sender.replication.frontier import WritersFrontier
from federation_sender.replication.rows import (
    CachesRow,
    DeviceListsRow,
    EduRow,
    KeyedEduRow,
    PresenceDestinationsRow,
    PresenceFederationRow,
    PresenceRow,
    ReceiptsRow,
    Row,
    RowParser,
    ToDeviceStreamRow,
    TypingRow,
    parse_caches_row,
    parse_device_lists_row,
    parse_events_row,
    parse_federation_row,
    parse_presence_federation_row,
    parse_presence_row,
    parse_receipts_row,
    parse_to_device_row,
    parse_typing_row,
)

if TYPE_CHECKING:
    from federation_sender.intake.handler import ReplicationIntake

RETRY_TIMINGS_CACHE = "get_destination_retry_timings"
"""Synapse's cache of a destination's retry timings, named in ``caches`` rows."""


@dataclass(frozen=True, slots=True)
class Batch:
    """One call's rows of a stream from one writer (the intake's ``on_rows``)."""

    instance_name: str
    token: int
    """What the stream's reads are bounded by: the writer's token, or for a stream with
    a :attr:`Stream.frontier` what every writer has finished."""
    reported: int
    """The writer's token."""
    rows: Sequence[Row]


Hook = Callable[["ReplicationIntake", Batch], Awaitable[None]]
"""What the intake does with a stream's batch."""


@dataclass(frozen=True, slots=True)
class Stream:
    parse: RowParser
    handle: Hook
    gap: GapNote | None
    """What a gap skips where the backend has no fetcher and no note of its own (None:
    nothing is missed)."""
    bounds_outboxes: bool = False
    """Its token bounds the destinations' outbox reads (Synapse backend): queues that read
    before the first one found nothing, so the first one wakes them all."""
    frontier: Callable[[ReplicationIntake], WritersFrontier] | None = None
    """With several writers, the frontier that replaces a writer's token (a writer may
    commit a lower stream id after another published a higher one)."""
    read_later: bool = False
    """Its rows are read from the database by the queue's event fan-out after the call
    returns: the position metric says how far that is behind."""


# --- the hooks ---------------------------------------------------------------------


async def _events(intake: ReplicationIntake, b: Batch) -> None:
    intake.events_moved(b.instance_name, b.token)


async def _federation(intake: ReplicationIntake, b: Batch) -> None:
    """EDUs main queued for remote servers, presence formatted as Synapse formats it."""
    edus: list[FederationEdu] = []
    now = time_ms(intake.clock)
    for r in b.rows:
        if isinstance(r, EduRow):
            e = r.edu
            edus.append(FederationEdu(e.destination, e.edu_type, e.content))
        elif isinstance(r, KeyedEduRow):
            e = r.edu
            edus.append(FederationEdu(e.destination, e.edu_type, e.content, r.key))
        elif isinstance(r, PresenceDestinationsRow):
            content = {"push": [presence_json(r.state, now)]}
            for dest in r.destinations:
                edus.append(FederationEdu(dest, "m.presence", content))
    await intake.manager.process_federation_batch(b.token, edus)


async def _to_device(intake: ReplicationIntake, b: Batch) -> None:
    """A remote server with queued messages: its outbox is poked (a local user's row is
    for the local devices)."""
    for r in b.rows:
        if isinstance(r, ToDeviceStreamRow) and not r.entity.startswith("@"):
            intake.manager.notify_outbox(r.entity)


async def _device_lists(intake: ReplicationIntake, b: Batch) -> None:
    await intake.device_lists_changed(
        b.reported, b.token, [r.user_id for r in b.rows if isinstance(r, DeviceListsRow)]
    )


async def _receipts(intake: ReplicationIntake, b: Batch) -> None:
    await intake.fanouts.receipts.on_rows(r for r in b.rows if isinstance(r, ReceiptsRow))


async def _typing(intake: ReplicationIntake, b: Batch) -> None:
    await intake.fanouts.typing.on_rows(b.token, (r for r in b.rows if isinstance(r, TypingRow)))


async def _presence(intake: ReplicationIntake, b: Batch) -> None:
    if (fanout := intake.fanouts.presence) is not None:
        await fanout.on_presence(r for r in b.rows if isinstance(r, PresenceRow))


async def _presence_federation(intake: ReplicationIntake, b: Batch) -> None:
    if (fanout := intake.fanouts.presence) is not None:
        await fanout.on_presence_federation(
            r for r in b.rows if isinstance(r, PresenceFederationRow)
        )


async def _caches(intake: ReplicationIntake, b: Batch) -> None:
    """Another process invalidated a destination's retry timings (Synapse's main does
    when the destination contacts it): a wake-up, which Synapse's own federation sender
    ignores (it waits for its 0.2/s sweep)."""
    for r in b.rows:
        if isinstance(r, CachesRow) and r.cache_func == RETRY_TIMINGS_CACHE and r.keys:
            for dest in r.keys:
                if isinstance(dest, str):
                    await intake.manager.retry_timings_changed(dest)


# --- the table ---------------------------------------------------------------------

STREAMS: Mapping[str, Stream] = {
    "events": Stream(
        parse_events_row, _events,
        gap=None,  # the intake reads events past its own persisted position
        read_later=True,
    ),
    "federation": Stream(parse_federation_row, _federation, gap=GapNote(
        logging.WARNING,
        "the EDUs main queued for federation in that range are not sent (main keeps "
        "them in memory until acknowledged)",
    )),
    "to_device": Stream(parse_to_device_row, _to_device, ROWS_SKIPPED, bounds_outboxes=True),
    "device_lists": Stream(
        parse_device_lists_row, _device_lists, ROWS_SKIPPED,
        bounds_outboxes=True, frontier=lambda intake: intake.device_lists,
    ),
    "receipts": Stream(parse_receipts_row, _receipts, ROWS_SKIPPED),
    "typing": Stream(parse_typing_row, _typing, gap=GapNote(
        logging.INFO,
        "typing notifications in that range are not sent (main keeps typing in memory); "
        "a user still typing is sent again within 40 s",
    )),
    "presence": Stream(parse_presence_row, _presence, ROWS_SKIPPED),
    "presence_federation": Stream(
        parse_presence_federation_row, _presence_federation, gap=GapNote(
            logging.INFO,
            "presence main sent to named servers in that range is not sent again (main "
            "keeps that queue in memory); the users' next change is",
        ),
    ),
    "caches": Stream(parse_caches_row, _caches, gap=GapNote(
        logging.INFO,
        "its cache invalidations are not replayed: a destination another process "
        "stopped backing off in that range is woken by the next wake-up sweep "
        "(queue.wakeup_interval_s), and every destination's row is read afresh when "
        "its queue starts",
    )),
}  # fmt: skip
"""The consumed streams, by name (see the module docstring)."""

CONSUMED_STREAMS: tuple[str, ...] = tuple(STREAMS)

ROW_PARSERS: Mapping[str, RowParser] = {name: s.parse for name, s in STREAMS.items()}
"""The consumed streams' row parsers, as the replication client is given them."""


def parse_row(stream_name: str, row: JsonValue) -> Row:
    """Parse a decoded RDATA row of a consumed stream; ``ProtocolError`` if invalid."""
    parser = ROW_PARSERS.get(stream_name)
    if parser is None:
        raise ProtocolError(f"stream {stream_name!r} is not consumed")
    return parser(row)


def gap_notes(backend: Mapping[str, GapNote | None]) -> dict[str, GapNote | None]:
    """What a gap no fetcher fills skips, per consumed stream: the table's note, or the
    backend's where it has one (its capabilities' ``gap_notes``)."""
    return {name: backend.get(name, s.gap) for name, s in STREAMS.items()}
