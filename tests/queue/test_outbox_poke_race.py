"""A poke that arrives while an outbox read is in flight is not lost (the read may
have been bounded before the poked rows existed: the Synapse backend bounds device-list
reads by the replication token, and main announces a login before its pokes)."""

from __future__ import annotations

import itertools
import random

from federation_sender.queue.core.backoff import RESET, BackoffPolicy
from federation_sender.queue.core.batching import Limits
from federation_sender.queue.core.destination import DestinationCore, Idle, NeedOutbox


def test_poke_during_a_read_brings_another_read() -> None:
    ids = itertools.count()
    core = DestinationCore("d.test", BackoffPolicy(), Limits(), random.Random(0),
                           lambda: f"t{next(ids)}", max_item_failures=3, catching_up=False)
    core.load(RESET, None)
    core.poke_outbox()
    assert isinstance(core.next_step(0), NeedOutbox)
    core.poke_outbox()  # new rows announced while the read runs
    core.add_outbox([], [], True)  # the read found nothing (it was bounded before them)
    assert isinstance(core.next_step(0), NeedOutbox)
    core.add_outbox([], [], True)
    assert isinstance(core.next_step(0), Idle)
