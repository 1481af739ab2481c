"""What catch-up withholds from a destination: Synapse's server visibility rule, pure.

Synapse's federation sender filters the events it sends in catch-up with
``filter_events_for_server(..., redact=False, filter_out_erased_senders=True,
filter_out_remote_partial_state_events=True)`` (``synapse/visibility.py``; the decision
itself is ``event_visible_to_server`` in its Rust crate). An event is withheld from a
destination when, in this order:

1. its sender has been **erased** (deactivated with ``erase: true``: a row in
   ``erased_users``), whenever the event was sent;
2. its sender is **remote** and the room is **partial-state** here (our list of the
   room's servers may be stale, so the event could reach a server that left);
3. the room's **history visibility** in the state after the event is ``joined`` and none
   of the destination's users is joined in that state, or it is ``invited`` and none is
   joined or invited. Any other value (``shared``, ``world_readable``, one Synapse does
   not know) and no ``m.room.history_visibility`` at all let it through; so does an
   event with no state (an outlier), as in Synapse.

One exception to 3, ours: an event that changes the membership of one of the
destination's own users (a kick, a ban, an invite) is never withheld for history
visibility. The spec shows users their own membership events whatever the history
visibility, and the destination must learn of its kick; Synapse sends such an event too,
as the room's newest event, without filtering it.

Nothing here reads a database: the storage gathers the :class:`EventFacts` and the
catch-up planner calls :func:`decide`. ``tests/test_visibility.py`` covers each rule.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass

__all__ = ["SHAREABLE", "EventFacts", "Verdict", "decide"]


class Verdict(enum.Enum):
    """Send, or the reason an event is withheld (for logs and metrics)."""

    SEND = "send"
    ERASED_SENDER = "erased_sender"
    REMOTE_PARTIAL_STATE = "remote_partial_state"
    HISTORY_VISIBILITY = "history_visibility"


@dataclass(frozen=True, slots=True)
class EventFacts:
    """What the decision needs about one event and one destination."""

    sender_erased: bool = False
    remote_sender_in_partial_state_room: bool = False
    history_visibility: str = "shared"
    """``content.history_visibility`` in the state after the event; ``shared`` when the
    state has none (or the event has no state)."""
    memberships: Collection[str] = ()
    """The memberships of the destination's users in the state after the event."""
    own_membership: bool = False
    """The event is an ``m.room.member`` event whose target is one of the destination's
    users."""


SHAREABLE = EventFacts()
"""An event nothing withholds (the native backend's events: no erasure, no state)."""


def decide(f: EventFacts) -> Verdict:
    if f.sender_erased:
        return Verdict.ERASED_SENDER
    if f.remote_sender_in_partial_state_room:
        return Verdict.REMOTE_PARTIAL_STATE
    if f.own_membership:
        return Verdict.SEND
    if f.history_visibility == "joined":
        allowed: tuple[str, ...] = ("join",)
    elif f.history_visibility == "invited":
        allowed = ("join", "invite")
    else:
        return Verdict.SEND
    if any(m in allowed for m in f.memberships):
        return Verdict.SEND
    return Verdict.HISTORY_VISIBILITY
