"""A Hypothesis state machine drives one sans-I/O DestinationCore against a model of the
remote (up/down, poison items, a size limit) and of the database (destination_rooms).

The remote may also answer 429 to everything for a while, with a hint of none, 0, a
negative, a tiny or a real number of seconds: after a 429 the next attempt waits at least
the shortest pause, and never more than 5 attempts fall in a minute of 429s.

A remote that is down (no answer) is retried in memory first, the short-retry phase:
within the phase's first 30 s no two attempts are more than 2 s apart; the phase ends
in a persisted backoff after at most its window's probes, Synapse's 10 long retries and
one retry per wake-up (REMOTE_SERVER_UP, which may come at any time); and a persisted
backoff after failures without an answer comes only once the window has passed.

The core also decides the runner's loop policy: with nothing in flight, nothing
paused and PDUs pending, the next step is a transaction at once (no hold of any length,
however many were sent just before), and it leaves sendable PDUs pending only when it
is full (the PDU or byte limit); an idle eviction exits only an empty queue; and a
queue that parks (exits for a long wait) owes nothing that catch-up from its persisted
position would not resend.

Pacing holds rooms (the model holds and releases any of them at any time, as the
receiver's confirmations would; an ``AwaitConfirmation`` step releases one): the PDUs
of a held room never go, and a queue waits for a confirmation only when every pending
PDU is of a held room and nothing else is to send. The composer
(``queue/core/composer.py``) keeps each room's order (a transaction carries the oldest
pending PDUs of each of its rooms) and serves every room: no room with sendable PDUs
goes without any for more than :data:`MAX_WAIT_TXNS` transactions in a row.

Some runs start in catch-up mode (as at startup), others outside it, so both delivery
paths are reached. The remote may be down (transient failures) or, from some point
until the end, refuse everything (400, even an empty transaction).

Checked throughout: one transaction in flight; limits; a txn id always names the same
content, and a retry after a transient failure reuses the txn id; the persisted
position never passes an undelivered PDU; an item is dropped only if it is poison or
too large (never because the destination refused everything). Checked at the end,
after the remote recovers: every PDU was delivered or, being poison, dropped; the
latest keyed EDU arrived.
"""

from __future__ import annotations

import itertools
import json
import random

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from federation_sender.queue.core.backoff import RATE_LIMIT_BASE_MS, RESET, BackoffPolicy
from federation_sender.queue.core.batching import TXN_OVERHEAD_BYTES, Limits
from federation_sender.queue.core.catchup import RoomPlan
from federation_sender.queue.core.destination import DestinationCore
from federation_sender.queue.core.effects import Effects
from federation_sender.queue.core.items import PduItem
from federation_sender.queue.core.steps import (
    AwaitConfirmation,
    Idle,
    NeedCatchup,
    NeedOutbox,
    ProbeReturn,
    Send,
    Wait,
)
from federation_sender.storage.events import EventRow
from federation_sender.transport.result import Outcome, SendResult

MAX_BODY_ITEMS = 120
IDLE_TTL_S = 60.0
ROOMS = [f"!r{i}" for i in range(7)]
MAX_WAIT_TXNS = 8
"""Transactions in a row a room with sendable PDUs may go without any (7 rooms: the
round-robin's bound, plus one for the live PDUs' share)."""


class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1_000_000
        ids = itertools.count()
        self.core = DestinationCore(
            "d.test", BackoffPolicy(), Limits(max_bytes=50_000), random.Random(0),
            lambda: f"t{next(ids)}", max_item_failures=3,
        )
        self.core.load(RESET, None)
        self.so = 0
        self.enqueued: dict[str, int] = {}
        self.db_rows: dict[str, tuple[int, EventRow]] = {}
        self.room_events: dict[str, list[EventRow]] = {}
        self.delivered: set[str] = set()
        self.dropped: set[str] = set()
        self.bad: set[str] = set()
        self.down = False
        self.last_probe_ms: int | None = None
        self.txn_contents: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {}
        self.keyed_latest: dict[str, int] = {}
        self.keyed_seen: dict[str, int] = {}
        self.position_seen = -1
        self.refusing = False
        self.rate_limiting: tuple[float | None] | None = None
        """(hint,) while the remote answers 429 to everything."""
        self.last_429_ms: int | None = None
        self.attempts_in_429s: list[int] = []
        self.phase_start: int | None = None
        """Model of the short-retry phase: the time of its first failure."""
        self.phase_attempts = 0
        self.phase_wakes = 0
        self.last_failure_ms = 0
        self.woken = False
        """Woken since the last step: the state is still the wait's until the next."""
        self.retry_of: str | None = None
        """The txn id of a transaction that failed transiently: the next send reuses it."""
        self.held: set[str] = set()
        """Rooms pacing holds (the core reads this very set)."""
        self.core.held_rooms = self.held
        self.batched: set[str] = set()
        """PDUs that were in a transaction."""
        self.starved: dict[str, int] = {}
        """room -> new transactions in a row it had sendable PDUs and got none."""

    @initialize(catching_up=st.booleans())
    def start(self, catching_up: bool) -> None:
        self.core.episode.active = catching_up

    # --- inputs ---------------------------------------------------------------------------

    @rule(n=st.integers(1, 70), size=st.sampled_from([100, 2_000]))
    def enqueue_pdus(self, n: int, size: int) -> None:
        for _ in range(n):
            self.so += 1
            eid = f"$e{self.so}"
            room = ROOMS[self.so % len(ROOMS)]
            body = json.dumps({"event_id": eid, "pad": "x" * size})
            self.enqueued[eid] = self.so
            row = EventRow(self.so, eid, room, "m", None, "@a:l", False, False, body)
            self.db_rows[room] = (self.so, row)
            self.room_events.setdefault(room, []).append(row)
            self.core.add_pdu(PduItem(self.so, eid, room, json.loads(body), len(body)))

    @rule(key=st.sampled_from(["!a", "!b", "!c"]), v=st.integers(0, 10**6))
    def enqueue_keyed(self, key: str, v: int) -> None:
        if self.core.catching_up:
            return
        self.core.add_edu("m.typing", {"room_id": key, "v": v}, key=key)
        self.keyed_latest[key] = v

    @rule(n=st.integers(1, 150))
    def enqueue_other_edus(self, n: int) -> None:
        for i in range(n):
            self.core.add_edu("m.other", {"i": i})

    @rule(room=st.sampled_from(ROOMS))
    def hold(self, room: str) -> None:
        """The receiver has not confirmed enough of the room's PDUs."""
        self.held.add(room)

    @rule(room=st.sampled_from(ROOMS))
    def confirm(self, room: str) -> None:
        self.held.discard(room)

    @rule()
    def toggle_down(self) -> None:
        self.down = not self.down

    @precondition(lambda self: not self.refusing)
    @rule()
    def start_refusing(self) -> None:
        """From now until the end, the remote refuses everything: nothing gets through,
        so nothing may be blamed on an item (a destination alternating between refusing
        and accepting everything is indistinguishable from poison items, and is not
        modelled)."""
        self.refusing = True

    @rule(hint=st.sampled_from([None, 0.0, -1.0, -1e9, 1e-6, 0.001, 0.5, 30.0]))
    def start_rate_limiting(self, hint: float | None) -> None:
        self.rate_limiting = (hint,)

    @rule()
    def stop_rate_limiting(self) -> None:
        self.rate_limiting = None

    @rule()
    def wake(self) -> None:
        """REMOTE_SERVER_UP or main's invalidation of the retry timings."""
        self.woken = self.core.clear_backoff() or self.woken
        # A wake-up also ends a 429's pause (as an operator's reset does).
        self.last_429_ms = None
        self.attempts_in_429s = []
        if self.phase_start is not None:
            self.phase_wakes += 1

    @rule(idle_s=st.sampled_from([0.0, IDLE_TTL_S - 1, IDLE_TTL_S]))
    def evict_if_idle(self, idle_s: float) -> None:
        """The housekeeping asks a queue idle for ``idle_s`` to exit."""
        c = self.core
        now_s = self.now / 1000
        c.idle_started(now_s)
        empty = c.is_empty()
        asked = c.evict_if_idle(now_s + idle_s, IDLE_TTL_S)
        # The idle time as the policy sees it: (now + idle) - now, which can be a ulp
        # under idle_s in floating point (Hypothesis found 60.0 read as 59.99999...).
        assert asked == (empty and (now_s + idle_s) - now_s >= IDLE_TTL_S)
        exits = c.idle_ended()
        assert exits == asked
        if exits:
            assert c.pending_pdus == 0 and c.pending_edus == 0 and c.current is None

    @precondition(lambda self: len(self.bad) < 3)
    @rule(data=st.data())
    def poison(self, data: st.DataObject) -> None:
        candidates = sorted(set(self.enqueued) - self.delivered - self.dropped)
        if candidates:
            self.bad.add(data.draw(st.sampled_from(candidates)))

    # --- the remote and the shell -------------------------------------------------------

    def respond(self, pdus: tuple[str, ...], edus: int) -> SendResult:
        if self.rate_limiting is not None:
            return SendResult(Outcome.TRANSIENT, status=429, error="HTTP 429",
                              retry_after_s=self.rate_limiting[0])
        if self.down:
            return SendResult(Outcome.TRANSIENT, error="down")
        if self.refusing:
            return SendResult(Outcome.PERMANENT, status=400, error="refuses everything")
        if len(pdus) + edus > MAX_BODY_ITEMS:
            return SendResult(Outcome.TOO_LARGE, status=413)
        if self.bad & set(pdus):
            return SendResult(Outcome.PERMANENT, status=400, error="bad")
        return SendResult(Outcome.SUCCESS, status=200, duration_s=0.1)

    @rule(steps=st.integers(1, 40))
    def run(self, steps: int) -> None:
        for _ in range(steps):
            if not self.step():
                return

    def sends_at_once(self) -> dict[str, list[PduItem]] | None:
        """The pending PDUs of rooms not held, per room in order, when the next step
        must send some now: nothing in flight, paused, owed to catch-up or isolation,
        no outbox read due."""
        c = self.core
        retry_at = c.retry_at_ms()
        ready = (c.current is None and not c.work and not c.catching_up
                 and not c.outbox_dirty and not c.stopped and bool(c.pending.pdus)
                 and (retry_at is None or retry_at <= self.now) and not c.isolation)
        if not ready:
            return None
        rooms: dict[str, list[PduItem]] = {}
        for p in c.pending.pdus:
            if p.room_id not in self.held:
                rooms.setdefault(p.room_id, []).append(p)
        return rooms or None

    def check_sent_at_once(self, sendable: dict[str, list[PduItem]], s: object) -> None:
        """Something goes now; each room's oldest PDUs first; a sendable PDU is left only
        when the transaction is full; no room waits too long."""
        c = self.core
        assert isinstance(s, Send), ("held back", s)
        b = s.txn.batch
        assert b.pdus, "sendable PDUs, and none sent"
        got: dict[str, list[PduItem]] = {}
        for p in b.pdus:
            got.setdefault(p.room_id, []).append(p)
        for room, items in got.items():
            assert items == sendable[room][:len(items)], ("a room's order", room)
        full = len(b.pdus) == c.limits.max_pdus
        pdu_bytes = TXN_OVERHEAD_BYTES + sum(p.size + 1 for p in b.pdus)
        for room, items in sendable.items():
            n = len(got.get(room, ()))
            if n < len(items) and not full:
                assert pdu_bytes + items[n].size + 1 > c.limits.max_bytes, (
                    "a sendable PDU left behind in a transaction with room", room)
        for room in list(self.starved):
            if room not in sendable:
                del self.starved[room]
        for room in sendable:
            if room in got:
                self.starved.pop(room, None)
            else:
                self.starved[room] = self.starved.get(room, 0) + 1
                assert self.starved[room] <= MAX_WAIT_TXNS, ("a room starves", room)

    def step(self) -> bool:
        c = self.core
        self.woken = False
        sendable = self.sends_at_once()
        s = c.next_step(self.now)
        if sendable is not None:
            self.check_sent_at_once(sendable, s)
        if isinstance(s, Idle):
            return False
        if isinstance(s, AwaitConfirmation):
            # Only held rooms' PDUs are left, and nothing else to send.
            plans = c.episode.plans
            assert all(p.room_id in self.held for p in c.pending.pdus)
            assert not c.pending.has_edus() and not c.work and c.current is None
            assert c.pending.pdus or (plans and plans[0].room_id in self.held)
            # The confirmation of one of them comes.
            self.held.discard(sorted(self.held)[0])
            self.now += 1
            return True
        if isinstance(s, Wait):
            assert s.until_ms > self.now
            if c.parks((s.until_ms - self.now) / 1000, IDLE_TTL_S):
                # The runner would exit: what it owes is above the persisted position.
                owed = set(self.enqueued) - self.delivered - self.dropped
                assert all(self.enqueued[e] > c.last_successful for e in owed)
            self.now = s.until_ms
        elif isinstance(s, NeedOutbox):
            c.add_outbox([], [], True)
        elif isinstance(s, ProbeReturn):
            # The return probe: only in a persisted backoff, with something owed, down
            # under an hour, and at most one a minute whatever happens in between.
            b = c.backoff
            assert b.active_at(self.now) and not c.catching_up
            assert c.current is not None or c.work or c.pending, "a probe with nothing owed"
            down_since = b.failure_ts_ms if b.failure_ts_ms is not None else b.retry_last_ts_ms
            assert self.now - down_since < 3_600_000
            if self.last_probe_ms is not None:
                assert self.now - self.last_probe_ms >= 60_000, "probes too close"
            self.last_probe_ms = self.now
            event("return probe")
            c.on_return_probe(not self.down, self.now)  # /version answers unless down
            self.now += 1
        elif isinstance(s, NeedCatchup):
            rows = sorted((so, room, e) for room, (so, e) in self.db_rows.items()
                          if room not in s.skip_rooms and (so > s.cursor[0] or (
                              so == s.cursor[0] and s.cursor[1] is not None
                              and room > s.cursor[1])))[:5]
            # The planner replays the room's missed events, oldest first.
            plans = [
                RoomPlan(room, so, tuple(x for x in self.room_events[room]
                                         if s.after < x.stream_ordering <= so), False, "gap")
                for so, room, _e in rows
            ]
            if s.skip_rooms:
                # A read beside rooms awaiting their confirmation (held ones only).
                assert set(s.skip_rooms) <= self.held, s.skip_rooms
                event("read beside held rooms")
                c.offer_catchup(plans, side=True, limit=5)
            elif plans:
                c.offer_catchup(plans)
            else:
                c.catchup_finished()
        elif isinstance(s, Send):
            t = s.txn
            b = t.batch
            assert len(b.pdus) <= 50 and len(b.edus) <= 100
            # A PDU in a transaction for the first time is never of a held room
            # (retries, splits and quarantine probes resend what was built before).
            for p in b.pdus:
                if p.event_id not in self.batched:
                    assert p.room_id not in self.held, ("a held room's PDU sent", p.room_id)
                    self.batched.add(p.event_id)
            content = (tuple(p.event_id for p in b.pdus), tuple(e.uid for e in b.edus))
            prev = self.txn_contents.setdefault(t.txn_id, content)
            assert prev == content, "a txn id must always carry the same content"
            if self.retry_of is not None:
                assert t.txn_id == self.retry_of, "a retry must reuse the txn id"
            if self.last_429_ms is not None:
                assert self.now - self.last_429_ms >= RATE_LIMIT_BASE_MS, "429 storm"
            if self.phase_start is not None and self.last_429_ms is None:
                self.phase_attempts += 1
                if self.last_failure_ms - self.phase_start < 30_000:
                    assert self.now - self.last_failure_ms <= 2_000, "probe too late"
                assert self.phase_attempts <= 75 + 10 + self.phase_wakes, "phase never ends"
            res = self.respond(content[0], len(b.edus))
            if res.status == 429:
                self.last_429_ms = self.now
                self.attempts_in_429s = [t for t in self.attempts_in_429s
                                         if t > self.now - 60_000] + [self.now]
                assert len(self.attempts_in_429s) <= 5, self.attempts_in_429s
            else:
                self.last_429_ms = None
                self.attempts_in_429s = []
            backing_off = c.backoff.backing_off
            eff = c.on_result(t, res, self.now)
            self.check_phase(res, eff, backing_off)
            self.retry_of = None
            if eff.backoff is not None and eff.backoff.backing_off:
                # A failure keeps the frozen transaction for an identical retry; only a
                # fall back to catch-up (a backoff past an hour) may drop it.
                if c.current is not None:
                    assert c.current.txn_id == t.txn_id
                    self.retry_of = t.txn_id
                else:
                    assert c.catching_up and self.core.policy.should_catch_up(c.backoff)
            if res.outcome is Outcome.SUCCESS:
                self.delivered.update(content[0])
                for e in b.edus:
                    if e.edu_type == "m.typing":
                        self.keyed_seen[e.content["room_id"]] = e.content["v"]
            if eff.entered_catchup or eff.dropped_for_catchup:
                self.keyed_latest.clear()  # volatile EDUs are given up on catch-up
            for item, reason in eff.dropped:
                eid = getattr(item, "event_id", None)
                if eid is not None:
                    assert reason == "too_large" or eid in self.bad, (eid, reason)
                    self.dropped.add(eid)
            self.now += 1
        return True

    def check_phase(self, res: SendResult, eff: Effects, backing_off: bool) -> None:
        """``backing_off``: a persisted backoff was in force before this result (then
        a failure extends it, with no new phase)."""
        unanswered = res.outcome is Outcome.TRANSIENT and res.status is None
        persisted = eff.backoff is not None and eff.backoff.backing_off
        if unanswered and persisted and not backing_off:
            assert self.phase_start is not None, "backed off at the first failure"
        if unanswered and not persisted:
            assert eff.short_retry_ms is not None
            if self.phase_start is None:
                assert eff.short_retry_started
                self.phase_start = self.now
                self.phase_attempts = self.phase_wakes = 0
            self.last_failure_ms = self.now
            return
        if persisted and unanswered and self.phase_start is not None:
            assert self.now - self.phase_start >= 30_000, "backed off inside the window"
        # Backed off, or answered (a 429 too: the destination is up): the phase is over.
        self.phase_start = None
        assert not self.core.short_retry.in_phase

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def position_never_passes_an_undelivered_pdu(self) -> None:
        pos = self.core.last_successful
        assert pos >= self.position_seen
        self.position_seen = pos
        for eid, so in self.enqueued.items():
            if eid not in self.delivered and eid not in self.dropped:
                assert so > pos, (eid, so, pos)

    @invariant()
    def state_matches_backoff(self) -> None:
        from federation_sender.queue.core.states import DestinationState as S
        if self.core.sm.state is S.BACKING_OFF and not self.woken:  # a backoff, a pause
            assert (self.core.backoff.backing_off or self.core.rate_limit.until_ms
                    or self.core.short_retry.until_ms)

    def teardown(self) -> None:
        self.held.clear()
        self.down = False
        self.rate_limiting = None
        if self.refusing:
            # Long enough for every held item to be refused alone many times over.
            for _ in range(300):
                if not self.step():
                    break
        self.refusing = False
        for _ in range(20_000):
            if not self.step():
                break
        else:
            raise AssertionError("queue did not settle")
        missing = set(self.enqueued) - self.delivered - self.dropped
        assert not missing, sorted(missing, key=self.enqueued.__getitem__)[:5]
        if not self.core.catching_up:
            for k, v in self.keyed_latest.items():
                assert self.keyed_seen.get(k) == v, (k, v, self.keyed_seen.get(k))


CoreMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCoreMachine = CoreMachine.TestCase


def test_the_docs_list_the_next_step_table_in_order() -> None:
    """docs/queue-engine.md's list is :data:`NEXT_STEP`'s rows, in their order."""
    from pathlib import Path

    from federation_sender.queue.core.destination import NEXT_STEP

    doc = (Path(__file__).parents[2] / "docs" / "queue-engine.md").read_text()
    block = doc.split("<!-- NEXT_STEP -->\n", 1)[1].split("<!-- /NEXT_STEP -->", 1)[0]
    listed = [line.split(". ", 1)[1] for line in block.strip().splitlines()]
    assert listed == [rule.name for rule in NEXT_STEP]
