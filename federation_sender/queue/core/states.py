"""The explicit state machine of one destination.

:data:`TRANSITIONS` lists the legal transitions, each with what causes it, and nothing
else; the diagram in ``docs/queue-engine.md`` is drawn from it (:func:`mermaid`, printed
by ``python -m federation_sender.queue.core.states``), and
``tests/queue/test_destination_state.py`` fails when the page's copy differs.

* ``IDLE -> SENDING | CATCHING_UP``: work arrives (a queue created in catch-up mode
  starts catching up); ``IDLE -> BACKING_OFF``: it loads a persisted backoff.
* ``SENDING -> IDLE``: nothing left; ``SENDING -> BACKING_OFF``: a failure or a 429;
  ``SENDING -> CATCHING_UP``: a failure dropped the queue to catch-up and a wake-up
  (REMOTE_SERVER_UP) cleared the backoff before the next step.
* ``BACKING_OFF -> SENDING``: the backoff is over (or cleared) with the frozen
  transaction to resend; ``BACKING_OFF -> CATCHING_UP``: it is over in catch-up mode
  (a backoff past an hour drops the queue to catch-up).
* ``CATCHING_UP -> SENDING | IDLE``: the episode ended; ``CATCHING_UP -> BACKING_OFF``:
  a failure.
* ``STOPPED`` is terminal and reachable from every state (shutdown, idle eviction).

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

TRANSITIONS: dict[DestinationState, dict[DestinationState, str]] = {
    S.IDLE: {
        S.SENDING: "work",
        S.CATCHING_UP: "work, in catch-up mode",
        S.BACKING_OFF: "a persisted backoff loaded",
        S.STOPPED: "",
    },
    S.SENDING: {
        S.IDLE: "200, nothing left",
        S.BACKING_OFF: "failure, or 429",
        S.CATCHING_UP: "failure into catch-up, woken at once",
        S.STOPPED: "",
    },
    S.BACKING_OFF: {
        S.SENDING: "backoff over or cleared",
        S.CATCHING_UP: "backoff over, in catch-up mode",
        S.STOPPED: "",
    },
    S.CATCHING_UP: {
        S.SENDING: "episode over, items pending",
        S.IDLE: "episode over, nothing outstanding",
        S.BACKING_OFF: "failure",
        S.STOPPED: "",
    },
    S.STOPPED: {},
}
"""From each state, the states it may move to and what moves it (empty: shutdown or
idle eviction, from anywhere)."""


def mermaid() -> str:
    """:data:`TRANSITIONS` as the Mermaid state diagram of ``docs/queue-engine.md``: the
    labelled transitions first, in the table's order, then the unlabelled ones."""
    edges = [(a, b, why) for a, row in TRANSITIONS.items() for b, why in row.items()]
    lines = [f"    {a.name} --> {b.name}: {why}" for a, b, why in edges if why]
    lines += [f"    {a.name} --> {b.name}" for a, b, why in edges if not why]
    return "stateDiagram-v2\n" + "\n".join(lines) + "\n"


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


if __name__ == "__main__":
    print(mermaid(), end="")
