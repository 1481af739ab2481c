"""When a queue sends, and when its runner exits: the loop policy, sans-I/O (times are
monotonic seconds, given by the caller) so that the core's state machine and unit tests
reach it.

* **Send at once; batch only behind a transaction in flight.** As Synapse's
  ``PerDestinationQueue``: a destination has at most one transaction in flight, a new
  item wakes its queue at once, and a queue with nothing in flight sends what it holds
  now, however little. What arrives while a transaction is in flight waits for its
  answer, and the next transaction takes all of it (within the PDU, EDU and byte
  limits). At a low rate every PDU goes alone and at once; at a high rate the round
  trip sets the transactions' size, so batching grows with the load by itself.
  The one other wait is upstream: while the fan-out is behind (a deep queue of events
  not yet handed over), a part-filled batch waits for its hand-overs, at most
  ``queue.coalesce_hold_s`` (:mod:`~federation_sender.queue.coalesce`). Nothing holds
  a queue for a time of its own (the former steady-stream hold,
  ``queue.busy_txn_interval_s``, held a part-filled transaction up to 2 s: a chat
  message waited for a batch that was not coming).
* **Idle eviction.** An idle queue records since when (:meth:`LoopPolicy.idle_started`); the
  housekeeping asks those idle past the TTL to exit (:meth:`LoopPolicy.evict_if_idle`), and
  the queue exits when it wakes from that request still empty.
"""

from __future__ import annotations

from collections.abc import Callable


class LoopPolicy:
    # Slotted: one per live queue, thousands of them in a spike.
    __slots__ = ("_evict", "idle_since")

    def __init__(self) -> None:
        self.idle_since: float | None = None
        """Monotonic time the queue went idle (None while busy)."""
        self._evict = False

    # --- idle eviction -------------------------------------------------------------------

    def idle_started(self, now_s: float) -> None:
        self.idle_since = now_s

    def evict_if_idle(self, now_s: float, ttl_s: float, empty: Callable[[], bool]) -> bool:
        """Ask a queue idle since ``ttl_s`` before ``now_s`` to exit (``empty()``: it
        holds nothing); True if it was asked (its runner is then woken)."""
        since = self.idle_since
        if since is None or now_s - since < ttl_s or not empty():
            return False
        self._evict = True
        return True

    def idle_ended(self, empty: Callable[[], bool]) -> bool:
        """The idle wait is over: True if the queue exits (asked to, and ``empty()``
        still; asked only then: this runs at every wake-up of an idle queue)."""
        self.idle_since = None
        if not self._evict:
            return False
        self._evict = False
        return empty()
