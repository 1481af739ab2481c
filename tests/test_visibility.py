"""The catch-up visibility rule (:mod:`federation_sender.visibility`), pure: each
history visibility, an erased sender, a remote sender in a partial-state room, a
destination with and without members in the state after the event, and the
destination's own membership events."""

from __future__ import annotations

import pytest

from federation_sender.storage.synapse import visibility as synapse_visibility
from federation_sender.visibility import SHAREABLE, EventFacts, Verdict, decide

SEND, ERASED = Verdict.SEND, Verdict.ERASED_SENDER
HIDDEN, PARTIAL = Verdict.HISTORY_VISIBILITY, Verdict.REMOTE_PARTIAL_STATE


@pytest.mark.parametrize(
    ("visibility", "memberships", "verdict"),
    [
        ("world_readable", (), SEND),
        ("world_readable", ("leave",), SEND),
        ("shared", (), SEND),
        ("shared", ("ban",), SEND),
        ("invited", ("invite",), SEND),
        ("invited", ("join",), SEND),
        ("invited", ("leave", "invite"), SEND),
        ("invited", ("leave",), HIDDEN),
        ("invited", ("knock",), HIDDEN),
        ("invited", (), HIDDEN),
        ("joined", ("join",), SEND),
        ("joined", ("leave", "join"), SEND),
        ("joined", ("invite",), HIDDEN),
        ("joined", ("leave", "ban"), HIDDEN),
        ("joined", (), HIDDEN),
        ("something_new", (), SEND),  # not invited/joined: Synapse lets it through
    ],
)
def test_history_visibility(
    visibility: str, memberships: tuple[str, ...], verdict: Verdict
) -> None:
    f = EventFacts(history_visibility=visibility, memberships=memberships)
    assert decide(f) is verdict


def test_no_history_visibility_in_state_is_shared() -> None:
    assert decide(EventFacts()) is SEND
    assert decide(SHAREABLE) is SEND


@pytest.mark.parametrize("visibility", ["world_readable", "shared", "invited", "joined"])
def test_erased_sender_is_withheld_whatever_the_visibility_and_members(visibility: str) -> None:
    f = EventFacts(sender_erased=True, history_visibility=visibility, memberships=("join",))
    assert decide(f) is ERASED


def test_erased_sender_is_withheld_even_for_the_destinations_own_membership() -> None:
    f = EventFacts(sender_erased=True, own_membership=True)
    assert decide(f) is ERASED


def test_remote_sender_in_partial_state_room_is_withheld() -> None:
    f = EventFacts(remote_sender_in_partial_state_room=True, memberships=("join",))
    assert decide(f) is PARTIAL


@pytest.mark.parametrize("visibility", ["invited", "joined"])
def test_destinations_own_membership_goes_whatever_the_visibility(visibility: str) -> None:
    # its kick: in the state after the kick, its user has left
    f = EventFacts(history_visibility=visibility, memberships=("leave",), own_membership=True)
    assert decide(f) is SEND


@pytest.mark.parametrize(
    ("stored", "visibility"),
    [
        ('{"content": {"history_visibility": "joined"}}', "joined"),
        ('{"content": {"history_visibility": "world_readable"}}', "world_readable"),
        ('{"content": {}}', "shared"),  # Synapse's default
        ('{"content": {"history_visibility": 1}}', "joined"),  # Synapse asserts: fail closed
        ('{"content": []}', "joined"),
        ("not json", "joined"),
    ],
)
def test_stored_history_visibility_as_read_from_synapse(stored: str, visibility: str) -> None:
    assert synapse_visibility._visibility(stored) == visibility
