"""commands.py: every command round-trips; bad input raises ProtocolError only."""

from __future__ import annotations

import contextlib
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from federation_sender.errors import ProtocolError
from federation_sender.replication import commands as c
from federation_sender.testing.captures import capture_lines

MAX_EXAMPLES = 2000 if os.environ.get("REPLICATION_LONG_TESTS") else 200

EXAMPLES: list[tuple[str, c.Command]] = [
    ("SERVER localhost:8823", c.ServerCommand("localhost:8823")),
    ("NAME synapse.app.appservice", c.NameCommand("synapse.app.appservice")),
    ("PING 1490197665618", c.PingCommand("1490197665618")),
    ("REPLICATE ", c.ReplicateCommand()),
    ("POSITION events master 53 53", c.PositionCommand("events", "master", 53, 53)),
    (
        'RDATA caches master 2 ["get_user_by_id",["@01register-user:localhost:8823"],'
        "1490197670513]",
        c.RdataCommand(
            "caches",
            "master",
            2,
            ["get_user_by_id", ["@01register-user:localhost:8823"], 1490197670513],
        ),
    ),
    (
        'RDATA caches master batch ["f",null,1]',
        c.RdataCommand("caches", "master", None, ["f", None, 1]),
    ),
    ("ERROR server stopping", c.ErrorCommand("server stopping")),
    (
        "USER_SYNC worker1 @u:hs DEVICE start 1700000000000",
        c.UserSyncCommand("worker1", "@u:hs", "DEVICE", True, 1700000000000),
    ),
    ("USER_SYNC worker1 @u:hs None end 5", c.UserSyncCommand("worker1", "@u:hs", None, False, 5)),
    ("CLEAR_USER_SYNC worker1", c.ClearUserSyncCommand("worker1")),
    ("FEDERATION_ACK fed1 0", c.FederationAckCommand("fed1", 0)),
    ("REMOTE_SERVER_UP remote.example", c.RemoteServerUpCommand("remote.example")),
    (
        'USER_IP @u:hs ["tok","1.2.3.4","curl/8",null,1700000000000]',
        c.UserIpCommand("@u:hs", "tok", "1.2.3.4", "curl/8", None, 1700000000000),
    ),
    ("HISTORY typing master 0a1b2c 0", c.HistoryCommand("typing", "master", "0a1b2c", 0)),
    (
        'REPLICATE {"psync":1,"have":[["events","master","h1",5]]}',
        c.ReplicateCommand(c.PsyncOffer((c.StreamHave("events", "master", "h1", 5),))),
    ),
    (
        'LOCK_RELEASED ["master","new_event_during_purge_lock","!r:hs"]',
        c.IgnoredCommand("LOCK_RELEASED", '["master","new_event_during_purge_lock","!r:hs"]'),
    ),
]


@pytest.mark.parametrize(("line", "command"), EXAMPLES)
def test_examples_parse_and_serialise_exactly(line: str, command: c.Command) -> None:
    assert c.parse_line(line) == command
    assert c.serialise(command) == line


def test_replicate_parses_with_or_without_trailing_space() -> None:
    assert c.parse_line("REPLICATE") == c.ReplicateCommand()
    assert c.parse_line("REPLICATE ") == c.ReplicateCommand()
    assert c.encode(c.ReplicateCommand()) == b"REPLICATE \n"


def test_every_capture_line_parses_and_round_trips() -> None:
    lines = capture_lines()
    assert len(lines) > 1000
    names = set()
    for line in lines:
        command = c.parse_line(line)
        names.add(c.command_name(command))
        assert c.parse_line(c.serialise(command)) == command
        if isinstance(command, c.RdataCommand | c.PositionCommand):
            assert c.serialise(command) == line  # Synapse writes compact JSON too
    assert {"RDATA", "POSITION", "REPLICATE", "FEDERATION_ACK", "LOCK_RELEASED"} <= names


def test_unknown_names_parse_as_unknown() -> None:
    assert c.parse_line("NEW_THING a b") == c.UnknownCommand("NEW_THING", "a b")


@pytest.mark.parametrize(
    "line",
    [
        "",
        "rdata events master 1 []",
        "RDATA events master 1",
        "RDATA events master x []",
        "RDATA events master +1 []",
        "RDATA events master 1_0 []",
        "RDATA events master \u0661 []",
        "RDATA events master 1 [NaN]",
        "RDATA events master 1 [Infinity]",
        "RDATA events master 1 [1] x",
        "RDATA events master 1 [1",
        "RDATA  master 1 []",
        "RDATA events master " + "9" * 30 + " []",
        "POSITION events master 1",
        "POSITION events master 1 two",
        "SERVER",
        "SERVER ",
        "SERVER a b",
        "USER_SYNC w @u:hs D maybe 1",
        "USER_SYNC w @u:hs D start",
        "FEDERATION_ACK fed1",
        "FEDERATION_ACK fed1 1 2",
        'USER_IP @u:hs ["tok","ip","ua",null]',
        'USER_IP @u:hs ["tok","ip","ua",null,"soon"]',
        "REPLICATE nonsense",
        'REPLICATE {"psync":0}',
        'REPLICATE {"psync":1,"have":[["events","master","h",1.5]]}',
        'REPLICATE {"psync":1,"have":[["events","master","",1]]}',
        "HISTORY typing master h",
        "RDATA events master 1 " + "[" * 100_000,
    ],
)
def test_bad_lines_raise_protocol_error(line: str) -> None:
    with pytest.raises(ProtocolError):
        c.parse_line(line)


def test_serialise_rejects_newlines_and_encode_rejects_long_lines() -> None:
    with pytest.raises(ValueError):
        c.serialise(c.ErrorCommand("a\nb"))
    with pytest.raises(ValueError):
        c.encode(c.RdataCommand("s", "i", 1, "x" * 20000))


def test_rows_serialise_compact_and_ascii() -> None:
    line = c.serialise(c.RdataCommand("s", "i", 1, {"k": ["é", 1.5, None]}))
    assert line == 'RDATA s i 1 {"k":["\\u00e9",1.5,null]}'
    with pytest.raises(ValueError):
        c.serialise(c.RdataCommand("s", "i", 1, [float("nan")]))


# --- properties --------------------------------------------------------------------

words = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Zs", "Cc"), blacklist_characters=" "),
    min_size=1,
    max_size=20,
)
texts = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=30
)
tokens = st.integers(min_value=-(10**18), max_value=10**18)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.text(max_size=10)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=10,
)
commands = st.one_of(
    st.builds(c.ServerCommand, words),
    st.builds(c.NameCommand, words),
    st.builds(c.PingCommand, texts),
    st.builds(c.ErrorCommand, texts),
    st.just(c.ReplicateCommand()),
    st.builds(
        c.ReplicateCommand,
        st.builds(
            c.PsyncOffer, st.lists(st.builds(c.StreamHave, words, words, words, tokens)).map(tuple)
        ),
    ),
    st.builds(  # prev <= new: the other way round is a protocol error
        lambda s, i, t: c.PositionCommand(s, i, min(t), max(t)),
        words,
        words,
        st.tuples(tokens, tokens),
    ),
    st.builds(c.RdataCommand, words, words, st.none() | tokens, json_values),
    st.builds(
        c.UserSyncCommand,
        words,
        words,
        st.none() | words.filter(lambda w: w != "None"),
        st.booleans(),
        tokens,
    ),
    st.builds(c.ClearUserSyncCommand, words),
    st.builds(c.FederationAckCommand, words, tokens),
    st.builds(c.RemoteServerUpCommand, words),
    st.builds(c.UserIpCommand, words, texts, texts, texts, st.none() | texts, tokens),
    st.builds(c.HistoryCommand, words, words, words, tokens),
)


@settings(max_examples=MAX_EXAMPLES)
@given(commands)
def test_property_round_trip(command: c.Command) -> None:
    assert c.parse_line(c.serialise(command)) == command


@settings(max_examples=MAX_EXAMPLES)
@given(st.text(max_size=200))
def test_property_any_text_parses_or_raises_protocol_error(text: str) -> None:
    # The assertion is that nothing but ProtocolError escapes.
    with contextlib.suppress(ProtocolError):
        c.parse_line(text)


_json_values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.text(max_size=8),
        st.integers(min_value=-(2**80), max_value=2**80),
        st.sampled_from([-(2**63) - 1, -(2**63), 2**64 - 1, 2**64, 10**18, -0]),
        st.floats(allow_nan=False, allow_infinity=False),
    ),
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.text(max_size=5), children, max_size=4)),
    max_leaves=15,
)


@settings(max_examples=150, deadline=None)
@given(_json_values, st.sampled_from([(",", ":"), (", ", ": ")]), st.booleans())
def test_decode_json_gives_the_standard_librarys_values_and_types(
    value: object, separators: tuple[str, str], pad: bool
) -> None:
    import json

    text = json.dumps(value, separators=separators, ensure_ascii=False)
    if pad:
        text = f" {text} "
    expected = json.loads(text)
    got = c.decode_json(text)
    assert got == expected
    assert repr(got) == repr(expected)  # same types: an int stays an exact int


@pytest.mark.parametrize("text", ["NaN", "[1e999]", "[1] x", '{"a":-Infinity}', "[1,]"])
def test_decode_json_stays_strict(text: str) -> None:
    with pytest.raises(ProtocolError):
        c.decode_json(text)
