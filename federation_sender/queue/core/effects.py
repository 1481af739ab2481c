"""What a result implies that a destination's shell must persist and report
(:class:`Effects`), as :class:`~federation_sender.queue.core.destination.DestinationCore`
returns it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from federation_sender.queue.core.backoff import BackoffState
from federation_sender.queue.core.items import EduItem, EduKind, PduItem


@dataclass(slots=True)
class Effects:
    """What the shell must persist and report after a result."""

    backoff: BackoffState | None = None
    last_successful: int | None = None
    position_before: int = -1
    """The position ``last_successful`` replaces, as the queue knows it (loaded, or its
    previous write; -1 for none): the store writes it only over that value, so a position
    another process lowered meanwhile (``batch audit --repair``) is not raised past the
    events it owes (:meth:`DestinationCore.position_read` then adopts it)."""
    to_device_sent: list[int] = field(default_factory=list)
    device_lists_sent: list[tuple[int, str, str]] = field(default_factory=list)
    prune: list[tuple[str, int]] = field(default_factory=list)
    dropped: list[tuple[PduItem | EduItem, str]] = field(default_factory=list)
    entered_catchup: bool = False
    dropped_for_catchup: int = 0
    succeeded: bool = False
    """The destination accepted a transaction: the persisted backoff must be reset,
    whoever wrote it."""
    rate_limited_ms: int | None = None
    """The first 429 after a success (or since loading): paused this long."""
    rate_limit_ended: int = 0
    """A success after this many 429s in a row."""
    short_retry_ms: int | None = None
    """A failure inside the short-retry phase: the same transaction is retried after
    this many ms (nothing to persist)."""
    short_retry_started: bool = False
    """That failure began the phase."""
    short_retry_attempt: bool = False
    """The attempt was a retry of the phase."""
    short_retry_ended: int | None = None
    """The destination answered: the phase ended after this many retries."""
    short_retry_gave_up: int | None = None
    """The phase ended after this many retries without an answer: ``backoff`` holds
    the persisted backoff."""
    short_retry_long: int = 0
    """Of the retries of a phase that ended, those on the long schedule (4 s, 16 s,
    then up to ``max_long_retry_delay_s`` apart) rather than the probe window's."""


def outbox_keys(items: Iterable[PduItem | EduItem], eff: Effects) -> None:
    for e in items:
        if isinstance(e, EduItem) and e.outbox_key is not None:
            if e.kind is EduKind.TO_DEVICE:
                eff.to_device_sent.append(e.outbox_key[0])
            else:
                eff.device_lists_sent.append(e.outbox_key)
