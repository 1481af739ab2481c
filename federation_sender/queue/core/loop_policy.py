"""When an idle queue's runner exits: idle eviction, sans-I/O (times are monotonic
seconds, given by the caller) so that the core's state machine and unit tests reach it.

An idle queue records since when (:meth:`LoopPolicy.idle_started`); the housekeeping
asks those idle past the TTL to exit (:meth:`LoopPolicy.evict_if_idle`), and the queue
exits when it wakes from that request still empty.

When a queue *sends* is not decided here but by the core's table of next steps
(:data:`~federation_sender.queue.core.destination.NEXT_STEP`): with nothing in flight it
sends what it holds at once, however little; what arrives while a transaction is in
flight goes in the next one; the one other wait is upstream, the fan-out's hand-over
gate (:mod:`~federation_sender.queue.coalesce`).
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
