"""When a queue holds a part-filled transaction back, and when its runner exits: the
loop policy the runner used to keep, sans-I/O (times are monotonic seconds, given by the
caller) so that the core's state machine and unit tests reach it.

* **The steady-stream hold.** A destination that receives a steady stream of new events
  sends at most one part-filled transaction per ``busy_interval_s``: at a high rate each
  transaction then carries more PDUs, and the per-transaction work (signature, HTTP
  exchange, result write) is shared by more of them. :meth:`LoopPolicy.note_sent` counts the
  PDUs of each new live transaction; :meth:`LoopPolicy.hold_left_s` says how long the next
  part-filled one waits. While it waits (``holding``), new items do not wake the queue
  until its batch is full. The intake's hold (:mod:`~federation_sender.queue.coalesce`)
  is separate.
* **Idle eviction.** An idle queue records since when (:meth:`LoopPolicy.idle_started`); the
  housekeeping asks those idle past the TTL to exit (:meth:`LoopPolicy.evict_if_idle`), and
  the queue exits when it wakes from that request still empty.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from federation_sender.queue.steps import FrozenTxn


class LoopPolicy:
    # Slotted: one per live queue, thousands of them in a spike.
    __slots__ = (
        "_evict", "_window_pdus", "_window_start", "holding", "idle_since", "interval_s",
        "min_pdus", "steady_until",
    )

    def __init__(self, interval_s: float = 0.0, min_pdus: int = 0) -> None:
        self.interval_s = interval_s
        self.min_pdus = min_pdus
        self._window_start = -math.inf
        self._window_pdus = 0
        self.steady_until = 0.0
        """Monotonic time until which the destination counts as in a steady stream, one
        interval after its last send in one (:meth:`note_sent`); 0.0 when it is not.
        Before then a part-filled transaction waits."""
        self.holding = False
        """Waiting for ``steady_until``: new items do not wake the queue until its batch
        is full."""
        self.idle_since: float | None = None
        """Monotonic time the queue went idle (None while busy)."""
        self._evict = False

    # --- the steady-stream hold ----------------------------------------------------------

    def note_sent(self, txn: FrozenTxn, pdus_left: bool, now_s: float) -> None:
        """Count the PDUs of a new live transaction that emptied the queue's PDUs
        (``pdus_left`` False: the stream's supply set its size, not the limits) in the
        current interval (one starts with the first such send after the last interval
        ended). Once they reach ``min_pdus`` the destination is in a steady stream, and
        the next part-filled transaction waits until one interval after this send: a
        batch that filled early does not leave its successor to go out near empty at
        the end of the interval. A transaction cut by the limits counts nothing (a
        backlog does not make a stream), but within one interval of the stream's last
        send what it left waits like the rest: a hand-over that overfilled a held batch
        does not send its remainder at once (a burst after a quiet spell does).
        Retries, catch-up and EDU-only transactions neither count nor wait."""
        interval = self.interval_s
        batch = txn.batch
        if not interval or txn.attempts or batch.catchup or not batch.pdus:
            return  # an EDU-only transaction does not move the stream's clock
        if pdus_left:
            if now_s < self.steady_until:
                self.steady_until = now_s + interval
            return
        if now_s - self._window_start >= interval:
            self._window_start, self._window_pdus = now_s, 0
        self._window_pdus += len(batch.pdus)
        busy = self._window_pdus >= self.min_pdus
        self.steady_until = now_s + interval if busy else 0.0

    def hold_left_s(self, now_s: float) -> float:
        """How long a part-filled transaction waits now (0.0: it goes; a stream whose
        interval has passed is over)."""
        left = self.steady_until - now_s
        if left <= 0:
            self.steady_until = 0.0
            return 0.0
        return left

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
