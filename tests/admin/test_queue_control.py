"""The admin API's names for a queue's state: a stopped queue reads as idle, a parked
destination as backing off with its next retry."""

from __future__ import annotations

from dataclasses import replace

from federation_sender.admin.queue_control import live_state
from federation_sender.queue.core.states import DestinationState
from federation_sender.queue.core.status import parked_status


def test_the_admin_states_of_a_parked_and_a_stopped_queue() -> None:
    parked = parked_status("d.test", retry_at_ms=9_000, retry_interval_ms=60_000,
                           last_error="HTTP 502")
    assert live_state(parked) == {
        "state": "backing_off", "pending_pdus": 0, "pending_edus": 0,
        "in_flight_txn_id": None, "in_flight_age_s": None, "last_error": "HTTP 502",
        "next_retry_ts": 9_000, "last_success_ts": None, "catching_up": True,
    }
    stopped = replace(parked, state=DestinationState.STOPPED)
    assert live_state(stopped)["state"] == "idle"
    assert {live_state(replace(parked, state=s))["state"] for s in DestinationState} == {
        "idle", "sending", "backing_off", "catching_up",
    }
