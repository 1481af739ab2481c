"""Every command of the replication line protocol, with pure parse and serialise.

A line is ``NAME`` or ``NAME <rest>``; how ``<rest>`` splits depends on the
command (see each class's docstring for its wire format). This module knows
nothing about sockets, direction or state: :func:`parse_line` turns one decoded
line (no newline) into a command or raises :class:`ProtocolError`, and
:func:`serialise` / :func:`encode` do the reverse. Invariants:

* parsing is total: any string either parses or raises ``ProtocolError`` (never
  ``ValueError``, ``KeyError`` or ``json.JSONDecodeError``);
* ``parse_line(serialise(c)) == c`` for every command we can build;
* rows are JSON without NaN/Infinity and are serialised compactly and ASCII-only,
  so a serialised line is always valid UTF-8 even if a peer sent lone surrogates;
* tokens are ASCII decimal integers (``int()`` alone would accept ``"+5"``,
  ``"5_0"`` and non-ASCII digits);
* command names that Synapse defines but this worker has no use for
  (``LOCK_RELEASED``, ``NEW_ACTIVE_TASK``) parse as :class:`IgnoredCommand`; any
  other well-formed name parses as :class:`UnknownCommand`, and the connection
  decides whether that is an error (TCP) or skipped (a shared Redis bus).

``HISTORY`` and the JSON argument of ``REPLICATE`` are this project's PSYNC-style
extension, documented in ``docs/replication-protocol.md``.

Size: this module is the protocol's command catalogue (about 560 lines, over the
house limit of 400 on purpose): one small frozen class per command with its wire
format, and one parser per command beside the table that dispatches on the name.
Split across files, a command's class and its parser would drift apart; kept here,
adding a command is one reviewable hunk and the round-trip property test covers the
whole catalogue.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

from federation_sender.errors import ProtocolError

MAX_LINE_BYTES = 16384
"""The longest line (excluding its newline) either side accepts."""

PSYNC_VERSION = 1

JsonValue: TypeAlias = object


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    # Python's json turns 1e999 into inf, which JSON cannot express and encode_json
    # refuses: a row we could not write back out.
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


_decoder = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
_encoder = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


# The scanner is set in JSONDecoder.__init__ but missing from typeshed.
_scan_once: Callable[[str, int], tuple[object, int]] = _decoder.scan_once  # type: ignore[attr-defined]


def decode_json(text: str) -> JsonValue:
    """Strict JSON decode: no NaN/Infinity, no trailing data.

    The fast path scans compact JSON directly (what every writer sends); anything
    else, such as surrounding whitespace, goes through the full decoder.
    """
    try:
        value, end = _scan_once(text, 0)
    except (StopIteration, ValueError, RecursionError):
        pass
    else:
        if end == len(text):
            return value
    try:
        return _decoder.decode(text)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"invalid JSON: {e}") from None


def encode_json(value: JsonValue) -> str:
    """Compact, ASCII-only JSON without NaN."""
    return _encoder.encode(value)


def _int(text: str, what: str) -> int:
    digits = text[1:] if text[:1] == "-" else text
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 20):
        raise ProtocolError(f"invalid {what}: {text[:40]!r}")
    return int(text)


def _word(text: str, what: str) -> str:
    if not text or " " in text:
        raise ProtocolError(f"invalid {what}: {text[:40]!r}")
    return text


def _split(rest: str, n: int, command: str) -> list[str]:
    parts = rest.split(" ", n - 1)
    if len(parts) != n:
        raise ProtocolError(f"{command} needs {n} fields, got {len(parts)}")
    return parts


def _check_text(value: str, what: str) -> None:
    """Reject values that cannot be written on one line (a bug on our side)."""
    if "\n" in value or "\r" in value:
        raise ValueError(f"{what} contains a newline: {value!r}")


@dataclass(frozen=True, slots=True)
class ServerCommand:
    """``SERVER <server_name>``: the writer's identity, sent first on a connection."""

    NAME: ClassVar[str] = "SERVER"
    server_name: str

    def args(self) -> str:
        return self.server_name


@dataclass(frozen=True, slots=True)
class NameCommand:
    """``NAME <name>``: the reader's human-friendly name (optional)."""

    NAME: ClassVar[str] = "NAME"
    name: str

    def args(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class PingCommand:
    """``PING <data>``: keepalive; the data is arbitrary (usually a timestamp in ms)."""

    NAME: ClassVar[str] = "PING"
    data: str = ""

    def args(self) -> str:
        return self.data


@dataclass(frozen=True, slots=True)
class ErrorCommand:
    """``ERROR <message>``: the sender saw an error and will usually close."""

    NAME: ClassVar[str] = "ERROR"
    message: str

    def args(self) -> str:
        return self.message


@dataclass(frozen=True, slots=True)
class StreamHave:
    """What a reader holds for one (stream, writer): its history id and token."""

    stream_name: str
    instance_name: str
    history_id: str
    token: int


@dataclass(frozen=True, slots=True)
class PsyncOffer:
    """The PSYNC extension carried by ``REPLICATE``: the reader's (history, token)s."""

    have: tuple[StreamHave, ...] = ()
    version: int = PSYNC_VERSION


@dataclass(frozen=True, slots=True)
class ReplicateCommand:
    """``REPLICATE`` or ``REPLICATE <json>``: ask every writer for its positions.

    The plain form serialises as ``"REPLICATE "`` (with the trailing space Synapse
    writes) and parses with or without it. The extended form carries a JSON object
    ``{"psync": 1, "have": [[stream, instance, history_id, token], ...]}``; plain
    Synapse ignores everything after ``REPLICATE``, so the extension is invisible
    to it.
    """

    NAME: ClassVar[str] = "REPLICATE"
    psync: PsyncOffer | None = None

    def args(self) -> str:
        if self.psync is None:
            return ""
        have = [[h.stream_name, h.instance_name, h.history_id, h.token] for h in self.psync.have]
        return encode_json({"psync": self.psync.version, "have": have})


@dataclass(frozen=True, slots=True)
class PositionCommand:
    """``POSITION <stream> <instance> <prev_token> <new_token>``.

    The writer ``instance`` wrote no rows to ``stream`` between ``prev_token``
    and ``new_token``. A reader whose position is outside ``[prev, new]`` has
    missed rows and fetches them out of band.
    """

    NAME: ClassVar[str] = "POSITION"
    stream_name: str
    instance_name: str
    prev_token: int
    new_token: int

    def args(self) -> str:
        return f"{self.stream_name} {self.instance_name} {self.prev_token} {self.new_token}"


@dataclass(frozen=True, slots=True)
class RdataCommand:
    """``RDATA <stream> <instance> <token|batch> <row_json>``: one row of a stream.

    ``token`` is ``None`` on the wire word ``batch``: the row shares the token of
    the next numeric RDATA of the same stream, and the reader must not advance
    until it sees that one.
    """

    NAME: ClassVar[str] = "RDATA"
    stream_name: str
    instance_name: str
    token: int | None
    row: JsonValue

    def args(self) -> str:
        token = "batch" if self.token is None else str(self.token)
        return f"{self.stream_name} {self.instance_name} {token} {encode_json(self.row)}"


@dataclass(frozen=True, slots=True)
class UserSyncCommand:
    """``USER_SYNC <instance_id> <user_id> <device_id|None> <start|end> <last_sync_ms>``."""

    NAME: ClassVar[str] = "USER_SYNC"
    instance_id: str
    user_id: str
    device_id: str | None
    is_syncing: bool
    last_sync_ms: int

    def args(self) -> str:
        state = "start" if self.is_syncing else "end"
        return f"{self.instance_id} {self.user_id} {self.device_id} {state} {self.last_sync_ms}"


@dataclass(frozen=True, slots=True)
class ClearUserSyncCommand:
    """``CLEAR_USER_SYNC <instance_id>``: forget every user sync of that worker."""

    NAME: ClassVar[str] = "CLEAR_USER_SYNC"
    instance_id: str

    def args(self) -> str:
        return self.instance_id


@dataclass(frozen=True, slots=True)
class FederationAckCommand:
    """``FEDERATION_ACK <instance_name> <token>``: federation stream processed up to token."""

    NAME: ClassVar[str] = "FEDERATION_ACK"
    instance_name: str
    token: int

    def args(self) -> str:
        return f"{self.instance_name} {self.token}"


@dataclass(frozen=True, slots=True)
class RemoteServerUpCommand:
    """``REMOTE_SERVER_UP <server>``: a remote homeserver is reachable again."""

    NAME: ClassVar[str] = "REMOTE_SERVER_UP"
    server: str

    def args(self) -> str:
        return self.server


@dataclass(frozen=True, slots=True)
class UserIpCommand:
    """``USER_IP <user_id> [access_token, ip, user_agent, device_id, last_seen]``."""

    NAME: ClassVar[str] = "USER_IP"
    user_id: str
    access_token: str
    ip: str
    user_agent: str
    device_id: str | None
    last_seen: int

    def args(self) -> str:
        fields = [self.access_token, self.ip, self.user_agent, self.device_id, self.last_seen]
        return f"{self.user_id} {encode_json(fields)}"


@dataclass(frozen=True, slots=True)
class HistoryCommand:
    """``HISTORY <stream> <instance> <history_id> <start_token>`` (extension, writer only).

    The writer's history of ``stream`` is ``history_id``; it began at
    ``start_token``, so tokens above it are facts of this history only. Sent only
    to readers that offered PSYNC in ``REPLICATE``.
    """

    NAME: ClassVar[str] = "HISTORY"
    stream_name: str
    instance_name: str
    history_id: str
    start_token: int

    def args(self) -> str:
        return f"{self.stream_name} {self.instance_name} {self.history_id} {self.start_token}"


@dataclass(frozen=True, slots=True)
class IgnoredCommand:
    """A command Synapse defines that this worker neither sends nor acts on."""

    NAME: ClassVar[str] = "<ignored>"
    name: str
    data: str

    def args(self) -> str:
        return self.data


@dataclass(frozen=True, slots=True)
class UnknownCommand:
    """A well-formed command name this module does not know."""

    NAME: ClassVar[str] = "<unknown>"
    name: str
    data: str

    def args(self) -> str:
        return self.data


Command: TypeAlias = (
    ServerCommand
    | NameCommand
    | PingCommand
    | ErrorCommand
    | ReplicateCommand
    | PositionCommand
    | RdataCommand
    | UserSyncCommand
    | ClearUserSyncCommand
    | FederationAckCommand
    | RemoteServerUpCommand
    | UserIpCommand
    | HistoryCommand
    | IgnoredCommand
    | UnknownCommand
)

IGNORED_NAMES = frozenset({"LOCK_RELEASED", "NEW_ACTIVE_TASK"})


# --- parsers: each takes the text after "NAME " ------------------------------------


def _parse_server(rest: str) -> ServerCommand:
    return ServerCommand(_word(rest, "server name"))


def _parse_name(rest: str) -> NameCommand:
    if not rest:
        raise ProtocolError("NAME needs a name")
    return NameCommand(rest)


def _parse_replicate(rest: str) -> ReplicateCommand:
    if not rest.strip(" "):
        return ReplicateCommand()
    obj = decode_json(rest)
    if not isinstance(obj, dict):
        raise ProtocolError("REPLICATE argument must be a JSON object")
    version = obj.get("psync")
    have_raw = obj.get("have", [])
    if type(version) is not int or version < 1 or not isinstance(have_raw, list):
        raise ProtocolError("REPLICATE argument needs psync version and have list")
    have: list[StreamHave] = []
    for item in have_raw:
        if not (isinstance(item, list) and len(item) == 4):
            raise ProtocolError("REPLICATE have entries are [stream, instance, history, token]")
        stream, instance, history, token = item
        if not (
            isinstance(stream, str)
            and isinstance(instance, str)
            and isinstance(history, str)
            and type(token) is int
        ):
            raise ProtocolError("REPLICATE have entry has wrong types")
        have.append(
            StreamHave(
                _word(stream, "stream name"),
                _word(instance, "instance name"),
                _word(history, "history id"),
                token,
            )
        )
    return ReplicateCommand(PsyncOffer(tuple(have), version))


def _parse_position(rest: str) -> PositionCommand:
    stream, instance, prev, new = _split(rest, 4, "POSITION")
    command = PositionCommand(
        _word(stream, "stream name"),
        _word(instance, "instance name"),
        _int(prev, "prev token"),
        _int(new, "new token"),
    )
    if command.prev_token > command.new_token:
        # "no rows between prev and new" cannot hold backwards; acting on it once moved
        # the position back and then persisted one past rows never handled.
        raise ProtocolError(
            f"POSITION {command.stream_name} {command.instance_name}: "
            f"prev token {command.prev_token} is above new token {command.new_token}"
        )
    return command


def _parse_rdata(rest: str) -> RdataCommand:
    parts = rest.split(" ", 3)
    if len(parts) != 4:
        raise ProtocolError(f"RDATA needs 4 fields, got {len(parts)}")
    stream, instance, token_text, row_json = parts
    if not stream or not instance:
        raise ProtocolError("RDATA needs stream and instance names")
    token: int | None
    if token_text.isdigit() and token_text.isascii() and len(token_text) <= 20:
        token = int(token_text)  # the hot path; _int handles the rest
    elif token_text == "batch":
        token = None
    else:
        token = _int(token_text, "token")
    return RdataCommand(stream, instance, token, decode_json(row_json))


parse_rdata_args = _parse_rdata
"""Parse what follows ``RDATA `` (the hot path, used directly by the connection)."""


def _parse_user_sync(rest: str) -> UserSyncCommand:
    instance_id, user_id, device_id, state, last_sync = _split(rest, 5, "USER_SYNC")
    if state not in ("start", "end"):
        raise ProtocolError(f"USER_SYNC state must be start or end, got {state[:20]!r}")
    return UserSyncCommand(
        _word(instance_id, "instance id"),
        _word(user_id, "user id"),
        None if device_id == "None" else _word(device_id, "device id"),
        state == "start",
        _int(last_sync, "last_sync_ms"),
    )


def _parse_clear_user_sync(rest: str) -> ClearUserSyncCommand:
    return ClearUserSyncCommand(_word(rest, "instance id"))


def _parse_federation_ack(rest: str) -> FederationAckCommand:
    instance, token = _split(rest, 2, "FEDERATION_ACK")
    return FederationAckCommand(_word(instance, "instance name"), _int(token, "token"))


def _parse_remote_server_up(rest: str) -> RemoteServerUpCommand:
    return RemoteServerUpCommand(_word(rest, "server name"))


def _parse_user_ip(rest: str) -> UserIpCommand:
    user_id, payload = _split(rest, 2, "USER_IP")
    fields = decode_json(payload)
    if not (isinstance(fields, list) and len(fields) == 5):
        raise ProtocolError("USER_IP needs a five-element JSON array")
    token, ip, agent, device, last_seen = fields
    if not (
        isinstance(token, str)
        and isinstance(ip, str)
        and isinstance(agent, str)
        and (device is None or isinstance(device, str))
        and type(last_seen) is int
    ):
        raise ProtocolError("USER_IP fields have wrong types")
    return UserIpCommand(_word(user_id, "user id"), token, ip, agent, device, last_seen)


def _parse_history(rest: str) -> HistoryCommand:
    stream, instance, history, start = _split(rest, 4, "HISTORY")
    return HistoryCommand(
        _word(stream, "stream name"),
        _word(instance, "instance name"),
        _word(history, "history id"),
        _int(start, "start token"),
    )


_PARSERS: dict[str, Callable[[str], Command]] = {
    "SERVER": _parse_server,
    "NAME": _parse_name,
    "PING": PingCommand,
    "ERROR": ErrorCommand,
    "REPLICATE": _parse_replicate,
    "POSITION": _parse_position,
    "RDATA": _parse_rdata,
    "USER_SYNC": _parse_user_sync,
    "CLEAR_USER_SYNC": _parse_clear_user_sync,
    "FEDERATION_ACK": _parse_federation_ack,
    "REMOTE_SERVER_UP": _parse_remote_server_up,
    "USER_IP": _parse_user_ip,
    "HISTORY": _parse_history,
}


def _valid_name(name: str) -> bool:
    return name.isascii() and name.replace("_", "").isalnum() and name.upper() == name


def parse_line(line: str) -> Command:
    """Parse one line (without its newline). Raises ``ProtocolError`` on bad input."""
    name, sep, rest = line.partition(" ")
    parser = _PARSERS.get(name)
    if parser is not None:
        if not sep and name not in ("REPLICATE", "PING", "ERROR"):
            raise ProtocolError(f"{name} needs arguments")
        return parser(rest)
    if not _valid_name(name):
        raise ProtocolError(f"invalid command name {name[:40]!r}")
    if name in IGNORED_NAMES:
        return IgnoredCommand(name, rest)
    return UnknownCommand(name, rest)


def command_name(command: Command) -> str:
    """The wire name, including for ignored and unknown commands."""
    if isinstance(command, IgnoredCommand | UnknownCommand):
        return command.name
    return command.NAME


def serialise(command: Command) -> str:
    """The line for ``command``, without newline.

    ``REPLICATE`` keeps the trailing space Synapse writes. Raises ``ValueError``
    if a field would break the line (a bug in the caller, not a peer's fault).
    """
    args = command.args()
    _check_text(args, command_name(command))
    return f"{command_name(command)} {args}"


def encode(command: Command) -> bytes:
    """The UTF-8 bytes of ``command``'s line, newline included."""
    data = (serialise(command) + "\n").encode("utf-8")
    if len(data) - 1 > MAX_LINE_BYTES:
        raise ValueError(f"{command_name(command)} line is {len(data) - 1} bytes, too long")
    return data
