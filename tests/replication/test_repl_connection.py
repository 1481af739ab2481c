"""connection.py: framing (whole, byte by byte, trailing data), direction, identity,
keepalive and timeout on a fake clock, congestion, and the any-bytes property."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from federation_sender.errors import ProtocolError
from federation_sender.replication import commands as c
from federation_sender.replication.connection import Limits, ReplicationConnection, Role
from federation_sender.testing.captures import capture_lines
from federation_sender.testing.clock import FakeClock

MAX_EXAMPLES = 3000 if os.environ.get("REPLICATION_LONG_TESTS") else 300

WRITER_TRAFFIC = (
    b"SERVER localhost:8823\n"
    b"PING 1490197665618\n"
    b"\n"
    b"POSITION events master 1 1\r\n"
    b'RDATA caches master batch ["f",["@a:hs"],1]\n'
    b'RDATA caches master 2 ["f",["@b:hs"],1]\n'
    b"   \n"
    b'LOCK_RELEASED ["master","lock","key"]\n'
    b"REMOTE_SERVER_UP remote.example\n"
    b"ERROR server stopping\n"
)


def client(clock: FakeClock | None = None, **kw: object) -> ReplicationConnection:
    return ReplicationConnection(Role.CLIENT, clock or FakeClock(), **kw)  # type: ignore[arg-type]


def drain(conn: ReplicationConnection) -> list[c.Command]:
    out = []
    while (command := conn.next_command()) is not None:
        out.append(command)
    return out


def expected_writer_commands() -> list[c.Command]:
    return [
        c.ServerCommand("localhost:8823"),
        c.PingCommand("1490197665618"),
        c.PositionCommand("events", "master", 1, 1),
        c.RdataCommand("caches", "master", None, ["f", ["@a:hs"], 1]),
        c.RdataCommand("caches", "master", 2, ["f", ["@b:hs"], 1]),
        c.IgnoredCommand("LOCK_RELEASED", '["master","lock","key"]'),
        c.RemoteServerUpCommand("remote.example"),
        c.ErrorCommand("server stopping"),
    ]


def test_whole_input() -> None:
    conn = client()
    conn.receive_data(WRITER_TRAFFIC)
    assert drain(conn) == expected_writer_commands()


def test_byte_by_byte() -> None:
    conn = client()
    got: list[c.Command] = []
    for i in range(len(WRITER_TRAFFIC)):
        conn.receive_data(WRITER_TRAFFIC[i : i + 1])
        got.extend(drain(conn))
    assert got == expected_writer_commands()


def test_trailing_partial_line_waits_for_its_newline() -> None:
    conn = client()
    conn.receive_data(WRITER_TRAFFIC + b"RDATA caches master 3 [")
    assert drain(conn) == expected_writer_commands()
    assert conn.next_command() is None
    conn.receive_data(b'"g",null,1]\n')
    assert drain(conn) == [c.RdataCommand("caches", "master", 3, ["g", None, 1])]


def test_every_capture_line_passes_a_bus_connection() -> None:
    conn = ReplicationConnection(Role.BUS, FakeClock(), keepalive=False)
    data = "".join(line + "\n" for line in capture_lines()).encode()
    got = []
    for i in range(0, len(data), 4096):
        conn.receive_data(data[i : i + 4096])
        got.extend(drain(conn))
    assert len(got) == len(capture_lines())
    assert not conn.closed


def expect_error(conn: ReplicationConnection, data: bytes, reason_part: str) -> None:
    conn.receive_data(data)
    with pytest.raises(ProtocolError, match=reason_part):
        drain(conn)
    assert conn.closed
    sent = conn.data_to_send().splitlines()
    assert sent[-1].startswith(b"ERROR ") and reason_part.encode() in sent[-1]
    assert conn.next_command() is None  # the error is raised once


def test_wrong_direction_is_an_error() -> None:
    expect_error(client(), b"REPLICATE\n", "not allowed")
    server = ReplicationConnection(Role.SERVER, FakeClock())
    expect_error(server, b"RDATA events master 1 []\n", "not allowed")


def test_unknown_command_is_an_error_on_tcp_and_skipped_on_the_bus() -> None:
    expect_error(client(), b"FROBNICATE now\n", "unknown command")
    bus = ReplicationConnection(Role.BUS, FakeClock(), keepalive=False)
    bus.receive_data(b"FROBNICATE now\nPING 1\n")
    assert drain(bus) == [c.PingCommand("1")]


def test_over_long_line_is_an_error_with_or_without_newline() -> None:
    expect_error(client(), b"PING " + b"x" * 16380 + b"\n", "too long")
    conn = client()
    conn.receive_data(b"PING " + b"x" * 16379 + b"\n")  # exactly 16384 bytes
    assert len(drain(conn)) == 1
    expect_error(client(), b"PING " + b"x" * 20000, "too long")


def test_invalid_utf8_and_invalid_rows_are_errors() -> None:
    expect_error(client(), b"PING \xff\n", "UTF-8")
    expect_error(client(), b"RDATA events master 1 [NaN]\n", "JSON")


def test_server_name_check() -> None:
    expect_error(client(expected_server_name="a.example"), b"SERVER b.example\n", "expected")
    conn = client(expected_server_name="a.example")
    conn.receive_data(b"SERVER a.example\n")
    assert drain(conn) == [c.ServerCommand("a.example")]


def test_sending_the_wrong_direction_is_a_bug() -> None:
    with pytest.raises(ValueError):
        client().send(c.RdataCommand("s", "i", 1, []))


def test_ping_sent_after_five_seconds_of_silence() -> None:
    clock = FakeClock()
    conn = client(clock)
    conn.send(c.NameCommand("fed1"))
    conn.data_to_send()
    clock.advance(4.9)
    conn.on_timer()
    assert conn.data_to_send() == b""
    assert conn.next_deadline() == pytest.approx(5.0)
    clock.advance(0.1)
    conn.on_timer()
    assert conn.data_to_send().startswith(b"PING ")
    assert conn.next_deadline() == pytest.approx(10.0)


def test_no_timeout_until_the_peer_has_pinged() -> None:
    clock = FakeClock()
    conn = client(clock)
    for _ in range(20):
        clock.advance(5)
        conn.on_timer()
    assert not conn.closed


def test_timeout_25_seconds_after_last_command_once_peer_pinged() -> None:
    clock = FakeClock()
    conn = client(clock)
    conn.receive_data(b"PING 1\n")
    drain(conn)
    clock.advance(20)
    conn.receive_data(b"POSITION events master 1 1\n")  # any command resets it
    drain(conn)
    for _ in range(4):
        clock.advance(6)
        conn.on_timer()
    assert not conn.closed  # 24 s after the last command
    clock.advance(1)
    conn.on_timer()
    assert conn.closed
    assert conn.data_to_send().splitlines()[-1] == b"ERROR ping timeout"


def test_congestion_closes_with_failed_to_keep_up() -> None:
    conn = ReplicationConnection(Role.SERVER, FakeClock(), limits=Limits(max_outbound=10))
    for i in range(10):
        conn.send(c.PositionCommand("events", "master", i, i))
    assert not conn.closed
    conn.send(c.PositionCommand("events", "master", 10, 10))
    assert conn.closed
    assert conn.data_to_send() == b"ERROR Failed to keep up\n"
    conn.send(c.PingCommand("x"))  # no-op once closed
    assert conn.data_to_send() == b""


def test_default_congestion_limit_is_ten_thousand() -> None:
    conn = ReplicationConnection(Role.SERVER, FakeClock())
    for i in range(10_000):
        conn.send(c.PingCommand(str(i)))
    assert not conn.closed and conn.outbound_count == 10_000
    conn.send(c.PingCommand("one too many"))
    assert conn.closed


@settings(max_examples=MAX_EXAMPLES)
@given(st.binary(max_size=400), st.integers(min_value=1, max_value=50))
def test_property_any_bytes_parse_or_raise_protocol_error(data: bytes, chunk: int) -> None:
    for role in (Role.CLIENT, Role.SERVER, Role.BUS):
        conn = ReplicationConnection(role, FakeClock())
        try:
            for i in range(0, len(data), chunk):
                conn.receive_data(data[i : i + chunk])
                drain(conn)
        except ProtocolError:
            assert conn.closed


@settings(max_examples=MAX_EXAMPLES)
@given(
    st.lists(st.sampled_from(WRITER_TRAFFIC.splitlines(keepends=True)), max_size=20),
    st.integers(min_value=1, max_value=64),
)
def test_property_chunking_never_changes_the_result(lines: list[bytes], chunk: int) -> None:
    data = b"".join(lines)
    whole = client()
    whole.receive_data(data)
    expected = drain(whole)
    pieces = client()
    got: list[c.Command] = []
    for i in range(0, len(data), chunk):
        pieces.receive_data(data[i : i + chunk])
        got.extend(drain(pieces))
    assert got == expected


@settings(max_examples=MAX_EXAMPLES)
@given(
    st.lists(
        st.sampled_from([*WRITER_TRAFFIC.splitlines(keepends=True), b"RDATA e m 1 [\xff]\n"]),
        max_size=20,
    ),
    st.integers(min_value=1, max_value=64),
)
def test_property_drain_commands_equals_next_command(lines: list[bytes], chunk: int) -> None:
    data = b"".join(lines)
    one, batch = client(), client()
    expected: list[c.Command] = []
    got: list[c.Command] = []
    error_one = error_batch = None
    for i in range(0, len(data), chunk):
        one.receive_data(data[i : i + chunk])
        batch.receive_data(data[i : i + chunk])
        try:
            while (command := one.next_command()) is not None:
                expected.append(command)
        except ProtocolError as e:
            error_one = error_one or str(e)
        out, err = batch.drain_commands()
        got.extend(out)
        if err is not None:
            error_batch = error_batch or str(err)
    assert got == expected
    assert error_one == error_batch
    assert one.data_to_send() == batch.data_to_send()
