"""The Synapse backend's part of the EDU fan-outs, for the composition root.

* :func:`synapse_edus`: keyword arguments of the replication handler beside Synapse
  (rooms and hosts as Synapse reads them for typing and receipts, partial-state
  approximation included; the presence fan-out when Synapse has presence enabled;
  the receipt pacing rate from ``federation_rr_transactions_per_room_per_second``);
  nothing for another backend.
* :func:`bind_stream_tokens`: let the backend bound its outbox reads by the replication
  tokens the handler has seen (Synapse reads pokes only up to its stream token).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from federation_sender.clock import Clock
from federation_sender.edus.presence import PresenceFanout, PresenceSink
from federation_sender.storage.protocols import Backend
from federation_sender.storage.synapse.backend import SynapseBackend
from federation_sender.storage.synapse.rooms import SynapseRooms


def synapse_edus(storage: Backend, sink: PresenceSink, clock: Clock) -> dict[str, Any]:
    if not isinstance(storage, SynapseBackend):
        return {}
    syn = storage.syn
    rooms = SynapseRooms(storage.engine)
    out: dict[str, Any] = {
        "room_hosts": rooms,
        "receipt_max_delay_s": 1.0 / syn.federation_rr_transactions_per_room_per_second,
    }
    if syn.presence_enabled:
        out["presence"] = PresenceFanout(
            syn.server_name,
            rooms,
            sink,
            clock,
            last_active_granularity_ms=syn.presence_last_active_granularity_ms,
            excluded_rooms=syn.rooms_to_exclude_from_presence,
        )
    return out


def bind_stream_tokens(storage: Backend, tokens: Mapping[str, int]) -> None:
    if isinstance(storage, SynapseBackend):
        storage.stream_token = tokens.get
