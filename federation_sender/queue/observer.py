"""What the queue engine reports, as a Protocol; telemetry implements it.

The queue calls these synchronously on the event loop; implementations must be cheap
and must not raise. :class:`NoopObserver` (every hook's default, which does nothing) is the default.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

from federation_sender.queue.core.effects import Effects
from federation_sender.queue.core.isolation import describe
from federation_sender.queue.core.items import PduItem
from federation_sender.queue.core.states import DestinationState
from federation_sender.transport.result import Outcome, SendResult

log = logging.getLogger("federation_sender.queue.runner")  # the name these lines always had


class QueueObserver(Protocol):
    """The hooks, each doing nothing by default: an observer implements the ones it
    needs (structurally, or by subclassing this Protocol to inherit the others)."""

    def attempt(self, destination: str, txn_id: str, pdu_count: int, edu_count: int,
                catchup: bool) -> AbstractContextManager[None]:
        """Wraps one attempt, from sending to handing its result to the database
        (``transaction_sent`` is called inside), entered once the attempt holds one of
        the global transaction slots (not while it waits for one). Telemetry opens the
        transaction span here: what runs inside (discovery, the HTTP request) becomes
        its children."""
        return nullcontext()

    def persisting(self, destination: str, committed: asyncio.Future[None]) -> None:
        """Inside :meth:`attempt`: the result went to the group commit and
        ``committed`` resolves when it is in the database (or fails)."""
        return None

    def catchup_step(self, destination: str) -> AbstractContextManager[None]:
        """Wraps one catch-up step: reading its plan (``catchup_progress`` is called
        inside when there is one)."""
        return nullcontext()

    def transaction_sent(
        self,
        destination: str,
        txn_id: str,
        outcome: Outcome,
        http_status: int | None,
        pdu_count: int,
        edu_count: int,
        edu_types: Mapping[str, int],
        request_bytes: int,
        duration_s: float,
        catchup: bool,
    ) -> None:
        """After every attempt (including failures and deadline expiries)."""
        return None

    def item_dropped(self, destination: str, item_type: str, reason: str) -> None:
        """An item was given up: ``item_type`` is ``pdu`` or an EDU type; ``reason`` is
        ``too_large``, ``refused`` or ``catchup`` (volatile items dropped on entering
        catch-up, reported once per queue with the count in ``item_type``)."""
        return None

    def state_changed(
        self, destination: str, old: DestinationState, new: DestinationState
    ) -> None:
        return None

    def backoff_changed(self, destination: str, retry_interval_s: float) -> None:
        """0 means reset."""
        return None

    def catchup_entered(self, destination: str, dropped_items: int) -> None:
        return None

    def short_retry(self, destination: str, answered: bool) -> None:
        """A retry of the short-retry phase got an answer (ending the phase) or not."""
        return None

    def short_retry_phase_ended(self, destination: str, answered: bool) -> None:
        """The phase ended: the destination answered, or the backoff is persisted."""
        return None

    def return_probe(self, destination: str, up: bool) -> None:
        """A destination in its persisted backoff was asked whether it is back."""
        return None

    def catchup_progress(self, destination: str, rooms: int, pdus: int) -> None:
        return None

    def send_time_filtered(self, destination: str, withheld: Mapping[str, int],
                           pruned: int) -> None:
        """Just before a transaction went out (``queue/send_time.py``): PDUs withheld,
        by reason (``erased_sender``, ``unknown_room_version``), and PDUs sent pruned
        because they were redacted since they were queued."""
        return None

    def pacing_confirmed(self, destination: str, outcome: str, waited_s: float) -> None:
        """A pacing wait (``queue/core/pacing.py``): ``confirmed`` (the receiver holds the
        event), ``not_yet`` or ``no_answer`` (the deadline passed), ``unsupported``
        (the receiver does not serve the request); the last three send on unpaced."""
        return None

    def events_processed(self, count: int, position: int, fanned_out: int, *,
                         pdus: int = 0, rooms: int = 0, duration_s: float = 0.0) -> None:
        """The fan-out finished a batch: events read, new position, (PDU, destination)
        pairs enqueued, PDUs enqueued for at least one destination, rooms of the
        batch's sendable events, and how long the batch took (read to hand-over)."""
        return None

    def queues_changed(self, active: int) -> None:
        """The number of live destination queues changed."""
        return None


class NoopObserver(QueueObserver):
    """Observes nothing: every hook is the Protocol's default."""


def _retries(total: int, long: int) -> str:
    """``23 retries (13 short, 10 long)``: the probe window's retries, seconds apart,
    and the long schedule's, up to a minute apart, are told apart."""
    return f"{total} {'retry' if total == 1 else 'retries'} ({total - long} short, {long} long)"


def report(
    observer: QueueObserver, d: str, eff: Effects, result: SendResult, was_failing: bool
) -> None:
    """Log and report what a result implied (backoff, drops, catch-up, PDU errors)."""
    if eff.backoff is not None:
        interval_s = eff.backoff.retry_interval_ms / 1000.0
        observer.backoff_changed(d, interval_s)
        if interval_s and not was_failing:
            # Once per change of state: a destination down for a week would
            # otherwise repeat this line on every retry.
            log.warning("destination %s is failing (%s); backing off %gs, further "
                        "failures are logged at DEBUG until it answers",
                        d, result.error or result.outcome.value, interval_s)
        elif interval_s:
            log.debug("destination %s failed again (%s); backing off %gs",
                      d, result.error or result.outcome.value, interval_s)
        elif was_failing:
            log.info("destination %s answers again; backoff cleared", d)
    if eff.short_retry_started and eff.short_retry_ms is not None:
        # Once per phase (its end has a line too): one line per retry would repeat
        # every 2 s.
        log.info("destination %s does not answer (%s); retrying in %gs and every few "
                 "seconds before backing off", d, result.error or result.outcome.value,
                 eff.short_retry_ms / 1000.0)
    if eff.short_retry_attempt:
        observer.short_retry(d, eff.short_retry_ended is not None)
    if eff.short_retry_ended is not None:
        log.info("destination %s answers again after %s", d,
                 _retries(eff.short_retry_ended, eff.short_retry_long))
        observer.short_retry_phase_ended(d, True)
    if eff.short_retry_gave_up is not None:
        log.info("destination %s did not answer %s; backing off", d,
                 _retries(eff.short_retry_gave_up, eff.short_retry_long))
        observer.short_retry_phase_ended(d, False)
    if eff.rate_limited_ms is not None:
        # Once per run of 429s (the next line is at its end): a peer answering 429 to
        # every attempt would otherwise log one line per attempt.
        log.info("destination %s is rate limiting us (%s%s); pausing %gs, longer at "
                 "each further 429, until it accepts a transaction",
                 d, result.error or "HTTP 429",
                 "" if result.retry_after_s is None else f", retry after {result.retry_after_s:g}s",
                 eff.rate_limited_ms / 1000.0)
    if eff.rate_limit_ended:
        log.info("destination %s accepts transactions again after %d 429s in a row",
                 d, eff.rate_limit_ended)
    for item, reason in eff.dropped:
        kind = "pdu" if isinstance(item, PduItem) else item.edu_type
        log.warning("dropping %s for %s: %s (last error: %s)",
                    describe(item), d, reason, result.error or result.status)
        observer.item_dropped(d, kind, reason)
    if eff.entered_catchup:
        log.info("destination %s enters catch-up, %d items dropped from memory",
                 d, eff.dropped_for_catchup)
        observer.catchup_entered(d, eff.dropped_for_catchup)
    if result.pdu_errors:
        log.info("destination %s rejected %d PDUs in a 200: %s", d, len(result.pdu_errors),
                 dict(list(result.pdu_errors.items())[:5]))
