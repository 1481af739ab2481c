"""What a :class:`~federation_sender.queue.core.destination.DestinationCore` asks its shell to do
next: the steps, and the frozen transaction a :class:`Send` carries. What a result
implies, to persist and report, is :mod:`.effects`."""

from __future__ import annotations

from dataclasses import dataclass

from federation_sender.queue.core.batching import Batch


@dataclass(frozen=True, slots=True)
class Idle:
    pass


@dataclass(frozen=True, slots=True)
class Wait:
    until_ms: int


@dataclass(frozen=True, slots=True)
class NeedCatchup:
    after: int
    """The episode's base position: gaps are replayed from here."""
    cursor: tuple[int, str | None]
    """Read ``destination_rooms`` rows past this (stream_ordering, room_id) keyset."""
    exhausted: bool = False
    """The last read returned fewer rows than asked: no need to read again."""
    skip_rooms: tuple[str, ...] = ()
    """Not empty: a read *beside* these rooms, whose next pages await the receiver's
    confirmation: the rows of other rooms past ``cursor`` (the episode's side cursor),
    so that a room's long gap holds back no other room."""


@dataclass(frozen=True, slots=True)
class NeedOutbox:
    to_device_after: int
    device_lists_after: int


@dataclass(frozen=True, slots=True)
class FrozenTxn:
    txn_id: str
    batch: Batch
    attempts: int = 0


@dataclass(frozen=True, slots=True)
class Send:
    txn: FrozenTxn


@dataclass(frozen=True, slots=True)
class ProbeReturn:
    """Ask whether a destination in its persisted backoff answers again (a ``GET`` of
    its version), then tell :meth:`~federation_sender.queue.core.destination.
    DestinationCore.on_return_probe`."""


@dataclass(frozen=True, slots=True)
class AwaitConfirmation:
    """Everything left to send is of rooms whose PDUs wait for the receiver's
    confirmation (pacing): wait until one is confirmed (or given up), or a new item
    comes."""


Step = Idle | Wait | NeedCatchup | NeedOutbox | Send | ProbeReturn | AwaitConfirmation
