from __future__ import annotations

import pytest

from federation_sender.queue.destination import (
    TRANSITIONS,
    DestinationState,
    DestinationStateMachine,
    IllegalTransition,
)

S = DestinationState


def test_every_state_has_a_row_and_stopped_is_terminal() -> None:
    assert set(TRANSITIONS) == set(S)
    assert TRANSITIONS[S.STOPPED] == frozenset()
    assert all(S.STOPPED in TRANSITIONS[s] for s in S if s is not S.STOPPED)


def test_transitions_are_reported_and_illegal_ones_raise() -> None:
    seen: list[tuple[S, S]] = []
    sm = DestinationStateMachine(lambda a, b: seen.append((a, b)))
    sm.to(S.SENDING)
    sm.to(S.SENDING)  # same state: no-op, not reported
    sm.to(S.BACKING_OFF)
    sm.to(S.CATCHING_UP)
    sm.to(S.STOPPED)
    assert seen == [(S.IDLE, S.SENDING), (S.SENDING, S.BACKING_OFF),
                    (S.BACKING_OFF, S.CATCHING_UP), (S.CATCHING_UP, S.STOPPED)]
    with pytest.raises(IllegalTransition, match="stopped -> sending"):
        sm.to(S.SENDING)
    assert sm.state is S.STOPPED
