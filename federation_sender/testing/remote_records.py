"""What a fake remote homeserver is told to do and what it recorded: the data side of
:mod:`federation_sender.testing.remote_core` (the scripted :class:`Behaviour`, one
:class:`ReceivedTxn` per attempt, one :class:`RemoteRecord` per destination)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class Behaviour:
    status: int = 200
    """Answer this status ..."""
    times: int | None = None
    """... for the next ``times`` requests (None: until changed)."""
    delay_s: float = 0.0
    hang: bool = False
    """Never answer (until :meth:`Receiver.release` or close)."""
    max_body_bytes: int | None = None
    """Answer 413 to bodies larger than this."""
    reject_event_ids: set[str] = field(default_factory=set)
    reject_edu_types: set[str] = field(default_factory=set)
    reject_message_ids: set[str] = field(default_factory=set)
    """Refuse a transaction holding a to-device EDU with one of these ``message_id``s."""
    reject_status: int = 400

    @property
    def plain(self) -> bool:
        return (
            self.status == 200
            and self.max_body_bytes is None
            and not (self.reject_event_ids or self.reject_edu_types or self.reject_message_ids)
        )

    def after_times(self) -> Behaviour:
        """What follows once ``times`` ran out: normal status, the same refusals."""
        return replace(self, status=200, times=None, delay_s=0.0, hang=False)


@dataclass(frozen=True)
class ReceivedTxn:
    """One attempt that reached the transaction rules (any status)."""

    destination: str
    txn_id: str
    origin: str
    pdus: list[dict[str, Any]]
    edus: list[dict[str, Any]]
    body_bytes: int
    status: int
    duplicate: bool = False
    received_ts_s: float = 0.0
    pdu_event_ids: tuple[str, ...] = ()

    @property
    def event_ids(self) -> list[str]:
        return list(self.pdu_event_ids)

    @property
    def edu_types(self) -> list[str]:
        return [str(e.get("edu_type")) for e in self.edus]


@dataclass(slots=True)
class RemoteRecord:
    """What one destination saw. ``outcomes`` is keyed by names such as ``"200"``."""

    txns: list[ReceivedTxn] = field(default_factory=list)
    """Transactions processed (accepted, not duplicates); only when recording."""
    pdu_counts: Counter[str] = field(default_factory=Counter)
    """event id -> how many processed transactions carried it (>1 is a duplicate)."""
    pdu_rooms: dict[str, str] = field(default_factory=dict)
    edus: list[dict[str, Any]] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    retransmits: int = 0
    """Requests for an already-answered transaction id (answered from the cache)."""
    max_concurrent: int = 0
    """The most requests this destination was handling at once (``one in flight`` ≤ 1)."""

    @property
    def pdus_received(self) -> int:
        return sum(self.pdu_counts.values())
