"""The explicit state machine of one destination.

::

    IDLE ──work──▶ SENDING ──200, nothing left──▶ IDLE
      │              │  ▲
      │         failure  └──backoff over──┐
      │              ▼                    │
      └─────────▶ BACKING_OFF ────────────┘
                     │  ▲
        backoff over │  │ failure
                     ▼  │
                  CATCHING_UP ──nothing outstanding──▶ SENDING / IDLE

``STOPPED`` is terminal and reachable from every state (shutdown, idle eviction).
Catching up is also a *mode* (a flag on the queue) that survives a backoff: a queue
backing off while in catch-up mode returns to ``CATCHING_UP``, not ``SENDING``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable


class DestinationState(enum.Enum):
    IDLE = "idle"
    SENDING = "sending"
    BACKING_OFF = "backing_off"
    CATCHING_UP = "catching_up"
    STOPPED = "stopped"


S = DestinationState

TRANSITIONS: dict[DestinationState, frozenset[DestinationState]] = {
    S.IDLE: frozenset({S.SENDING, S.CATCHING_UP, S.BACKING_OFF, S.STOPPED}),
    S.SENDING: frozenset({S.IDLE, S.BACKING_OFF, S.CATCHING_UP, S.STOPPED}),
    S.BACKING_OFF: frozenset({S.SENDING, S.CATCHING_UP, S.IDLE, S.STOPPED}),
    S.CATCHING_UP: frozenset({S.SENDING, S.IDLE, S.BACKING_OFF, S.STOPPED}),
    S.STOPPED: frozenset(),
}


class IllegalTransition(RuntimeError):
    def __init__(self, old: DestinationState, new: DestinationState) -> None:
        super().__init__(f"illegal destination state transition {old.value} -> {new.value}")
        self.old = old
        self.new = new


class DestinationStateMachine:
    """Holds the current state; every change goes through :meth:`to`."""

    __slots__ = ("_on_change", "_state")

    def __init__(
        self,
        on_change: Callable[[DestinationState, DestinationState], None] | None = None,
        initial: DestinationState = S.IDLE,
    ) -> None:
        self._state = initial
        self._on_change = on_change

    @property
    def state(self) -> DestinationState:
        return self._state

    def to(self, new: DestinationState) -> None:
        """Move to ``new``; staying in the same state is a no-op, anything not in
        :data:`TRANSITIONS` raises :class:`IllegalTransition`."""
        old = self._state
        if new is old:
            return
        if new not in TRANSITIONS[old]:
            raise IllegalTransition(old, new)
        self._state = new
        if self._on_change is not None:
            self._on_change(old, new)
