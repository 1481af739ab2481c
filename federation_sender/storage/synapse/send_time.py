"""Erasures and valid redactions of a transaction's PDUs, from a Synapse database.

Asked once per transaction just before it goes out (``queue/send_time.py``): one
statement, one round trip (the connection in autocommit: no ``BEGIN``, no ``COMMIT``),
whatever the number of PDUs (at most 50). Questions asked while a read runs are
gathered into the next one (up to :data:`MAX_GATHERED_EVENTS` events): in a spike the
queues of a room's 415 servers ask about the same PDUs at once, and one statement
answers them all. Each answer is still as fresh as a read started after its question.
The statement reads

* ``erased_users``: which of the transaction's senders were erased;
* the redactions of the transaction's events, valid as Synapse applies one when it reads
  an event (``_maybe_redact_event_row`` in its ``events_worker.py``): a ``redactions``
  row for the event, or an MSC4293 ``room_ban_redactions`` row for its room and sender
  (not past its ``redact_end_ordering``), whose redacting event is in ``events`` and
  ``event_json``, is not in ``rejections``, is in the same room, and, when its internal
  metadata says it needs a recheck (``recheck_redaction``: a room v3+ redaction by a
  sender without the power to redact), comes from the redacted event's sender's server.
  An ``m.room.create`` event is never redacted (Synapse ignores such redactions);
* ``rooms.room_version`` of the rooms of the redacted events (the algorithm depends on it).

One corner is stricter than Synapse: a redaction its ``redactions.recheck`` column
records as checked is applied there without looking at the redacting event; here it
too must be in the redacted event's room and not rejected, which every redaction Synapse
accepts at persistence is. The ``recheck`` column itself is not read: it is new in
Synapse's schema 94 and derived from the same internal metadata read here.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Collection

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from federation_sender.storage.engine import run_in_transaction
from federation_sender.storage.protocols import NOTHING_CHANGED, SendTimeFacts

__all__ = ["MAX_GATHERED_EVENTS", "SynapseSendTime", "send_time_facts"]

MAX_GATHERED_EVENTS = 1000
"""At most this many distinct event ids in one gathered read (a question alone may
have more: it is then read alone)."""

_RECHECK = r'[{,]\s*"recheck_redaction"\s*:\s*true'
"""``recheck_redaction: true`` as a key of the internal metadata's top-level object (a
string value cannot hold an unescaped quote after ``{`` or ``,``). A pattern rather
than a cast to ``jsonb``: one unparsable row must not fail the transaction's read."""

# The domain of a user id, as Synapse's ``get_domain_from_id``: after the first colon.
_DOMAIN = "substring({0} FROM position(':' IN {0}) + 1)"

_FACTS = text(f"""
    WITH batch AS (
        SELECT e.event_id, e.room_id, e.sender, e.stream_ordering
        FROM events e
        WHERE e.event_id = ANY(CAST(:events AS TEXT[])) AND e.type <> 'm.room.create'
    ),
    candidates AS (
        SELECT b.event_id, b.room_id, b.sender, r.event_id AS redaction_id
        FROM batch b JOIN redactions r ON r.redacts = b.event_id
        UNION ALL
        SELECT b.event_id, b.room_id, b.sender, rb.redacting_event_id
        FROM batch b JOIN room_ban_redactions rb
            ON rb.room_id = b.room_id AND rb.user_id = b.sender
        WHERE coalesce(rb.redact_end_ordering, 0) = 0
            OR b.stream_ordering < rb.redact_end_ordering
    ),
    valid AS (
        SELECT DISTINCT c.event_id, c.room_id
        FROM candidates c
        JOIN events x ON x.event_id = c.redaction_id
        JOIN event_json xj ON xj.event_id = c.redaction_id
        WHERE x.room_id = c.room_id
            AND NOT EXISTS (SELECT 1 FROM rejections j WHERE j.event_id = c.redaction_id)
            AND ({_DOMAIN.format("x.sender")} = {_DOMAIN.format("c.sender")}
                 OR coalesce(xj.internal_metadata, '') !~ :recheck)
    )
    SELECT 'erased', u.user_id, NULL FROM erased_users u
    WHERE u.user_id = ANY(CAST(:senders AS TEXT[]))
    UNION ALL
    SELECT 'redacted', v.event_id, rm.room_version
    FROM valid v LEFT JOIN rooms rm ON rm.room_id = v.room_id
""")  # fmt: skip


async def send_time_facts(
    conn: AsyncConnection, event_ids: Collection[str], senders: Collection[str]
) -> SendTimeFacts:
    """The facts of these events and senders: one statement."""
    erased: set[str] = set()
    redacted: dict[str, str | None] = {}
    rows = await conn.execute(_FACTS, {"events": sorted(set(event_ids)),
                                       "senders": sorted(set(senders)),
                                       "recheck": _RECHECK})  # fmt: skip
    for kind, key, version in rows:
        if kind == "erased":
            erased.add(str(key))
        else:
            redacted[str(key)] = None if version is None else str(version)
    if not erased and not redacted:
        return NOTHING_CHANGED
    return SendTimeFacts(frozenset(erased), redacted)


_Question = tuple[frozenset[str], frozenset[str], "asyncio.Future[SendTimeFacts]"]


def _part(facts: SendTimeFacts, event_ids: frozenset[str], senders: frozenset[str]
          ) -> SendTimeFacts:
    """What of a gathered read's ``facts`` one question asked about."""
    erased = facts.erased_senders & senders
    redacted = {e: v for e, v in facts.redacted.items() if e in event_ids}
    if not erased and not redacted:
        return NOTHING_CHANGED
    return SendTimeFacts(erased, redacted)


class SynapseSendTime:
    """Implements :class:`federation_sender.storage.protocols.SendTimeReader` on its own
    autocommit view of the backend's engine (same pool), retried as transactions are;
    one read at a time, the questions asked meanwhile gathered into the next."""

    __slots__ = ("_engine", "_questions", "_reader", "reads")

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._questions: deque[_Question] = deque()
        self._reader: asyncio.Future[None] | None = None
        self.reads = 0
        """Statements run (for tests and benchmarks)."""

    async def send_time_facts(
        self, event_ids: Collection[str], senders: Collection[str]
    ) -> SendTimeFacts:
        if not event_ids and not senders:
            return NOTHING_CHANGED
        fut: asyncio.Future[SendTimeFacts] = asyncio.get_running_loop().create_future()
        self._questions.append((frozenset(event_ids), frozenset(senders), fut))
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._read_all())
        return await fut

    def _take(self) -> list[_Question]:
        """The oldest questions whose events fit :data:`MAX_GATHERED_EVENTS` (one at least)."""
        taken: list[_Question] = []
        events: set[str] = set()
        questions = self._questions
        while questions:
            ids = questions[0][0]
            if taken and len(events) + len(ids - events) > MAX_GATHERED_EVENTS:
                break
            events |= ids
            taken.append(questions.popleft())
        return taken

    async def _read(self, events: frozenset[str], senders: frozenset[str]) -> SendTimeFacts:
        self.reads += 1
        return await run_in_transaction(
            self._engine, lambda conn: send_time_facts(conn, events, senders)
        )

    async def _read_all(self) -> None:
        while self._questions:
            taken = [q for q in self._take() if not q[2].done()]  # cancelled: not asked
            if not taken:
                continue
            events = frozenset().union(*(q[0] for q in taken))
            senders = frozenset().union(*(q[1] for q in taken))
            try:
                facts = await self._read(events, senders)
            except Exception as e:  # each asker raises it; the next read is a new try
                for _, _, fut in taken:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            alone = len(taken) == 1 or facts is NOTHING_CHANGED
            for ids, who, fut in taken:
                if not fut.done():
                    fut.set_result(facts if alone else _part(facts, ids, who))
