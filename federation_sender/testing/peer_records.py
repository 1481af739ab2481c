"""What the fake remote homeservers of :mod:`federation_sender.testing.synapse_peer`
record: transactions received, rooms joined or hosted, refusals. The network's lock
guards every record (read them in ``wait_for`` predicates or under ``locked()``)."""

from __future__ import annotations

import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from federation_sender.testing.peer_rooms import HostedRoom
from federation_sender.transport.signing import SigningKey


class PeerRequestError(RuntimeError):
    """A request a peer made was refused; one line with status and body."""


@dataclass(frozen=True)
class ReceivedTransaction:
    origin: str
    txn_id: str
    pdus: tuple[dict[str, Any], ...]
    edus: tuple[dict[str, Any], ...]
    event_ids: tuple[str, ...]
    received_s: float


@dataclass(frozen=True)
class JoinedRoom:
    room_id: str
    room_version: str
    join_event_id: str
    via: str
    state_event_count: int


@dataclass
class FederationPeer:
    """One fake homeserver. Read its records only inside :meth:`PeerNetwork.wait_for`
    predicates or after a wait returned (the network's lock guards them)."""

    server_name: str
    key: SigningKey
    sockets: list[socket.socket]
    transactions: list[ReceivedTransaction] = field(default_factory=list)
    retried_transactions: int = 0
    refused_transactions: int = 0
    rejected: list[str] = field(default_factory=list)
    other_requests: list[str] = field(default_factory=list)
    rooms: dict[str, JoinedRoom] = field(default_factory=dict)
    hosted: dict[str, HostedRoom] = field(default_factory=dict)
    """Rooms this peer created (see :mod:`federation_sender.testing.peer_rooms`)."""
    leave_templates: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per room: what ``make_leave`` answers (room version, prev and auth events, depth);
    a room without one gets 404, as from a server that is not in it."""
    leaves: list[dict[str, Any]] = field(default_factory=list)
    """Leave events received by ``send_leave`` (accepted)."""
    send_status: int = 200
    """Answer ``/send`` with this status (200 accepts; anything else refuses)."""
    event_ids_seen: set[str] = field(default_factory=set, repr=False)
    """Every distinct event id received (kept as transactions are recorded, so a wait
    over thousands of events and hundreds of peers does not rescan every transaction)."""
    _txn_keys: set[tuple[str, str]] = field(default_factory=set, repr=False)

    def record_transaction(self, txn: ReceivedTransaction) -> bool:
        """Record ``txn`` unless its ``(origin, txn_id)`` was recorded before (a retry,
        counted in ``retried_transactions``, as Synapse deduplicates); True if new."""
        key = (txn.origin, txn.txn_id)
        if key in self._txn_keys:
            self.retried_transactions += 1
            return False
        self._txn_keys.add(key)
        self.transactions.append(txn)
        self.event_ids_seen.update(txn.event_ids)
        return True

    def user_id(self, localpart: str = "peer") -> str:
        return f"@{localpart}:{self.server_name}"

    def event_counts(self, room_id: str | None = None) -> Counter[str]:
        """How many times each event id arrived, over distinct transactions."""
        counts: Counter[str] = Counter()
        for txn in self.transactions:
            if room_id is None:
                counts.update(txn.event_ids)
                continue
            for eid, pdu in zip(txn.event_ids, txn.pdus, strict=True):  # bodies kept
                if pdu.get("room_id") == room_id:
                    counts[eid] += 1
        return counts

    def edus(self, edu_type: str | None = None) -> list[dict[str, Any]]:
        """Every EDU received (of ``edu_type`` only, if given)."""
        edus = [e for t in self.transactions for e in t.edus]
        return edus if edu_type is None else [e for e in edus if e.get("edu_type") == edu_type]
