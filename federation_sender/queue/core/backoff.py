"""Backoff policy: a pure object deciding how long to leave a failing destination alone.

Synapse's schedule, every number configurable: the first failure backs off
``initial_s`` (10 minutes); each further failure multiplies the interval by
``multiplier`` (2) and a jitter factor drawn uniformly from [``jitter_min``,
``jitter_max``] (0.8 to 1.4); the interval is capped at ``max_s`` (7 days). Success resets.
Once the interval exceeds ``catchup_threshold_s`` (1 hour) the queue gives up its
in-memory items and relies on catch-up instead.

A 429 is first not a failure: :class:`RateLimit` pauses the queue, in memory only, and
the persisted schedule is not touched. The pause is 2 s, doubling while 429s continue (at
most 60 s); the peer's ``Retry-After`` may lengthen it, never shorten it, so a peer that
answers ``Retry-After: 0`` (or a negative or tiny ``retry_after_ms``) to every attempt
gets three attempts in ten seconds, not one a millisecond. The
:data:`RATE_LIMIT_MAX_IN_A_ROW`-th 429 in a row (after about three minutes of pauses) is
a failure with the persisted backoff, and so is every further one until a success.

Before the persisted schedule, a destination that fails to answer (refused or broken
connection, timeout, 5xx; not a 429, not a refusal) gets a *short-retry phase*, in
memory only (:class:`ShortRetryPolicy`, :class:`ShortRetry`): the same transaction is
retried every ``max_short_retry_delay_s`` (2 s) or sooner during ``probe_window_s``
(30 s), then on Synapse's long-retry schedule (4 s, 16 s, then ``max_long_retry_delay_s``,
each times 0.8 to 1.4) for ``max_long_retries`` (10) more attempts; only the failure
after those is persisted with ``initial_s``. A wake-up (REMOTE_SERVER_UP, main's
invalidation of the retry timings) cuts the current wait short and keeps the count, so
a destination that stays down still reaches the persisted backoff. A destination
already in a persisted backoff gets no new phase.

The policy never reads the clock or a global random source: ``now_ms`` and an
``random.Random`` are passed in, so tests pin every value.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from federation_sender.config import QueueSettings

_DEFAULT = QueueSettings()
"""The defaults are the settings' (``config/__init__.py``), written once there."""


@dataclass(frozen=True, slots=True)
class BackoffState:
    """Mirrors the ``destinations`` columns (all milliseconds)."""

    retry_last_ts_ms: int = 0
    retry_interval_ms: int = 0
    failure_ts_ms: int | None = None

    @property
    def backing_off(self) -> bool:
        return self.retry_interval_ms > 0

    @property
    def retry_at_ms(self) -> int | None:
        """When the next attempt may happen; None when not backing off."""
        if self.retry_interval_ms <= 0:
            return None
        return self.retry_last_ts_ms + self.retry_interval_ms

    def active_at(self, now_ms: int) -> bool:
        at = self.retry_at_ms
        return at is not None and now_ms < at


RESET = BackoffState()


@dataclass(frozen=True, slots=True)
class ShortRetryPolicy:
    """The short-retry phase's schedule (see the module docstring). Synapse's sender
    retries a transaction inside its request: ``4 ** n`` s capped at
    ``max_long_retry_delay`` (``n`` = 1, 2, ...), jitter 0.8 to 1.4, ``max_long_retries``
    times (``synapse/http/matrixfederationclient.py``). Ours first probes for
    ``probe_window_s`` with Synapse's short-retry delays (0.5 s doubling,
    ``max_short_retries`` times, then ``max_short_retry_delay_s``), never longer than
    ``max_short_retry_delay_s``, then follows Synapse's long retries."""

    max_long_retries: int = _DEFAULT.max_long_retries
    max_long_retry_delay_s: float = _DEFAULT.max_long_retry_delay_s
    max_short_retries: int = _DEFAULT.max_short_retries
    max_short_retry_delay_s: float = _DEFAULT.max_short_retry_delay_s
    probe_window_s: float = _DEFAULT.short_retry_probe_window_s

    @property
    def enabled(self) -> bool:
        return self.max_long_retries > 0 or self.probe_window_s > 0

    def probe_delay_ms(self, probes: int, rng: random.Random) -> int:
        """The wait before probe ``probes + 1`` of the window: at most the cap."""
        if probes < self.max_short_retries:
            base = 0.5 * 2.0 ** probes
        else:
            base = self.max_short_retry_delay_s
        delay = min(base * rng.uniform(0.8, 1.4), self.max_short_retry_delay_s)
        return max(1, int(delay * 1000))

    def long_delay_ms(self, n: int, rng: random.Random) -> int:
        """The wait before long retry ``n`` (1-based), as Synapse computes it."""
        base = min(4.0 ** min(n, 32), self.max_long_retry_delay_s)
        return max(1, int(base * rng.uniform(0.8, 1.4) * 1000))


NO_SHORT_RETRY = ShortRetryPolicy(max_long_retries=0, probe_window_s=0.0)
"""The first failure goes straight to the persisted backoff (as before the phase)."""


class ShortRetry:
    """The short-retry phase of one queue (in memory; a new queue starts without)."""

    __slots__ = ("attempts", "long_retries", "policy", "probes", "started_ms", "until_ms")

    def __init__(self, policy: ShortRetryPolicy) -> None:
        self.policy = policy
        self.started_ms: int | None = None
        """When the phase began (its first failure); None outside the phase."""
        self.probes = 0
        self.long_retries = 0
        self.attempts = 0
        """Retries made in this phase (attempts after its first failure; the core
        counts them)."""
        self.until_ms = 0

    @property
    def in_phase(self) -> bool:
        return self.started_ms is not None

    def active_at(self, now_ms: int) -> bool:
        if self.until_ms and self.until_ms <= now_ms:
            self.until_ms = 0
        return self.until_ms > now_ms

    def on_failure(self, now_ms: int, rng: random.Random) -> int | None:
        """A retryable failure at ``now_ms``: the wait before the next retry (the phase
        starts with the first), or None when the phase is over (the caller persists the
        backoff; the phase is reset)."""
        p = self.policy
        if self.started_ms is None:
            if not p.enabled:
                return None
            self.started_ms = now_ms
        if now_ms - self.started_ms < p.probe_window_s * 1000:
            delay = p.probe_delay_ms(self.probes, rng)
            self.probes += 1
        elif self.long_retries < p.max_long_retries:
            self.long_retries += 1
            delay = p.long_delay_ms(self.long_retries, rng)
        else:
            self.reset()
            return None
        self.until_ms = now_ms + delay
        return delay

    def wake(self) -> bool:
        """The destination was seen up: retry now (the phase's count is kept)."""
        was = self.until_ms > 0
        self.until_ms = 0
        return was

    def reset(self) -> int:
        """End the phase (a success, or its last failure); returns its retries."""
        n = self.attempts
        self.started_ms = None
        self.probes = self.long_retries = self.attempts = 0
        self.until_ms = 0
        return n


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    initial_s: float = _DEFAULT.backoff_initial_s
    multiplier: float = _DEFAULT.backoff_multiplier
    jitter_min: float = _DEFAULT.backoff_jitter_min
    jitter_max: float = _DEFAULT.backoff_jitter_max
    max_s: float = _DEFAULT.backoff_max_s
    catchup_threshold_s: float = _DEFAULT.catchup_threshold_s
    short_retry: ShortRetryPolicy = ShortRetryPolicy()
    return_probe_s: float = _DEFAULT.return_probe_interval_s
    """In a persisted backoff, with something to send and down for less than
    ``catchup_threshold_s``: ask the destination whether it is back this often, and
    send at once when it is (0: wait the backoff out, as Synapse)."""

    @classmethod
    def from_settings(cls, q: QueueSettings) -> BackoffPolicy:
        return cls(
            initial_s=q.backoff_initial_s,
            multiplier=q.backoff_multiplier,
            jitter_min=q.backoff_jitter_min,
            jitter_max=q.backoff_jitter_max,
            max_s=q.backoff_max_s,
            catchup_threshold_s=q.catchup_threshold_s,
            short_retry=ShortRetryPolicy(
                max_long_retries=q.max_long_retries,
                max_long_retry_delay_s=q.max_long_retry_delay_s,
                max_short_retries=q.max_short_retries,
                max_short_retry_delay_s=q.max_short_retry_delay_s,
                probe_window_s=q.short_retry_probe_window_s,
            ),
            return_probe_s=q.return_probe_interval_s,
        )

    def return_probe_at_ms(self, state: BackoffState, last_probe_ms: int,
                           now_ms: int) -> int | None:
        """When the next return probe of a destination in ``state`` is due (at most one
        per ``return_probe_s`` since the backoff began or the last probe), or None: no
        probing (off, not backing off, due anyway, or down for longer than
        ``catchup_threshold_s``)."""
        at = state.retry_at_ms
        if self.return_probe_s <= 0 or at is None or now_ms >= at:
            return None
        down_since = (state.failure_ts_ms if state.failure_ts_ms is not None
                      else state.retry_last_ts_ms)
        if now_ms - down_since >= self.catchup_threshold_s * 1000.0:
            return None
        due = max(state.retry_last_ts_ms, last_probe_ms) + int(self.return_probe_s * 1000)
        return due if due < at else None

    def on_failure(
        self,
        state: BackoffState,
        now_ms: int,
        rng: random.Random,
        min_interval_s: float | None = None,
    ) -> BackoffState:
        """The state after one more failed attempt at ``now_ms``.

        ``min_interval_s`` (a peer's ``Retry-After``) raises the interval, never lowers
        it."""
        if state.retry_interval_ms <= 0:
            interval = self.initial_s * 1000.0
        else:
            interval = (
                state.retry_interval_ms
                * self.multiplier
                * rng.uniform(self.jitter_min, self.jitter_max)
            )
        interval = min(interval, self.max_s * 1000.0)
        if min_interval_s is not None:
            interval = max(interval, min_interval_s * 1000.0)
        failure_ts = state.failure_ts_ms if state.failure_ts_ms is not None else now_ms
        return BackoffState(
            retry_last_ts_ms=now_ms, retry_interval_ms=int(interval), failure_ts_ms=failure_ts
        )

    def on_success(self, state: BackoffState) -> BackoffState:
        return RESET

    def should_catch_up(self, state: BackoffState) -> bool:
        """Past the threshold the in-memory queue is dropped for catch-up."""
        return state.retry_interval_ms > self.catchup_threshold_s * 1000.0


RATE_LIMIT_BASE_MS = 2_000
"""The first 429's pause, and the least any 429 pauses: a hint of 0 is not a licence to
retry at once."""
RATE_LIMIT_CAP_MS = 60_000
"""The longest unhinted pause (a hint up to ``RateLimit.longest_s`` is honoured)."""
RATE_LIMIT_MAX_IN_A_ROW = 8
"""The 8th 429 in a row, after pauses of 2, 4, 8, 16, 32, 60 and 60 s (182 s), and every
one after it until a success, counts as a failure (Synapse backs off on the first)."""


class RateLimit:
    """The pause after a 429 (Synapse answers one to a second concurrent transaction
    from one origin, and when it is overloaded)."""

    __slots__ = ("_in_a_row", "longest_s", "until_ms")

    def __init__(self, longest_s: float) -> None:
        self.longest_s = longest_s
        """A ``Retry-After`` longer than this is a failure (the persisted schedule)."""
        self.until_ms = 0
        self._in_a_row = 0

    @property
    def in_a_row(self) -> int:
        """429s since the last success."""
        return self._in_a_row

    def active_at(self, now_ms: int) -> bool:
        if self.until_ms and self.until_ms <= now_ms:
            self.until_ms = 0
        return self.until_ms > now_ms

    def pause_ms(self, retry_after_s: float | None) -> int | None:
        """The pause the next 429 would get; None if it is to count as a failure
        instead (too many in a row, or a hint longer than ``longest_s``)."""
        if self._in_a_row + 1 >= RATE_LIMIT_MAX_IN_A_ROW:
            return None
        wait_ms = min(RATE_LIMIT_CAP_MS, RATE_LIMIT_BASE_MS << self._in_a_row)
        if retry_after_s is not None and retry_after_s > 0:  # NaN and negatives: no hint
            if retry_after_s > self.longest_s:
                return None
            wait_ms = max(wait_ms, int(retry_after_s * 1000))
        return wait_ms

    def on_429(self, retry_after_s: float | None, now_ms: int) -> bool:
        """Pause (True), or False: the caller treats this 429 as a failure."""
        wait_ms = self.pause_ms(retry_after_s)
        self._in_a_row += 1
        if wait_ms is None:
            return False
        self.until_ms = now_ms + wait_ms
        return True

    def on_success(self) -> None:
        self._in_a_row = 0

    def clear(self) -> bool:
        was = self.until_ms > 0
        self.until_ms = 0
        return was
