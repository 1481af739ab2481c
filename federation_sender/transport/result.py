"""The narrow interface between the queue engine and the federation client.

The queue engine never sees aiohttp: it hands a transaction to a
:class:`TransactionSender` and acts on the classified :class:`SendResult`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

JsonDict = dict[str, Any]


class Outcome(enum.Enum):
    SUCCESS = "success"
    """200: the remote accepted the transaction (individual PDUs may still have errors)."""
    TRANSIENT = "transient"
    """Timeout, connection error, 5xx, 429: back off and retry the same transaction."""
    PERMANENT = "permanent"
    """401/403 M_UNAUTHORIZED, 410, 400: retrying the same bytes will not help."""
    TOO_LARGE = "too_large"
    """413: split the transaction and retry the halves."""


@dataclass(frozen=True, slots=True)
class SendResult:
    outcome: Outcome
    status: int | None = None
    """HTTP status, or None when no response was received."""
    error: str = ""
    """Short, log-safe description of the failure (never contains secrets)."""
    errcode: str | None = None
    retry_after_s: float | None = None
    """From a 429's ``retry_after_ms`` or ``Retry-After`` header."""
    pdu_errors: Mapping[str, str] = field(default_factory=dict)
    """event_id -> error string, from a 200 response's ``pdus`` map."""
    request_bytes: int = 0
    duration_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Transaction:
    destination: str
    txn_id: str
    pdus: Sequence[JsonDict]
    edus: Sequence[JsonDict]
    pdu_bytes: Sequence[bytes] | None = None
    """The canonical JSON of each of ``pdus``, in order, when the caller has it (the
    queue engine encodes each event once for all its destinations); ``None``: a
    sender that needs it encodes the PDUs itself."""


class TransactionSender(Protocol):
    async def send_transaction(self, txn: Transaction) -> SendResult:
        """Send one transaction; never raises for remote failures, only classifies them.

        Must return within the configured per-attempt deadline.
        """


def signature_counts(sender: object) -> tuple[int, int]:
    """(transaction signatures computed, those over another destination's content) by
    ``sender`` since it started, if it counts them (a ``signature_counts`` attribute:
    :class:`~federation_sender.transport.client.FederationClient` does); else (0, 0)."""
    counts = getattr(sender, "signature_counts", None)
    if isinstance(counts, tuple) and len(counts) == 2:
        return int(counts[0]), int(counts[1])
    return 0, 0


def attempt_bound_s(sender: object) -> float | None:
    """How long any ``send_transaction`` of ``sender`` can take at most, in seconds of
    the event loop's clock, if the sender says so (an ``attempt_bound_s`` attribute:
    :class:`~federation_sender.transport.client.FederationClient` bounds every attempt
    itself); ``None``: unknown, its caller must bound it."""
    bound = getattr(sender, "attempt_bound_s", None)
    return float(bound) if isinstance(bound, int | float) and bound > 0 else None


class EventHeld(enum.Enum):
    """A receiver's answer to ``GET /_matrix/federation/v1/event/{eventId}``."""

    YES = "yes"
    """200: it holds the event (Synapse: processed and persisted)."""
    NOT_YET = "not_yet"
    """404 as Synapse answers it (a JSON body that is not ``M_UNRECOGNIZED``)."""
    NO_ANSWER = "no_answer"
    """No response, or another status: ask again."""
    UNSUPPORTED = "unsupported"
    """404 ``M_UNRECOGNIZED`` or not JSON: the receiver does not serve the request."""


@runtime_checkable
class ServerProbe(Protocol):
    async def server_answers(self, destination: str) -> bool:
        """Whether ``destination`` answers HTTP again (a status below 500). Never
        raises for remote failures."""
        ...


@runtime_checkable
class EventProbe(Protocol):
    async def event_persisted(self, destination: str, event_id: str) -> EventHeld:
        """Whether ``destination`` holds ``event_id``. Never raises for remote
        failures."""
