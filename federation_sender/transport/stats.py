"""What the federation client's attempts leave behind: counters for the telemetry layer,
the remote's per-PDU errors logged, a failed attempt logged at DEBUG (the queue logs a
WARNING once when a destination starts failing), and the hook through which the
telemetry layer counts HTTP requests and responses."""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Protocol

from federation_sender.transport.result import Outcome, SendResult, Transaction

logger = logging.getLogger("federation_sender.transport.client")


class RequestCounter(Protocol):
    """Counts requests and responses (Synapse's ``matrixfederationclient`` metrics)."""

    def http_request(self, method: str) -> None: ...

    def http_response(self, method: str, code: int) -> None: ...


@dataclasses.dataclass
class TransportStats:
    """Counters for the telemetry layer to export."""

    attempts: int = 0
    outcomes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    pdu_errors: int = 0
    request_bytes: int = 0

    def record(self, txn: Transaction, result: SendResult) -> None:
        """Count an attempt's result (its ``request_bytes`` set) and log what it says."""
        self.outcomes[result.outcome.value] += 1
        self.request_bytes += result.request_bytes
        for event_id, error in result.pdu_errors.items():
            self.pdu_errors += 1
            logger.warning(
                "%s rejected PDU %s in txn %s: %s", txn.destination, event_id, txn.txn_id, error
            )
        if result.outcome is not Outcome.SUCCESS:
            logger.debug("txn %s to %s: %s (%s)", txn.txn_id, txn.destination,
                         result.outcome.value, result.error)
