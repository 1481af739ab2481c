"""Grammar-aware fuzzing of the replication parser, row parsers and connection.

The tests in ``tests/replication`` feed random *bytes*, which rarely get past the
command name. These generate lines from the protocol's grammar and then break them:
real command names with wrong arity, integers that ``int()`` accepts but the protocol
does not (``+1``, ``1_0``, Unicode digits, 10^30), JSON that Python accepts but JSON
does not (``NaN``, lone surrogates, 1e999), deep nesting, stray ``\\r``, chunk
boundaries anywhere. The rule, as h11's: any input parses or raises the one
:class:`ProtocolError`; whatever parses re-serialises to a line that parses to the same
command; the connection's own output is always valid protocol.

Hypothesis generates a few hundred structured examples a second, too few for a
million inputs in reasonable time, so two tests are mutational: each Hypothesis example
is a seed from which a fast mutator derives many inputs from a corpus (Synapse
captures plus the grammar's own lines) by byte flips, splices, token swaps and
truncation. Default: seconds. ``FUZZ_LONG=1``: 10,000 examples per grammar test
and 600 seeds x 2,000 mutants per mutational test, over 2,400,000 inputs in all
(``FUZZ_EXAMPLES`` overrides the example count); the counts are printed at the end of
the module (``pytest -s``).
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections import Counter
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from federation_sender.errors import ProtocolError
from federation_sender.intake.streams import ROW_PARSERS, parse_row
from federation_sender.replication import commands as c
from federation_sender.replication.connection import (
    Limits,
    ReplicationConnection,
    Role,
)
from federation_sender.testing.captures import captures_dir
from federation_sender.testing.clock import FakeClock

LONG = bool(os.environ.get("FUZZ_LONG"))
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", 0)) or (10_000 if LONG else 200)
MUTANTS_PER_EXAMPLE = 2_000 if LONG else 50
"""The mutational tests make this many inputs from each Hypothesis example (a seed)..."""
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None if LONG else settings.default.database,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)
MUTANT_SEEDS = settings(FUZZ, max_examples=600 if LONG else EXAMPLES)
"""... from this many seeds: 1,200,000 inputs each in the long mode."""
INPUTS: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_inputs() -> Iterator[None]:
    yield
    if LONG:
        total = sum(INPUTS.values())
        sys.stderr.write(f"\nreplication fuzz inputs: {dict(INPUTS)} total={total}\n")


# --- the grammar, and ways to break it -------------------------------------------------

NAMES = [*c._PARSERS, *c.IGNORED_NAMES, "NEW_THING", "rdata", "Rdata", "RDATA\t", "", "POSITION:"]
STREAMS = [*ROW_PARSERS, "federation", "unknown_stream", ""]

ints = st.one_of(
    st.integers(min_value=-5, max_value=10**6).map(str),
    st.sampled_from(["0", "-0", "+1", "1_000", "0x10", "1e3", "\u0661\u0662", "\u00b2",
                     "\uff11", " 1", "1 ", "9" * 21, "-" + "9" * 20, "18446744073709551616",
                     "-", "", "None",
                     "batch", "NaN"]),
)
words = st.one_of(
    st.sampled_from(["master", "fed1", "events", "hist-1", "@u:hs", "None", "start", "end",
                     "a b", "", "\u2028", "é", "\x00", "x" * 300]),
    st.text(min_size=0, max_size=12),
)
json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=10),
)
json_values = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner,
                                                               max_size=5),
    max_leaves=20,
)


@st.composite
def json_texts(draw: st.DrawFn) -> str:
    """Valid compact JSON, or JSON broken in a way some decoder might accept."""
    kind = draw(st.integers(0, 9))
    if kind <= 5:
        return c.encode_json(draw(json_values))
    return draw(st.sampled_from([
        "NaN", "[Infinity]", "-Infinity", "1e999", '"\\ud800"', '["\\udfff",1]', "[" * 5000,
        "[" * 3000 + "]" * 3000, '{"a":1,"a":2}', "[1,]", "{'a':1}", '"unterminated',
        "[1] trailing", " [1] ", "\t[]", "[1]\r", "", "null", '"\\u0000"',
        '["ev",["$e","!r","m.room.member","@u:h","join",null,false,false]]',
        '["$e","!r","m.room.message",null,null,null,false,false]',
    ]))


field_texts = st.one_of(ints, words, json_texts())
seps = st.sampled_from([" ", " ", " ", "  ", "\t", ""])


@st.composite
def lines(draw: st.DrawFn) -> str:
    """A command name, then fields from the grammar joined by mostly-right separators."""
    name = draw(st.sampled_from(NAMES))
    if name == "RDATA" and draw(st.booleans()):
        fields = [draw(st.sampled_from(STREAMS)), draw(words), draw(ints), draw(json_texts())]
    elif name == "POSITION" and draw(st.booleans()):
        fields = [draw(st.sampled_from(STREAMS)), draw(words), draw(ints), draw(ints)]
    else:
        fields = draw(st.lists(field_texts, max_size=6))
    out = name
    for f in fields:
        out += draw(seps) + f
    if draw(st.integers(0, 20)) == 0:
        out += draw(st.sampled_from(["\r", "\x00", "\ufeff", " ", "\udc80"]))
    return out


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


# --- parser ---------------------------------------------------------------------------------


def _check_line(line: str) -> None:
    INPUTS["parse_line"] += 1
    try:
        command = c.parse_line(line)
    except ProtocolError:
        return
    if isinstance(command, c.RdataCommand) and command.stream_name in ROW_PARSERS:
        INPUTS["parse_row"] += 1
        with contextlib.suppress(ProtocolError):
            parse_row(command.stream_name, command.row)
    # Whatever we accept, we can write back, and it reads the same.
    try:
        text = c.serialise(command)
    except ValueError:
        # Only for a field holding a newline, which parse_line never produces
        # from a single line unless the line itself contained one.
        assert "\n" in line or "\r" in line, (line, command)
        return
    assert c.parse_line(text) == command, (line, text)


@FUZZ
@given(lines())
def test_grammar_lines_parse_or_raise_protocol_error(line: str) -> None:
    _check_line(line)


@FUZZ
@given(st.sampled_from(sorted(ROW_PARSERS)), json_values)
def test_rows_of_any_shape_parse_or_raise_protocol_error(stream: str, row: object) -> None:
    INPUTS["parse_row"] += 1
    with contextlib.suppress(ProtocolError):
        parse_row(stream, row)


@st.composite
def event_row_mutants(draw: st.DrawFn) -> object:
    """Well-formed event rows with one field replaced by anything."""
    base: list[object] = ["$e", "!r:hs", "m.room.member", "@u:hs", "join", None, False, False]
    i = draw(st.integers(0, len(base)))
    if i < len(base):
        base[i] = draw(json_values)
    else:
        base = base[: draw(st.integers(0, len(base) + 2))]
    return ["ev", base] if draw(st.booleans()) else base


@FUZZ
@given(event_row_mutants())
def test_event_row_mutants_parse_or_raise_protocol_error(row: object) -> None:
    INPUTS["parse_row"] += 1
    with contextlib.suppress(ProtocolError):
        parse_row("events", row)


# --- the connection state machine -----------------------------------------------------------

SMALL = Limits(max_line_bytes=512, ping_interval_s=5.0, ping_timeout_s=25.0, max_outbound=50)

SENDABLE = {
    Role.CLIENT: [c.NameCommand("fed1"), c.ReplicateCommand(), c.PingCommand("1"),
                  c.FederationAckCommand("fed1", 3), c.RemoteServerUpCommand("x.org")],
    Role.SERVER: [c.ServerCommand("hs"), c.PingCommand("2"),
                  c.PositionCommand("events", "master", 1, 2),
                  c.RdataCommand("events", "master", 3, ["ev", []]),
                  c.ErrorCommand("bye"), c.HistoryCommand("events", "master", "h1", 4)],
}
SENDABLE[Role.BUS] = SENDABLE[Role.CLIENT] + SENDABLE[Role.SERVER]


class ConnectionMachine(RuleBasedStateMachine):
    """Bytes in any chunking, lines, timers and sends, in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.conn = ReplicationConnection(Role.CLIENT, self.clock)
        self.errors = 0
        self.pending = b""

    @initialize(role=st.sampled_from(list(Role)), small=st.booleans(),
                server=st.sampled_from([None, "hs"]))
    def setup(self, role: Role, small: bool, server: str | None) -> None:
        self.conn = ReplicationConnection(
            role, self.clock, expected_server_name=server,
            limits=SMALL if small else Limits(),
        )

    def _pull(self, use_drain: bool) -> None:
        was_closed = self.conn.closed
        if use_drain:
            _, err = self.conn.drain_commands()
            if err is not None:
                assert isinstance(err, ProtocolError)
                self.errors += 1
        else:
            try:
                while self.conn.next_command() is not None:
                    pass
            except ProtocolError:
                self.errors += 1
        if self.conn.closed and not was_closed and self.conn.close_reason != "closed":
            assert self.conn.outbound_count >= 1  # the ERROR for the peer

    @rule(text=st.lists(lines(), min_size=1, max_size=8), data=st.data(),
          use_drain=st.booleans())
    def feed_lines(self, text: list[str], data: st.DataObject, use_drain: bool) -> None:
        raw = b"".join(_utf8(t) + data.draw(st.sampled_from([b"\n", b"\r\n", b""])) for t in text)
        INPUTS["connection"] += len(text)
        step = data.draw(st.integers(1, max(1, len(raw))))
        for i in range(0, len(raw), step):
            self.conn.receive_data(raw[i:i + step])
            self._pull(use_drain)

    @rule(raw=st.binary(max_size=64), use_drain=st.booleans())
    def feed_bytes(self, raw: bytes, use_drain: bool) -> None:
        INPUTS["connection"] += 1
        self.conn.receive_data(raw)
        self._pull(use_drain)

    @rule(n=st.integers(1, 3))
    def feed_long_line(self, n: int) -> None:
        INPUTS["connection"] += 1
        self.conn.receive_data(b"PING " + b"x" * (self.conn._limits.max_line_bytes * n))
        self._pull(False)

    @rule(line=lines())
    def receive_line(self, line: str) -> None:
        INPUTS["connection"] += 1
        was_closed = self.conn.closed
        try:
            self.conn.receive_line(_utf8(line))
        except ProtocolError:
            self.errors += 1
        # A message transport's bad message is skipped: the connection stays as it was.
        assert self.conn.closed == was_closed

    @rule(seconds=st.floats(0, 40))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)
        deadline = self.conn.next_deadline()
        if deadline is None or deadline <= self.clock.monotonic_s():
            self.conn.on_timer()

    @rule(data=st.data(), times=st.integers(1, 60))
    def send(self, data: st.DataObject, times: int) -> None:
        command = data.draw(st.sampled_from(SENDABLE[self.conn.role]))
        for _ in range(times):
            self.conn.send(command)

    @rule()
    def flush(self) -> None:
        out = self.conn.data_to_send()
        self.pending += out
        *complete, self.pending = self.pending.split(b"\n")
        for line in complete:
            assert len(line) <= c.MAX_LINE_BYTES
            c.parse_line(line.decode("utf-8"))  # our own output is always valid

    @invariant()
    def bounded(self) -> None:
        assert self.conn.outbound_count <= self.conn._limits.max_outbound + 1
        if self.conn.closed:
            assert self.conn.next_command() is None
            assert self.conn.next_deadline() is None


TestConnectionMachine = ConnectionMachine.TestCase
TestConnectionMachine.settings = settings(
    FUZZ, max_examples=max(EXAMPLES // 5, 100), stateful_step_count=30
)


@FUZZ
@given(st.lists(lines(), max_size=20), st.integers(1, 64))
def test_bus_lines_never_raise_anything_but_protocol_error(text: list[str], chunk: int) -> None:
    """The Redis bus role accepts every known command and skips unknown ones; a bad line
    raises ProtocolError, nothing else, and leaves the connection open for the next."""
    conn = ReplicationConnection(Role.BUS, FakeClock())
    for t in text:
        INPUTS["connection"] += 1
        with contextlib.suppress(ProtocolError):
            conn.receive_line(_utf8(t))
        assert not conn.closed
    assume(True)


# --- mutational: many inputs per example ----------------------------------------------------

CAPTURES = captures_dir()
SEED_LINES = [
    "SERVER localhost:8823", "PING 1490197665618", "POSITION events master 1 1",
    'RDATA caches master batch ["f",["@a:hs"],1]', "REMOTE_SERVER_UP remote.example",
    'RDATA events master 7 ["ev",["$e","!r:hs","m.room.member","@u:hs","join",null,false,false]]',
    'RDATA federation master 3 ["m.typing",{"room_id":"!r"}]', 'RDATA to_device master 4 ["x.org"]',
    'REPLICATE {"psync":1,"have":[["events","master","h1",5]]}', "HISTORY events master h2 9",
    "FEDERATION_ACK fed1 12", 'USER_IP @u:hs ["tok","1.2.3.4","ua","DEV",123]', "NAME fed1",
    "USER_SYNC master @u:hs DEV start 1", "ERROR Failed to keep up", 'LOCK_RELEASED ["a"]',
]


def _corpus() -> list[bytes]:
    lines = [_utf8(x) for x in SEED_LINES]
    for path in sorted(CAPTURES.glob("*.txt")) if CAPTURES.is_dir() else []:
        for raw in path.read_text(encoding="utf-8").splitlines():
            if raw and not raw.startswith("#"):
                lines.append(raw.split("\t", 2)[-1].encode("utf-8"))
    return lines


CORPUS = _corpus()
TOKENS = [b" ", b"  ", b"\r", b"\n", b"\x00", b"\xff", b"\xc3", b"\xed\xa0\x80", b"[", b"]",
          b"{", b"}", b'"', b",", b":", b"-", b"+", b"0", b"9" * 25, b"NaN", b"1e999",
          b"batch", b"null", b'"\\ud800"', b"\t", b"\xe2\x80\xa8", "\u0661".encode()]


def mutate(rng: random.Random, line: bytes) -> bytes:
    out = bytearray(line)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        op = rng.randrange(7)
        pos = rng.randrange(len(out) + 1)
        if op == 0 and out:  # flip a byte
            out[min(pos, len(out) - 1)] = rng.randrange(256)
        elif op == 1:  # insert a token
            out[pos:pos] = rng.choice(TOKENS)
        elif op == 2 and out:  # delete a span
            del out[pos:pos + rng.randrange(1, 8)]
        elif op == 3:  # splice with another line
            other = rng.choice(CORPUS)
            out = out[:pos] + other[rng.randrange(len(other) + 1):]
        elif op == 4:  # truncate
            del out[pos:]
        elif op == 5:  # swap the command name
            name = rng.choice(NAMES).encode("utf-8")
            rest = bytes(out).partition(b" ")[2]
            out = bytearray(name + b" " + rest)
        else:  # duplicate a span (repetition finds length bugs)
            span = out[pos:pos + rng.randrange(1, 16)]
            out[pos:pos] = span * rng.randrange(1, 50)
    return bytes(out)


@MUTANT_SEEDS
@given(st.integers(min_value=0, max_value=2**64))
def test_mutated_corpus_lines_parse_or_raise_protocol_error(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(MUTANTS_PER_EXAMPLE):
        raw = mutate(rng, rng.choice(CORPUS))
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # the connection refuses these before parsing; fed to it below
        for line in text.split("\n"):
            _check_line(line)


@MUTANT_SEEDS
@given(st.integers(min_value=0, max_value=2**64), st.sampled_from(list(Role)))
def test_mutated_streams_through_the_connection(seed: int, role: Role) -> None:
    """Streams of mutated lines, cut at random points, into a fresh connection; on
    ProtocolError (the only thing allowed out) start another."""
    rng = random.Random(seed)
    limits = SMALL if rng.random() < 0.3 else Limits()
    conn = ReplicationConnection(role, FakeClock(), limits=limits)
    stream = bytearray()
    for _ in range(MUTANTS_PER_EXAMPLE):
        stream += mutate(rng, rng.choice(CORPUS)) + rng.choice((b"\n", b"\r\n", b"\n", b""))
    INPUTS["connection"] += MUTANTS_PER_EXAMPLE
    pos = 0
    while pos < len(stream):
        step = rng.choice((1, 7, 64, 512, 4096, 20000))
        conn.receive_data(bytes(stream[pos:pos + step]))
        pos += step
        if rng.random() < 0.5:
            _, err = conn.drain_commands()
            failed = err is not None
        else:
            try:
                while conn.next_command() is not None:
                    pass
                failed = False
            except ProtocolError:
                failed = True
        if failed:
            assert conn.closed
            for line in conn.data_to_send().splitlines():
                c.parse_line(line.decode("utf-8"))
            conn = ReplicationConnection(role, FakeClock())


@pytest.mark.parametrize("line", [
    "RDATA events master 0 1e999", "RDATA events master 0 [-1e400]",
    'REPLICATE {"psync":1,"have":[],"x":1e309}', 'USER_IP @u:hs ["t","ip","ua",null,1e999]',
])
def test_numbers_json_cannot_express_are_protocol_errors(line: str) -> None:
    """Regression (found by this fuzzer): Python's json reads 1e999 as inf, which the
    strict decoder's contract excludes and ``encode_json`` cannot write back."""
    with pytest.raises(ProtocolError):
        c.parse_line(line)
