from __future__ import annotations

from federation_sender.queue.telemetry_observer import TelemetryObserver
from federation_sender.telemetry import names as n
from federation_sender.telemetry.metrics import Metrics, new_registry
from federation_sender.testing.clock import FakeClock
from federation_sender.transport.result import Outcome


def test_event_processing_lag_runs_from_announcement_to_fan_out() -> None:
    clock = FakeClock()
    registry = new_registry(process_metrics=False)
    obs = TelemetryObserver(Metrics(registry), None, clock)
    obs.note_poke(10)
    clock.advance(1.0)
    obs.note_poke(20)
    clock.advance(1.5)
    obs.events_processed(count=10, position=10, fanned_out=30)
    assert registry.get_sample_value(n.EVENT_PROCESSING_LAG_S) == 2.5
    clock.advance(0.5)
    obs.events_processed(count=10, position=20, fanned_out=30)
    assert registry.get_sample_value(n.EVENT_PROCESSING_LAG_S) == 2.0  # announced at t=1
    obs.events_processed(count=0, position=20, fanned_out=0)
    assert registry.get_sample_value(n.EVENT_PROCESSING_LAG_S) == 0.0
    assert registry.get_sample_value(
        n.EVENT_PROCESSING_POSITIONS, {"name": n.EVENT_PROCESSING_NAME}
    ) == 20


def test_transaction_outcomes_are_counted() -> None:
    registry = new_registry(process_metrics=False)
    obs = TelemetryObserver(Metrics(registry), None, FakeClock())
    obs.transaction_sent("d.test", "t1", Outcome.SUCCESS, 200, 3, 1, {"m.typing": 1}, 100,
                         0.2, False)
    obs.transaction_sent("d.test", "t2", Outcome.TRANSIENT, None, 3, 1, {}, 100, 1.0, False)
    assert registry.get_sample_value(n.SENT_TRANSACTIONS + "_total") == 1
    assert registry.get_sample_value(n.DELIVERED_PDUS + "_total") == 3
