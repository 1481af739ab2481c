"""The admin API's view of the queue engine (:class:`QueueControl` over the manager)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from federation_sender.admin.protocols import LiveState
from federation_sender.queue.core.states import DestinationState
from federation_sender.queue.core.status import DestinationStatus
from federation_sender.queue.manager import QueueManager

_ADMIN_STATE: dict[DestinationState, str] = {
    DestinationState.IDLE: "idle",
    DestinationState.SENDING: "sending",
    DestinationState.BACKING_OFF: "backing_off",
    DestinationState.CATCHING_UP: "catching_up",
    DestinationState.STOPPED: "idle",
}


def live_state(st: DestinationStatus) -> LiveState:
    return {
        "state": _ADMIN_STATE[st.state],  # type: ignore[typeddict-item]
        "pending_pdus": st.pending_pdus,
        "pending_edus": st.pending_edus,
        "in_flight_txn_id": st.in_flight_txn_id,
        "in_flight_age_s": st.in_flight_age_s,
        "last_error": st.last_error,
        "next_retry_ts": st.next_retry_ts_ms,
        "last_success_ts": st.last_success_ts_ms,
        "catching_up": st.catching_up,
    }


class AdminQueueControl:
    """Implements :class:`federation_sender.admin.protocols.QueueControl`."""

    def __init__(self, manager: QueueManager) -> None:
        self._m = manager

    def live_state(self, destination: str) -> Mapping[str, Any] | None:
        st = self._m.status(destination)
        return None if st is None else live_state(st)

    def live_states(self) -> Mapping[str, Mapping[str, Any]]:
        return {st.destination: live_state(st) for st in self._m.statuses()}

    async def reset_connection(self, destination: str) -> bool:
        return await self._m.reset_connection(destination)
