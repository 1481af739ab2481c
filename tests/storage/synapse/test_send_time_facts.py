"""The send-time read (``storage/synapse/send_time.py``) on a schema Synapse made itself:
each rule of a valid redaction as Synapse applies one when it reads an event, erased
senders, room versions, and one statement per call however many events; the native
backend answers without any statement."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.engine import create_engine
from federation_sender.storage.protocols import NOTHING_CHANGED
from federation_sender.storage.synapse.send_time import SynapseSendTime
from federation_sender.testing.waiting import wait_until
from tests.synapse.backend_support import (  # noqa: F401
    synapse_db_url_fixture,
    synapse_engine_fixture,
    synapse_template_fixture,
)

pytestmark = pytest.mark.postgres

ME = "a.test"
R10, R11, OTHER = "!r10:a.test", "!r11:a.test", "!other:a.test"
RECHECK = json.dumps({"recheck_redaction": True, "stream_ordering": 1})


@contextmanager
def statements(engine: AsyncEngine) -> Iterator[list[str]]:
    """The SQL statements run on ``engine`` inside the block."""
    seen: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", count)


class Rows:
    """Rows in Synapse's tables, as its persistence writes them (the columns we read)."""

    def __init__(self) -> None:
        self.so = 0
        self.sql: list[tuple[str, dict[str, Any]]] = []

    def room(self, room_id: str, version: str | None) -> None:
        self.sql.append(("INSERT INTO rooms (room_id, is_public, creator, room_version) "
                         "VALUES (:r, false, '@c:a.test', :v)", {"r": room_id, "v": version}))

    def event(self, event_id: str, room_id: str, sender: str, event_type: str = "m.room.message",
              metadata: str = "{}", redacts: str | None = None) -> int:
        self.so += 1
        so = self.so
        self.sql.append((
            "INSERT INTO events (topological_ordering, event_id, type, room_id, processed, "
            "outlier, depth, origin_server_ts, received_ts, sender, instance_name, "
            "stream_ordering) VALUES (:so, :e, :t, :r, true, false, :so, :so, :so, :s, "
            "'master', :so)", {"so": so, "e": event_id, "t": event_type, "r": room_id,
                               "s": sender}))  # fmt: skip
        pdu = {"type": event_type, "room_id": room_id, "sender": sender, "content": {}}
        self.sql.append((
            "INSERT INTO event_json (event_id, room_id, internal_metadata, json, "
            "format_version) VALUES (:e, :r, :m, :j, 3)",
            {"e": event_id, "r": room_id, "m": metadata, "j": json.dumps(pdu)}))
        if redacts is not None:
            self.redaction_row(event_id, redacts)
        return so

    def redaction_row(self, event_id: str, redacts: str) -> None:
        self.sql.append(("INSERT INTO redactions (event_id, redacts, received_ts) "
                         "VALUES (:e, :x, 0)", {"e": event_id, "x": redacts}))

    def redaction(self, event_id: str, room_id: str, sender: str, redacts: str,
                  metadata: str = "{}") -> int:
        return self.event(event_id, room_id, sender, "m.room.redaction", metadata, redacts)

    def reject(self, event_id: str) -> None:
        self.sql.append(("INSERT INTO rejections (event_id, reason, last_check) "
                         "VALUES (:e, 'auth_error', '0')", {"e": event_id}))

    def erase(self, user_id: str) -> None:
        self.sql.append(("INSERT INTO erased_users (user_id) VALUES (:u)", {"u": user_id}))

    def ban_redaction(self, room_id: str, user_id: str, ban_id: str, end: int | None) -> None:
        self.sql.append((
            "INSERT INTO room_ban_redactions (room_id, user_id, redacting_event_id, "
            "redact_end_ordering) VALUES (:r, :u, :b, :end)",
            {"r": room_id, "u": user_id, "b": ban_id, "end": end}))

    async def write(self, engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            for sql, params in self.sql:
                await conn.execute(text(sql), params)


async def test_each_rule_of_a_valid_redaction_and_erased_senders(
    synapse_engine: AsyncEngine,
) -> None:
    w = Rows()
    w.room(R10, "10")
    w.room(R11, "11")
    w.room(OTHER, "10")
    alice, mod, eve = "@alice:a.test", "@mod:b.test", "@eve:a.test"
    asked = []

    def msg(event_id: str, room_id: str = R10, sender: str = alice,
            event_type: str = "m.room.message") -> str:
        w.event(event_id, room_id, sender, event_type)
        asked.append(event_id)
        return event_id

    # Redacted by its sender's server, a recheck asked for: valid.
    same_server = msg("$same")
    w.redaction("$r-same", R10, "@alice2:a.test", same_server, RECHECK)
    # By another server's user without the power to redact (a recheck): not valid.
    other_server = msg("$other")
    w.redaction("$r-other", R10, mod, other_server, RECHECK)
    # By another server's moderator (no recheck asked for): valid.
    moderator = msg("$moderator")
    w.redaction("$r-mod", R10, mod, moderator)
    # A rejected redaction, one in another room, one Synapse does not hold: not valid.
    rejected = msg("$rejected")
    w.redaction("$r-rejected", R10, alice, rejected)
    w.reject("$r-rejected")
    elsewhere = msg("$elsewhere")
    w.redaction("$r-elsewhere", OTHER, alice, elsewhere)
    dangling = msg("$dangling")
    w.redaction_row("$r-missing", dangling)
    # A create event is never redacted.
    create = msg("$create", event_type="m.room.create")
    w.redaction("$r-create", R10, alice, create)
    # Two redactions, the first not valid: redacted once, in a v11 room.
    twice = msg("$twice", R11)
    w.redaction("$r-twice-bad", R11, mod, twice, RECHECK)
    w.redaction("$r-twice-good", R11, alice, twice)
    # MSC4293: a ban that redacts the banned user's events up to where it ended.
    bob, carol = "@bob:a.test", "@carol:a.test"
    bobs = msg("$bob", R11, bob)
    carol_before = msg("$carol-before", R11, carol)
    w.event("$ban-bob", R11, "@alice:a.test", "m.room.member")
    w.event("$ban-carol", R11, "@alice:a.test", "m.room.member")
    end = w.event("$unban-carol", R11, "@alice:a.test", "m.room.member")
    carol_after = msg("$carol-after", R11, carol)
    w.ban_redaction(R11, bob, "$ban-bob", None)
    w.ban_redaction(R11, carol, "$ban-carol", end)
    # Not redacted at all; and an erased sender.
    plain = msg("$plain")
    erased = msg("$eve", R11, eve)
    w.erase(eve)
    w.erase("@someone-else:a.test")
    await w.write(synapse_engine)

    reader = SynapseSendTime(synapse_engine)
    with statements(synapse_engine) as seen:
        facts = await reader.send_time_facts(asked, {alice, mod, eve, bob, carol})
    assert len(seen) == 1, seen
    assert facts.erased_senders == {eve}
    assert facts.redacted == {same_server: "10", moderator: "10", twice: "11", bobs: "11",
                              carol_before: "11"}  # fmt: skip
    assert not {other_server, rejected, elsewhere, dangling, create, carol_after, plain,
                erased} & set(facts.redacted)  # fmt: skip


async def test_one_statement_for_a_full_transaction_and_none_for_nothing(
    synapse_engine: AsyncEngine,
) -> None:
    w = Rows()
    w.room(R10, "10")
    ids = [f"$m{i}" for i in range(50)]
    for i, event_id in enumerate(ids):
        w.event(event_id, R10, f"@u{i}:a.test")
    w.redaction("$r", R10, "@u7:a.test", "$m7")
    await w.write(synapse_engine)
    reader = SynapseSendTime(synapse_engine)
    with statements(synapse_engine) as seen:
        facts = await reader.send_time_facts(ids, {f"@u{i}:a.test" for i in range(50)})
        nothing = await reader.send_time_facts([], [])
        unknown = await reader.send_time_facts(["$not-here"], ["@nobody:a.test"])
    assert len(seen) == 2, seen  # none for the empty question
    assert facts.redacted == {"$m7": "10"} and not facts.erased_senders
    assert nothing is NOTHING_CHANGED and unknown is NOTHING_CHANGED


async def test_questions_asked_together_share_one_statement_each_its_own_answer(
    synapse_engine: AsyncEngine,
) -> None:
    """The queues of a room's servers ask about the same PDUs at once (a spike): one
    read runs, the questions asked meanwhile are answered by the next one, each with
    the facts of its own events and senders only."""
    w = Rows()
    w.room(R10, "10")
    for i in range(40):
        w.event(f"$m{i}", R10, f"@u{i % 4}:a.test")
    w.redaction("$r", R10, "@u1:a.test", "$m1")
    w.erase("@u2:a.test")
    await w.write(synapse_engine)
    reader = SynapseSendTime(synapse_engine)
    questions = [([f"$m{i}" for i in range(k, k + 10)], {f"@u{j}:a.test" for j in (k % 4,)})
                 for k in range(30)]  # fmt: skip
    with statements(synapse_engine) as seen:
        together = await asyncio.gather(*(reader.send_time_facts(ids, who)
                                          for ids, who in questions))
        assert len(seen) == reader.reads == 1, seen  # all asked before the read began
        # Asked while a read runs: the next read answers them all.
        first = asyncio.ensure_future(reader.send_time_facts(*questions[0]))
        await wait_until(lambda: reader.reads, "the second read", accept=lambda n: n == 2,
                         timeout_s=10)
        meanwhile = await asyncio.gather(*(reader.send_time_facts(ids, who)
                                           for ids, who in questions[1:]))
        answers = [await first, *meanwhile]
    assert len(seen) == reader.reads == 3, seen
    assert answers == together
    for (ids, who), facts in zip(questions, answers, strict=True):
        assert facts.redacted == ({"$m1": "10"} if "$m1" in ids else {})
        assert facts.erased_senders == ({"@u2:a.test"} & who)


async def test_the_native_backend_answers_nothing_without_a_statement(sqlite_url: str) -> None:
    engine = create_engine(sqlite_url)
    try:
        with statements(engine) as seen:
            facts = await NativeBackend(engine).send_time_facts(["$a"], ["@a:a.test"])
        assert facts is NOTHING_CHANGED and seen == []
    finally:
        await engine.dispose()
