"""What the admin API needs from the rest of the worker, as protocols.

Besides its static token, the admin API may accept other credentials through a
:class:`TokenVerifier` (beside Synapse: a Synapse server admin's access token, checked
against Synapse's tables by :mod:`federation_sender.synapse.admin_auth`); the admin
package never reads those tables itself.

The admin app never reaches into the queue engine: it asks a :class:`QueueControl` for
a JSON-ready snapshot of one destination's (or every loaded destination's) live queue
state, and asks it to reset a destination's connection. The composition root passes
the queue manager (or anything with these methods); tests pass
:class:`federation_sender.testing.admin_fakes.FakeQueueControl`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol, TypedDict

QueueStateName = Literal["idle", "sending", "backing_off", "catching_up"]
"""The states the admin API and dashboard show. An implementation with finer states
maps them onto these four (for example "waiting for a slot" is ``sending``)."""

QUEUE_STATES: tuple[QueueStateName, ...] = ("idle", "sending", "backing_off", "catching_up")


class LiveState(TypedDict):
    """The JSON shape of one destination's live queue state (all keys required).

    ``in_flight_age_s`` is seconds since the in-flight transaction's first attempt;
    ``next_retry_ts`` is Unix milliseconds, like Synapse's ``retry_last_ts``;
    ``last_success_ts`` (Unix ms) is when the queue last delivered a transaction since it
    was loaded on this instance, else ``None``.
    """

    state: QueueStateName
    pending_pdus: int
    pending_edus: int
    in_flight_txn_id: str | None
    in_flight_age_s: float | None
    last_error: str | None
    next_retry_ts: int | None
    last_success_ts: int | None
    catching_up: bool


class QueueControl(Protocol):
    """The queue engine as seen from the admin API."""

    def live_state(self, destination: str) -> Mapping[str, Any] | None:
        """The :class:`LiveState` of a destination with a loaded queue, else ``None``."""

    def live_states(self) -> Mapping[str, Mapping[str, Any]]:
        """Every loaded destination's :class:`LiveState`, keyed by destination."""

    async def reset_connection(self, destination: str) -> bool:
        """Clear the destination's backoff (in memory *and* the persisted retry
        timings in ``destinations``) and wake its queue.

        Returns ``False``, changing nothing, when the destination is not backing off.
        Must work for a destination that has no loaded queue but persisted backoff.
        """


class TokenVerifier(Protocol):
    """Checks a bearer token that is not the static admin token."""

    async def verify(self, token: str) -> str:
        """Who ``token`` authenticates, as the audit line names them (never the token).

        Raises :class:`federation_sender.admin.errors.AdminError` with the answer to
        give when the token is refused (unknown, expired, not an administrator).
        """
