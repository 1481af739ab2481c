"""Per-destination metrics for the domains an operator names (Synapse's
``federation_metrics_domains``).

Synapse exports one series per listed destination: the ``origin_server_ts`` (seconds)
of the last PDU of each transaction that destination accepted,
``synapse_federation_last_sent_pdu_time{destination_server_name=...}`` (the scrape adds
``server_name``, as for every ``synapse_*`` series). Unlisted destinations get no series,
so the label's cardinality stays the operator's choice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

LAST_SENT_PDU_TIME = "synapse_federation_last_sent_pdu_time"


class DomainMetrics:
    def __init__(self, registry: CollectorRegistry | None, domains: Iterable[str]) -> None:
        self.domains = frozenset(domains)
        self._gauge = Gauge(
            LAST_SENT_PDU_TIME,
            "The timestamp of the last PDU which was successfully sent to the given domain",
            ["destination_server_name"], registry=registry,
        )  # fmt: skip

    def transaction_accepted(self, destination: str, pdus: Sequence[Mapping[str, Any]]) -> None:
        if not pdus or destination not in self.domains:
            return
        ts = pdus[-1].get("origin_server_ts")
        if isinstance(ts, int | float) and not isinstance(ts, bool):
            self._gauge.labels(destination).set(ts / 1000)
