"""How :class:`~federation_sender.queue.core.destination.DestinationCore` takes a transaction's
result: success, a refusal (judged by the isolation), a 429, a failure (the short-retry
phase, then the persisted backoff, then catch-up), a drop; and how the position moves.
A part of the core (a base class of it), sans-I/O like the rest, kept in its own module
for its size.
"""

from __future__ import annotations

import random

from federation_sender.queue.core.backoff import (
    RESET,
    BackoffPolicy,
    BackoffState,
    RateLimit,
    ShortRetry,
)
from federation_sender.queue.core.batching import Batch
from federation_sender.queue.core.episode import CatchupEpisode
from federation_sender.queue.core.isolation import ItemIsolation, Verdict
from federation_sender.queue.core.items import EduItem, PduItem, PendingItems
from federation_sender.queue.core.steps import Effects, FrozenTxn, outbox_keys
from federation_sender.transport.result import Outcome, SendResult


class ResultRules:
    """The result rules of the core; the core's state they use is declared (and
    slotted) here, the core sets it."""

    __slots__ = (
        "backoff", "current", "episode", "isolation", "last_error", "last_success_ms",
        "last_successful", "max_done", "pending", "policy", "rate_limit", "rng",
        "short_retry", "work",
    )
    backoff: BackoffState
    current: FrozenTxn | None
    episode: CatchupEpisode
    isolation: ItemIsolation
    last_error: str | None
    last_success_ms: int | None
    last_successful: int
    max_done: int
    pending: PendingItems
    policy: BackoffPolicy
    rate_limit: RateLimit
    rng: random.Random
    short_retry: ShortRetry
    work: list[Batch]

    def _enter_catchup(self, eff: Effects) -> None:
        raise NotImplementedError

    def _min_held_stream_ordering(self) -> int | None:
        m = self.pending.min_stream_ordering()
        if not self.work and not self.isolation:
            return m
        sos = [
            p.stream_ordering
            for b in (*self.work, *self.isolation.batches())
            for p in b.pdus
        ]
        if m is not None:
            sos.append(m)
        return min(sos, default=None)

    def on_result(self, txn: FrozenTxn, result: SendResult, now_ms: int) -> Effects:
        if self.current is not txn:
            raise RuntimeError("result for a transaction that is not in flight")
        eff = Effects()
        batch = txn.batch
        phase = self.short_retry
        if phase.in_phase and batch:
            phase.attempts += 1
            eff.short_retry_attempt = True
            if not _unanswered(result):
                # Any answer but a 5xx: the destination is up again.
                eff.short_retry_long = phase.long_retries
                eff.short_retry_ended = phase.reset()
        if result.outcome is Outcome.SUCCESS:
            if batch:
                self.last_success_ms = now_ms
            self._on_success(batch, result, eff)
            return eff
        self.last_error = result.error or result.outcome.value
        if result.outcome is Outcome.TOO_LARGE:
            self.current = None
            if batch.item_count >= 2:
                self.work[:0] = batch.split()
            else:
                self._drop(batch, "too_large", eff)
            return eff
        if result.status == 429:
            first = self.rate_limit.in_a_row == 0
            if self.rate_limit.on_429(result.retry_after_s, now_ms):
                # Overloaded, not failed: resend the same transaction after a pause.
                if first:
                    eff.rate_limited_ms = self.rate_limit.until_ms - now_ms
                self.current = FrozenTxn(txn.txn_id, batch, txn.attempts + 1)
                return eff
        if self.isolation.is_refusal(result.status, batch):
            verdict = self.isolation.on_refusal(batch, result.status, now_ms)
            if verdict is not Verdict.DESTINATION:
                self.current = None
                if batch.item_count >= 2:  # SPLIT, or PROBE after many refusals
                    self.work[:0] = batch.split()
                if verdict is Verdict.PROBE:
                    self.work.insert(0, Batch((), (), probe=True))
                elif verdict is Verdict.DROP:
                    self._drop(batch, "refused", eff)
                return eff
        self._fail(txn, result, now_ms, eff)
        return eff

    def _on_success(self, batch: Batch, result: SendResult, eff: Effects) -> None:
        self.current = None
        if batch:
            # Only an answer clears it: an empty catch-up step advancing locally says
            # nothing about the destination.
            self.last_error = None
        if self.rate_limit.in_a_row:
            eff.rate_limit_ended = self.rate_limit.in_a_row
            self.rate_limit.on_success()
        self.isolation.on_success(batch)
        eff.succeeded = bool(batch)
        if self.backoff != RESET:
            self.backoff = RESET
            eff.backoff = RESET
        outbox_keys(batch.edus, eff)
        eff.prune.extend(batch.catchup_prune)
        if batch.catchup:
            self.episode.answered(result.duration_s)
        if not self.episode.active:
            # Catch-up moves the position only when the episode ends: until then
            # rooms not yet handled may hold missed events below any row handled.
            self._advance(batch, eff)

    def _fail(self, txn: FrozenTxn, result: SendResult, now_ms: int, eff: Effects) -> None:
        """The destination is down (or refuses everything): retry soon (the short-retry
        phase) or back off, keeping the frozen transaction for an identical retry."""
        self.isolation.on_destination_failure()
        self.current = FrozenTxn(txn.txn_id, txn.batch, txn.attempts + 1)
        phase = self.short_retry
        if _unanswered(result) and not self.backoff.backing_off:
            first = not phase.in_phase
            retries, long_retries = phase.attempts, phase.long_retries
            delay = phase.on_failure(now_ms, self.rng)
            if delay is not None:
                eff.short_retry_ms = delay
                eff.short_retry_started = first
                return
            if not first:
                eff.short_retry_gave_up = retries
                eff.short_retry_long = long_retries
        elif phase.in_phase:
            eff.short_retry_long = phase.long_retries
            eff.short_retry_gave_up = phase.reset()
        self.backoff = self.policy.on_failure(
            self.backoff, now_ms, self.rng, result.retry_after_s
        )
        eff.backoff = self.backoff
        if self.policy.should_catch_up(self.backoff):
            self._enter_catchup(eff)

    def _drop(self, batch: Batch, reason: str, eff: Effects) -> None:
        items: list[PduItem | EduItem] = [*batch.pdus, *batch.edus]
        eff.dropped.extend((item, reason) for item in items)
        self.isolation.forget(batch)
        # A dropped outbox row is marked sent so it cannot poison the queue again.
        outbox_keys(batch.edus, eff)
        eff.prune.extend(batch.catchup_prune)
        if not self.episode.active:
            self._advance(batch, eff)

    def _advance(self, batch: Batch, eff: Effects) -> None:
        """Move the position up to the highest PDU done (sent or dropped), but below any
        PDU still held in memory."""
        top = batch.max_stream_ordering
        if top is not None:
            self.max_done = max(self.max_done, top)
        target = self.max_done
        held = self._min_held_stream_ordering()
        if held is not None:
            target = min(target, held - 1)
        if target > self.last_successful:
            self.last_successful = target
            eff.last_successful = target


def _unanswered(result: SendResult) -> bool:
    """A failure the short-retry phase retries: no answer (refused or broken connection,
    timeout) or a 5xx, as Synapse's sender retries inside the request; not a 429 (the
    rate limit's) nor a refusal."""
    if result.outcome is not Outcome.TRANSIENT:
        return False
    return result.status is None or result.status >= 500
