"""The runner factory: every runner of a manager shares the slot limits, the config and
one sequence of txn ids; each gets its own core, in the mode the registry asked for."""

from __future__ import annotations

from federation_sender.testing.queue_harness import Harness


async def test_runners_share_what_the_factory_holds(h: Harness) -> None:
    factory = h.make_manager().runners
    a = factory("a.test", False)
    b = factory("b.test", True, "an earlier error")
    assert a.txn_slots is b.txn_slots is factory.txn_slots
    assert a.db_slots is b.db_slots is factory.db_slots
    assert a.config is b.config is factory.config
    assert a.core is not b.core
    assert (a.destination, a.core.catching_up) == ("a.test", False)
    assert (b.destination, b.core.catching_up) == ("b.test", True)
    first = factory.next_txn_id()
    base, n = first.rsplit(".", 1)
    assert factory.next_txn_id() == f"{base}.{int(n) + 1}"
