"""A backlog in one room, as a real Synapse receiver sees it (issue 33, item 2).

A receiving Synapse (``receiver``, on SQLite, sending for itself) has a user in a room
of a sending deployment. While the sender's federation sender is stopped (or killed
mid-burst), ``count`` messages are sent into the room; the sender is then started
again and catches up. :func:`receiver_state` reads, from the receiver's database, how
many of those events it holds as live events (neither outliers nor backfilled), how
many as outliers or backfilled, how many are still in
its inbound staging table, and whether its log has a ``Pruning`` line
(``prune_staged_events_in_room``: what it pruned is absent until backfilled).

The API is blocking (tests and ``bench/`` scripts share it).
"""

from __future__ import annotations

import sqlite3
import threading
import time
import urllib.parse
import uuid
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
    """Of the events asked about: held as ordinary events that arrived live, i.e.
    neither outliers nor backfilled (Synapse gives a backfilled event a negative stream
    ordering; a live one is in /sync's timeline)."""
    outliers: int
    staged: int
    """Rows of the room still in ``federation_inbound_events_staging``."""
    pruned: bool
    """The receiver's log has a ``Pruning`` line for the room."""
    backfilled: int = 0
    """Of the events asked about: held, but backfilled (negative stream ordering)."""


def receiver_state(receiver: SynapseDeployment, room_id: str,
                   event_ids: Sequence[str]) -> ReceiverState:
    path = receiver.layout.directory / "homeserver.db"
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        marks = ",".join("?" * len(event_ids))
        rows = conn.execute(
            f"SELECT outlier, stream_ordering < 0, count(*) FROM events "
            f"WHERE event_id IN ({marks}) GROUP BY 1, 2", tuple(event_ids)).fetchall()
        staged = conn.execute(
            "SELECT count(*) FROM federation_inbound_events_staging WHERE room_id = ?",
            (room_id,)).fetchone()[0]
    finally:
        conn.close()
    live = sum(n for outlier, backfilled, n in rows if not outlier and not backfilled)
    backfilled = sum(n for outlier, back, n in rows if not outlier and back)
    outliers = sum(n for outlier, _, n in rows if outlier)
    log = receiver.main.log_path.read_text(errors="replace")
    pruned = any(PRUNING in ln and room_id in ln for ln in log.splitlines())
    return ReceiverState(live, outliers, int(staged), pruned, backfilled)


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
              timeout_s: float, stall_s: float | None = None
              ) -> tuple[float | None, ReceiverState]:
    """Seconds until every one of ``event_ids`` is live at the receiver and its
    staging queue of the room is empty (None: not within ``timeout_s``, or, with
    ``stall_s``, nothing changed at the receiver for that long with nothing staged)."""
    started = _CLOCK.monotonic_s()
    last: ReceiverState | None = None
    changed = started
    while True:
        state = receiver_state(receiver, room_id, event_ids)
        now = _CLOCK.monotonic_s()
        if state.live == len(event_ids) and state.staged == 0:
            return round(now - started, 2), state
        if state != last or state.staged:
            last, changed = state, now
        if now - started > timeout_s or (stall_s is not None and now - changed > stall_s):
            return None, state
        time.sleep(0.2)


def timeline_ids(receiver: SynapseDeployment, user: User, room_id: str,
                 limit: int) -> list[str]:
    """The ids of the room's newest ``limit`` events as ``user`` reads them through the
    receiver's client API (``/messages``, newest first), oldest first."""
    ids: list[str] = []
    token: str | None = None
    room = urllib.parse.quote(room_id, safe="")
    while len(ids) < limit:
        query = {"dir": "b", "limit": str(min(500, limit - len(ids)))}
        if token is not None:
            query["from"] = token
        page = receiver.client.call(
            "GET", f"/_matrix/client/v3/rooms/{room}/messages?"
            + urllib.parse.urlencode(query), None, user.access_token)
        chunk = page.get("chunk", [])
        ids.extend(e["event_id"] for e in chunk)
        token = page.get("end")
        if not chunk or token is None:
            break
    return ids[::-1]


def _to_device_seen(receiver: SynapseDeployment, user: User, marker: str,
                    since: str | None) -> tuple[bool, str | None]:
    page = receiver.client.sync(user, since=since)
    got = any(e.get("content", {}).get("marker") == marker
              for e in page.get("to_device", {}).get("events", []))
    return got, page.get("next_batch")


@dataclass
class OtherTraffic:
    """A message in another room and a to-device message, sent while a backlog is
    under way (issue #44): seconds until each was at the receiver (None: not within the
    timeout)."""

    message_s: float | None
    to_device_s: float | None


def sync_token(receiver: SynapseDeployment, user: User) -> str | None:
    """``user``'s current /sync position (to-device messages after it are new)."""
    return _to_device_seen(receiver, user, "-", None)[1]


def other_traffic(sender: SynapseDeployment, user: User, room_id: str,
                  receiver: SynapseDeployment, recipient: User, since: str | None,
                  timeout_s: float = 60.0) -> OtherTraffic:
    """Send, as ``user``, a message into ``room_id`` (which ``recipient`` of the receiver
    is in) and a to-device message to ``recipient``'s devices; wait until the message is
    live at the receiver and the to-device message in ``recipient``'s /sync (``since``:
    :func:`sync_token` taken before)."""
    marker = uuid.uuid4().hex
    sent_at = _CLOCK.monotonic_s()
    message = sender.client.send_message(user, room_id, "not behind the backlog")
    sender.client.call(
        "PUT", f"/_matrix/client/v3/sendToDevice/m.test/{uuid.uuid4().hex}",
        {"messages": {recipient.user_id: {"*": {"marker": marker}}}}, user.access_token)
    message_s = to_device_s = None
    while (message_s is None or to_device_s is None) and (
            _CLOCK.monotonic_s() - sent_at < timeout_s):
        if message_s is None and receiver_state(receiver, room_id, [message]).live:
            message_s = round(_CLOCK.monotonic_s() - sent_at, 3)
        if to_device_s is None:
            seen, since = _to_device_seen(receiver, recipient, marker, since)
            if seen:
                to_device_s = round(_CLOCK.monotonic_s() - sent_at, 3)
        time.sleep(0.02)
    return OtherTraffic(message_s, to_device_s)
