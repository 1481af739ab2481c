"""The queue's pure core: what a destination's queue decides, with no I/O.

Nothing here awaits, reads the clock, talks to a database or a socket, or reports
metrics: time comes in as ``now_ms``, randomness as a ``random.Random``, results as
:class:`~federation_sender.transport.result.SendResult` values, and decisions go out as
return values (:class:`~.effects.Effects` and the steps ``Send``, ``Wait``, ``NeedOutbox``,
``NeedCatchup``, ``Idle``). The asyncio shell in
``queue/`` (``runner.py``, ``manager.py``, ``persistence.py``) feeds it and carries its
decisions out. An import-linter contract (pyproject.toml, "The queue's core is pure")
forbids asyncio, aiohttp, SQLAlchemy, storage, the clock and telemetry here, indirect
imports included, so a Hypothesis model can drive it step by step
(tests/queue/test_core_statemachine.py).

* :mod:`.destination`: :class:`~.destination.DestinationCore`, one destination's queue:
  pending items, the frozen in-flight transaction, the next step (``NEXT_STEP``, a
  table), what a result implies;
* :mod:`.states`: the destination's states and their transition table;
* :mod:`.items`, :mod:`.batching`: the items and how a transaction is filled (50 PDUs,
  100 EDUs, a byte budget, EDU order);
* :mod:`.backoff`: the persisted backoff, the short-retry phase, 429 pauses;
* :mod:`.isolation`: finding and dropping a poison item by bisection;
* :mod:`.catchup`, :mod:`.episode`: catch-up planning over ``destination_rooms`` and one
  episode of it;
* :mod:`.pacing`: pacing a backlog to what the receiver has confirmed;
* :mod:`.loop_policy`: when an idle queue ends and how long it waits;
* :mod:`.steps`, :mod:`.effects`, :mod:`.status`: the steps, what a result implies,
  and the read model the admin API and metrics show.
"""
