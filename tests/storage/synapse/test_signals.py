"""The Synapse backend's committed signals become replication commands; those a
disconnected client could not send are counted, and the next POSITION covers them."""

from __future__ import annotations

from federation_sender.replication import commands as c
from federation_sender.storage.synapse.signals import PendingSignals, ReplicationSignals

FUNC = "get_destination_retry_timings"


def test_signals_are_published_in_order_and_the_position_covers_them() -> None:
    sent: list[c.Command] = []
    signals = ReplicationSignals("fed1")
    signals.attach(lambda command: sent.append(command) is None)
    signals.emit(PendingSignals([(7, FUNC, ["a.test"], 100), (5, FUNC, ["b.test"], 101)],
                                ["a.test"]))
    assert sent == [
        c.RdataCommand("caches", "fed1", 7, [FUNC, ["a.test"], 100]),
        c.RdataCommand("caches", "fed1", 5, [FUNC, ["b.test"], 101]),
        c.RemoteServerUpCommand("a.test"),
    ]
    assert signals.dropped == 0
    assert list(signals.announce()) == [c.PositionCommand("caches", "fed1", 7, 7)]


def test_what_a_disconnected_client_cannot_send_is_counted_not_lost() -> None:
    signals = ReplicationSignals("fed1")
    signals.emit(PendingSignals([(3, FUNC, ["a.test"], 1)], ["a.test"]))  # never attached
    signals.attach(lambda _command: False)  # attached, but the connection is down
    signals.emit(PendingSignals([(4, FUNC, ["b.test"], 2)], []))
    assert signals.dropped == 3
    # The invalidations stay in the database; the POSITION makes readers fetch them.
    assert list(signals.announce()) == [c.PositionCommand("caches", "fed1", 4, 4)]
