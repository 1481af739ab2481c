"""The reader-side replication client the worker runs.

Interface (wired in ``app.py``)::

    client = ReplicationClient(
        transport,                  # TcpTransport(host, port, clock=, client_name=,
                                    #   expected_server_name=) or RedisTransport(url,
                                    #   server_name, clock=)
        instance_name="fed1",       # our name: NAME, FEDERATION_ACK, echo filter
        store=position_store,       # PositionStore: load() / save(stream, instance, token)
        streams={"events": parse, ...},  # the consumed streams' row parsers
                                    #   (intake/streams.py: ROW_PARSERS)
        fetchers={"events": f, ...},# StreamFetcher per stream, for gaps
        gap_notes={"typing": note},  # what a gap skips where there is no fetcher
        handler=handler,            # ReplicationHandler, below
        clock=clock, rng=random.Random(),
    )
    task = asyncio.create_task(client.run())   # forever; cancel to stop
    client.send_federation_ack(token)           # or client.send(any client command)

    class ReplicationHandler(Protocol):
        async def on_rows(self, stream_name, instance_name, token, rows): ...
        async def on_remote_server_up(self, server): ...

``on_rows`` receives typed rows (``rows.py``) of one consumed stream from one
writer (the streams and their parsers are the caller's: the worker's table is
:mod:`federation_sender.intake.streams`): every row with a token in (previous
position, ``token``]. ``rows`` is empty when the position moved without rows (a
POSITION, or a gap that no fetcher could fill); ``token`` may be lower than before
after a writer reset. Calls are sequential, in stream order; while a handler runs
nothing else is read, which is the backpressure that lets a writer detect a stuck
reader.

Theory of operation. :meth:`ReplicationClient.run` loops forever: open a
session, send ``REPLICATE`` (with the PSYNC offer: plain writers ignore it) and
the last ``FEDERATION_ACK``, then dispatch received commands until the session
ends; then sleep a capped, jittered exponential backoff (reset after a session
that delivered anything) and start over. RDATA, POSITION and HISTORY go
through :class:`StreamPositions`, which says what to deliver or to fetch.

Persistence: a position is saved through the store only after the handler has
returned for its update, so the persisted position only covers finished work.
With ``save_interval_s`` 0 they are saved after every received batch; otherwise
at most once per interval, at most that long after the first unsaved update (a
timer task started by that update saves them: one task per interval, not one per
line), and when the session ends or the client is stopped. Replaying the unsaved window after a
crash is what at-least-once delivery already allows (handlers are idempotent),
and one save per interval instead of one per batch is one database transaction
less per RDATA line under load. If the session ends in a protocol error the peer
gets ``ERROR <reason>`` and the client reconnects. If the handler raises,
in-memory positions roll back to the persisted ones (after saving what had
finished) and the client reconnects: the writer's POSITIONs then make it fetch
the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from federation_sender.clock import Clock
from federation_sender.errors import FederationSenderError, ProtocolError
from federation_sender.replication import commands as c
from federation_sender.replication.positions import (
    Fetch,
    Key,
    PositionStore,
    Reset,
    StreamFetcher,
    StreamPositions,
    Update,
    fetch_gap,
)
from federation_sender.replication.reconnect import DEFAULT_BACKOFF, Backoff
from federation_sender.replication.rows import Row, RowParser
from federation_sender.replication.transport import ConnectionLost, Session, Transport

logger = logging.getLogger(__name__)

SKIPPED_STREAMS = frozenset({
    # Synapse's streams that the worker does not consume
    # (replication/tcp/streams/): skipped silently; any other stream not consumed is
    # logged once as unknown.
    "backfill", "push_rules", "pushers", "account_data", "thread_subscriptions",
    "profile_updates", "sticky_events", "quarantined_media", "un_partial_stated_room",
    "un_partial_stated_event",
})


PERSISTED_STREAMS = frozenset({"events"})
"""Streams whose writer's position never goes backwards unless its database was
restored (a reset of one of them is logged as a warning)."""


class ReplicationHandler(Protocol):
    async def on_rows(
        self, stream_name: str, instance_name: str, token: int, rows: Sequence[Row]
    ) -> None: ...

    async def on_remote_server_up(self, server: str) -> None: ...




def _raise_if_cancelled() -> None:
    """Re-raise a cancellation that a library swallowed on the way (one that catches
    CancelledError inside connect or subscribe and raises its own error instead): the
    task is still marked as cancelling, so stop rather than reconnect forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


@dataclass(frozen=True, slots=True)
class GapNote:
    """What a gap skips in a stream that has no fetcher, and at which level to say it."""

    level: int
    skipped: str


ROWS_SKIPPED = GapNote(logging.WARNING, "its rows in that range are skipped (no fetcher)")
"""What a gap skips in a stream that has neither a fetcher nor a note."""


class ReplicationClient:
    def __init__(
        self,
        transport: Transport,
        *,
        instance_name: str,
        store: PositionStore,
        fetchers: Mapping[str, StreamFetcher],
        handler: ReplicationHandler,
        clock: Clock,
        streams: Mapping[str, RowParser],
        rng: random.Random | None = None,
        backoff: Backoff = DEFAULT_BACKOFF,
        announce: Callable[[], Sequence[c.Command]] | None = None,
        save_interval_s: float = 0.0,
        gap_notes: Mapping[str, GapNote | None] | None = None,
        outage: Callable[[BaseException], str | None] = lambda _e: None,
    ) -> None:
        """``streams``: the consumed streams, each with its row parser; RDATA, POSITION
        and HISTORY of any other stream are skipped. ``gap_notes``: per stream without
        a fetcher, what a gap skips (None: nothing, no line is logged); a stream missing
        from it is logged as skipping its rows (:data:`ROWS_SKIPPED`).
        ``outage``: one line for an error that means the database is out of reach (the
        storage's ``db_outage``), None for anything else; such an error is logged as that
        line, without a traceback."""
        self._outage = outage
        self._transport = transport
        self._gap_notes = dict(gap_notes or {})
        self.instance_name = instance_name
        self._store = store
        self._fetchers = dict(fetchers)
        self._handler = handler
        self._clock = clock
        self._rng = rng or random.Random()
        self._parsers = dict(streams)
        self._backoff = backoff
        self._announce = announce
        """Positions of the streams we write (Synapse: ``POSITION caches <us> ..``), sent
        after connecting and in answer to every REPLICATE, as a Synapse process does."""
        self._positions: StreamPositions | None = None
        self._session: Session | None = None
        self._last_federation_ack: int | None = None
        self._dirty: dict[Key, int] = {}
        self._save_interval_s = save_interval_s
        self._saver: asyncio.Future[None] | None = None
        """The task that saves at the end of the interval; :meth:`_persist_on_exit`
        ends it before saving, so only one save runs at a time."""
        self._unknown_streams: set[str] = set()
        self.connected = asyncio.Event()
        self.sessions_opened = 0

    @property
    def positions(self) -> StreamPositions:
        if self._positions is None:
            raise RuntimeError("positions are loaded when run() starts")
        return self._positions

    # --- sending -------------------------------------------------------------------

    def send(self, command: c.Command) -> bool:
        """Send to the writer now; ``False`` (dropped) while disconnected."""
        if self._session is None:
            return False
        self._session.send(command)
        return True

    def send_federation_ack(self, token: int) -> None:
        """Acknowledge the federation stream; re-sent after every reconnect."""
        self._last_federation_ack = token
        self.send(c.FederationAckCommand(self.instance_name, token))

    def send_remote_server_up(self, server: str) -> None:
        self.send(c.RemoteServerUpCommand(server))

    # --- the loop ------------------------------------------------------------------

    async def run(self) -> None:
        if self._positions is None:
            self._positions = StreamPositions(await self._store.load())
        attempt = 0
        while True:
            delivered = await self._run_one_session()
            _raise_if_cancelled()
            attempt = 0 if delivered else attempt + 1
            await self._clock.sleep(self._backoff.delay_s(attempt, self._rng))

    async def _run_one_session(self) -> bool:
        """One connection's life; returns whether it got as far as receiving."""
        try:
            session = await self._transport.open()
        except ConnectionLost as e:
            logger.info("replication: cannot connect to %s: %s", self._transport.description, e)
            return False
        self.sessions_opened += 1
        received = False
        try:
            self._start(session)
            while True:
                batch = await session.receive()
                received = True
                await self._dispatch_batch(session, batch)
                if self._dirty:
                    await self._save_soon()
        except (ConnectionLost, ProtocolError) as e:
            logger.warning("replication: disconnected from %s: %s", self._transport.description,
                           e)
        except FederationSenderError as e:
            logger.error("replication: local error, reconnecting: %s", e, exc_info=True)
        except Exception as e:
            # Top of the replication task: a handler bug must not kill replication.
            outage = self._outage(e)
            if outage is not None:
                logger.warning("replication: the database is unavailable (%s); rolling "
                               "back and reconnecting", outage)
            else:
                logger.exception("replication: handler failed; rolling back and reconnecting")
        finally:
            # What the handler finished is saved; whatever was not is redelivered on
            # the next session (at-least-once): in-memory positions restart from the
            # persisted ones.
            await self._persist_on_exit()
            self.positions.rollback_to_persisted()
            self._session = None
            self._dirty.clear()
            self.connected.clear()
            await session.close()
        return received

    def _start(self, session: Session) -> None:
        self.positions.on_new_connection()
        self._session = session
        offer = None
        if session.supports_psync:
            have = tuple(
                c.StreamHave(stream, instance, history, token)
                for (stream, instance), token, history in self.positions.known()
                if history is not None and stream in self._parsers
            )
            offer = c.PsyncOffer(have)
        session.send(c.ReplicateCommand(offer))
        if self._last_federation_ack is not None:
            session.send(c.FederationAckCommand(self.instance_name, self._last_federation_ack))
        self._send_announcements()
        self.connected.set()
        logger.info("replication: connected to %s as %s", self._transport.description,
                    self.instance_name)

    def _send_announcements(self) -> None:
        if self._announce is not None:
            for command in self._announce():
                self.send(command)

    # --- dispatch ------------------------------------------------------------------

    async def _dispatch_batch(self, session: Session, batch: list[c.Command]) -> None:
        accept = self.positions.accept_rdata
        parsers = self._parsers
        me = self.instance_name
        on_rows = self._handler.on_rows
        dirty = self._dirty
        rdata = c.RdataCommand
        for command in batch:
            if type(command) is rdata:
                stream = command.stream_name
                parser = parsers.get(stream)
                if parser is None or command.instance_name == me:
                    if parser is None and stream not in SKIPPED_STREAMS:
                        self._note_unknown_stream(stream)
                    continue
                try:
                    row = parser(command.row)
                except ProtocolError as e:
                    if session.skips_bad_input:
                        logger.warning("replication: failed to parse an RDATA row, "
                                       "skipped: %s", e)
                        continue
                    session.abort(str(e))
                    raise
                key = (stream, command.instance_name)
                rows = accept(key, command.token, row)
                if rows is not None:
                    token = command.token
                    assert token is not None
                    await on_rows(stream, key[1], token, rows)
                    dirty[key] = token
            else:
                await self._dispatch_other(command)

    def _note_reset(self, stream: str, instance: str, before: int | None, token: int) -> None:
        """A writer's stream went backwards. Expected for the in-memory streams after
        the writer restarts (``typing``, ``federation``; Synapse resets them too); for a
        stream kept in the database (``events``) it means a restored database: rows
        written again below what we read are not read again, so it is a warning."""
        level = logging.WARNING if stream in PERSISTED_STREAMS else logging.INFO
        logger.log(
            level, "replication: %s/%s went backwards from %s to %d", stream, instance,
            before, token,
        )  # fmt: skip

    def _note_unknown_stream(self, stream: str) -> None:
        """One line per stream name we have never heard of (a newer Synapse, a typo)."""
        if stream in self._unknown_streams:
            return
        self._unknown_streams.add(stream)
        logger.warning(
            "replication: RDATA for unknown stream %r ignored (logged once per stream)",
            stream[:100],
        )

    async def _dispatch_other(self, command: c.Command) -> None:
        positions = self.positions
        if isinstance(command, c.PositionCommand):
            stream, instance = command.stream_name, command.instance_name
            if stream not in self._parsers or instance == self.instance_name:
                return
            before = positions.get(stream, instance)
            action = positions.on_position(stream, instance, command.prev_token, command.new_token)
            if isinstance(action, Fetch):
                await self._fill_gap(stream, instance, action)
            elif action is not None:
                if isinstance(action, Reset):
                    self._note_reset(stream, instance, before, action.token)
                await self._deliver(Update(stream, instance, action.token, ()))
        elif isinstance(command, c.HistoryCommand):
            if command.stream_name in self._parsers and positions.on_history(
                command.stream_name, command.instance_name, command.history_id, command.start_token
            ):
                logger.info(
                    "replication: %s/%s has a new history %s from %d",
                    command.stream_name,
                    command.instance_name,
                    command.history_id,
                    command.start_token,
                )
        elif isinstance(command, c.ReplicateCommand):
            self._send_announcements()
        elif isinstance(command, c.RemoteServerUpCommand):
            await self._handler.on_remote_server_up(command.server)
        elif isinstance(command, c.ErrorCommand):
            logger.warning("replication peer reported error: %s", command.message)

    async def _fill_gap(self, stream: str, instance: str, gap: Fetch) -> None:
        fetcher = self._fetchers.get(stream)
        if fetcher is None:
            self._note_gap(stream, instance, gap)
            self.positions.advance(stream, instance, gap.upto_token)
            await self._deliver(Update(stream, instance, gap.upto_token, ()))
            return
        async for update in fetch_gap(fetcher, stream, instance, gap.from_token, gap.upto_token):
            self.positions.advance(stream, instance, update.token)
            await self._deliver(update)

    def _note_gap(self, stream: str, instance: str, gap: Fetch) -> None:
        """One line saying what a gap no fetcher can fill skips; none when nothing is."""
        if stream in self._gap_notes:
            note = self._gap_notes[stream]
            if note is None:
                logger.debug("replication: %s/%s moved from %d to %d (nothing to fetch)",
                             stream, instance, gap.from_token, gap.upto_token)
                return
        else:
            note = ROWS_SKIPPED
        logger.log(note.level, "replication: %s/%s missed (%d, %d]: %s", stream, instance,
                   gap.from_token, gap.upto_token, note.skipped)

    async def _deliver(self, update: Update) -> None:
        await self._handler.on_rows(
            update.stream_name, update.instance_name, update.token, update.rows
        )
        self._dirty[(update.stream_name, update.instance_name)] = update.token

    async def _save_soon(self) -> None:
        """Save the finished positions now (``save_interval_s`` 0) or have the saver
        task save them at the end of the interval (one task per interval)."""
        if self._save_interval_s <= 0:
            await self._persist()
        elif self._saver is None or self._saver.done():
            self._saver = asyncio.ensure_future(self._save_later(self._save_interval_s))

    async def _save_later(self, delay_s: float) -> None:
        while True:
            await self._clock.sleep(delay_s)
            try:
                await self._persist()
            except Exception as e:  # kept unsaved; retried in delay_s
                logger.warning("replication: saving positions failed (%s); retried", e)
            if not self._dirty:  # else: updated while saving, or the save failed
                return

    async def _persist(self) -> None:
        """Save every finished position; one that cancellation or an error leaves
        unsaved stays in ``_dirty`` (a later update of its key replaces it there)."""
        for key, token in list(self._dirty.items()):
            await self._store.save(key[0], key[1], token)
            self.positions.mark_persisted(key[0], key[1], token)
            if self._dirty.get(key) == token:  # not updated while it was saved
                del self._dirty[key]

    async def _persist_on_exit(self) -> None:
        """Save the finished work when a session ends (or the client is stopped); a
        store that fails now (the database is what went away) leaves it to be
        redelivered."""
        saver, self._saver = self._saver, None
        if saver is not None and not saver.done():
            saver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await saver
        if not self._dirty:
            return
        try:
            await self._persist()
        except Exception as e:  # at-least-once: replayed next session
            logger.warning("replication: positions not saved (%s); the rows since the "
                           "last save will be delivered again", e)
