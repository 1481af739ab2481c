from __future__ import annotations

import pytest

from federation_sender.queue.core.states import (
    TRANSITIONS,
    DestinationState,
    DestinationStateMachine,
    IllegalTransition,
    mermaid,
)

S = DestinationState


def test_every_state_has_a_row_and_stopped_is_terminal() -> None:
    assert set(TRANSITIONS) == set(S)
    assert TRANSITIONS[S.STOPPED] == {}
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


def test_the_diagram_in_the_docs_is_drawn_from_the_transition_table() -> None:
    """The page's copy is exactly what ``python -m federation_sender.queue.core.states``
    prints: paste that when the table changes."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "queue-engine.md").read_text()
    block = doc.split("```mermaid\n", 1)[1].split("```", 1)[0]
    assert block == mermaid()
    drawn = {line.split(":")[0].strip() for line in block.splitlines()[1:]}
    table = {f"{a.name} --> {b.name}" for a, row in TRANSITIONS.items() for b in row}
    assert drawn == table


def test_only_the_drawn_transitions_are_legal() -> None:
    sm = DestinationStateMachine()
    sm.to(S.SENDING)
    sm.to(S.CATCHING_UP)  # a failure into catch-up mode, its backoff cleared at once
    sm.to(S.BACKING_OFF)
    with pytest.raises(IllegalTransition):
        sm.to(S.IDLE)  # a backoff always keeps a transaction (or drops to catch-up)
