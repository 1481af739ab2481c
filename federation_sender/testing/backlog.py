"""A backlog in one room, as a real Synapse receiver sees it (issue 33, item 2).

A receiving Synapse (``receiver``, on SQLite, sending for itself) has a user in a room
of a sending deployment. While the sender's federation sender is stopped (or killed
mid-burst), ``count`` messages are sent into the room; the sender is then started
again and catches up. :func:`receiver_state` reads, from the receiver's database, how
many of those events it holds as ordinary (non-outlier) events, how many are still in
its inbound staging table, and whether its log has a ``Pruning`` line
(``prune_staged_events_in_room``: what it pruned is absent until backfilled).

The API is blocking (tests and ``bench/`` scripts share it).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from federation_sender.clock import SystemClock
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_deployment import SynapseDeployment

_CLOCK = SystemClock()
PRUNING = "from federation queue"
"""The end of Synapse's ``Pruning %d events in room %s from federation queue``."""


@dataclass(frozen=True)
class ReceiverState:
    live: int
    """Of the events asked about: held as non-outlier events."""
    outliers: int
    staged: int
    """Rows of the room still in ``federation_inbound_events_staging``."""
    pruned: bool
    """The receiver's log has a ``Pruning`` line for the room."""


def receiver_state(receiver: SynapseDeployment, room_id: str,
                   event_ids: Sequence[str]) -> ReceiverState:
    path = receiver.layout.directory / "homeserver.db"
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        marks = ",".join("?" * len(event_ids))
        rows = conn.execute(
            f"SELECT outlier, count(*) FROM events WHERE event_id IN ({marks}) "
            "GROUP BY outlier", tuple(event_ids)).fetchall()
        staged = conn.execute(
            "SELECT count(*) FROM federation_inbound_events_staging WHERE room_id = ?",
            (room_id,)).fetchone()[0]
    finally:
        conn.close()
    by_flag = {bool(flag): n for flag, n in rows}
    log = receiver.main.log_path.read_text(errors="replace")
    pruned = any(PRUNING in ln and room_id in ln for ln in log.splitlines())
    return ReceiverState(by_flag.get(False, 0), by_flag.get(True, 0), int(staged), pruned)


def send_burst(sender: SynapseDeployment, user: User, room_id: str, count: int,
               after: int | None = None, then: Callable[[], None] | None = None) -> list[str]:
    """Send ``count`` messages; after the ``after``-th, call ``then`` in another thread
    (e.g. kill the federation sender mid-burst) and go on sending."""
    ids: list[str] = []
    side: threading.Thread | None = None
    for i in range(count):
        ids.append(sender.client.send_message(user, room_id, f"backlog {i}"))
        if after is not None and then is not None and i + 1 == after:
            side = threading.Thread(target=then, name="mid-burst", daemon=True)
            side.start()
    if side is not None:
        side.join()
    return ids


def wait_live(receiver: SynapseDeployment, room_id: str, event_ids: Sequence[str],
              timeout_s: float) -> tuple[float | None, ReceiverState]:
    """Seconds until every one of ``event_ids`` is live at the receiver and its
    staging queue of the room is empty (None: not within ``timeout_s``)."""
    started = _CLOCK.monotonic_s()
    while True:
        state = receiver_state(receiver, room_id, event_ids)
        if state.live == len(event_ids) and state.staged == 0:
            return round(_CLOCK.monotonic_s() - started, 2), state
        if _CLOCK.monotonic_s() - started > timeout_s:
            return None, state
        time.sleep(0.2)
