from __future__ import annotations

import itertools
import random

import pytest

from federation_sender.config import QueueSettings
from federation_sender.queue.core.backoff import (
    NO_SHORT_RETRY,
    RESET,
    BackoffPolicy,
    BackoffState,
    ShortRetry,
    ShortRetryPolicy,
)

P = BackoffPolicy.from_settings(QueueSettings())


def test_first_failure_is_ten_minutes_exactly() -> None:
    s = P.on_failure(RESET, 1_000, random.Random(1))
    assert s == BackoffState(retry_last_ts_ms=1_000, retry_interval_ms=600_000, failure_ts_ms=1_000)
    assert s.retry_at_ms == 601_000
    assert s.active_at(600_999) and not s.active_at(601_000)


def test_schedule_doubles_with_jitter_and_is_capped() -> None:
    rng = random.Random(7)
    s = RESET
    intervals = []
    for i in range(40):
        s = P.on_failure(s, i, rng)
        intervals.append(s.retry_interval_ms)
    assert intervals[0] == 600_000
    for prev, cur in itertools.pairwise(intervals):
        if cur == 7 * 24 * 3600 * 1000:
            continue
        assert prev * 2 * 0.8 - 1 <= cur <= prev * 2 * 1.4 + 1
    assert intervals[-1] == 7 * 24 * 3600 * 1000
    # failure_ts stays at the first failure
    assert s.failure_ts_ms == 0


def test_jitter_uses_the_injected_rng() -> None:
    a = P.on_failure(P.on_failure(RESET, 0, random.Random(3)), 1, random.Random(3))
    b = P.on_failure(P.on_failure(RESET, 0, random.Random(3)), 1, random.Random(3))
    assert a == b
    lo = BackoffPolicy(jitter_min=0.8, jitter_max=0.8).on_failure(
        BackoffState(0, 600_000, 0), 0, random.Random())
    assert lo.retry_interval_ms == 960_000


def test_reset_and_catchup_threshold() -> None:
    s = BackoffState(0, 3_600_000, 0)
    assert not P.should_catch_up(s)
    assert P.should_catch_up(BackoffState(0, 3_600_001, 0))
    assert P.on_success(s) == RESET
    assert not RESET.backing_off and RESET.retry_at_ms is None


def test_retry_after_raises_but_never_lowers() -> None:
    s = P.on_failure(RESET, 0, random.Random(), min_interval_s=7200)
    assert s.retry_interval_ms == 7_200_000
    s2 = P.on_failure(RESET, 0, random.Random(), min_interval_s=1)
    assert s2.retry_interval_ms == 600_000


@pytest.mark.parametrize("initial,mult,cap", [(1.0, 3.0, 10.0), (600.0, 2.0, 3600.0)])
def test_configurable(initial: float, mult: float, cap: float) -> None:
    p = BackoffPolicy(initial_s=initial, multiplier=mult, jitter_min=1.0, jitter_max=1.0,
                      max_s=cap)
    s = p.on_failure(RESET, 0, random.Random())
    assert s.retry_interval_ms == initial * 1000
    s = p.on_failure(s, 0, random.Random())
    assert s.retry_interval_ms == min(initial * mult, cap) * 1000


# --- the short-retry phase --------------------------------------------------------------

SR = ShortRetryPolicy()


def test_short_retry_probes_every_2_s_or_sooner_for_30_s_then_synapses_long_retries() -> None:
    phase = ShortRetry(SR)
    now, waits = 0, []
    while True:
        wait = phase.on_failure(now, random.Random(now))
        if wait is None:
            break
        waits.append((now, wait))
        now += wait + 100  # each attempt takes 100 ms to fail
    window = [w for t, w in waits if t < 30_000]
    longs = [w for t, w in waits if t >= 30_000]
    assert max(window) <= 2_000 and window[0] <= 700  # 0.5 s, 1 s, 2 s, then 2 s
    assert len(window) >= 15
    assert len(longs) == 10  # Synapse's max_long_retries
    for n, w in enumerate(longs, 1):
        base = min(4**n, 60) * 1000
        assert base * 0.8 - 1 <= w <= base * 1.4 + 1
    assert not phase.in_phase and phase.until_ms == 0  # over: the caller persists


def test_short_retry_waking_cuts_the_wait_and_keeps_the_count() -> None:
    phase = ShortRetry(ShortRetryPolicy(max_long_retries=2, probe_window_s=0))
    assert phase.on_failure(0, random.Random(1)) is not None
    assert phase.active_at(1) and phase.wake() and not phase.active_at(1)
    assert phase.on_failure(2, random.Random(1)) is not None
    assert phase.on_failure(3, random.Random(1)) is None  # two long retries were the lot


@pytest.mark.parametrize("policy", [NO_SHORT_RETRY,
                                    ShortRetryPolicy(max_long_retries=0, probe_window_s=0)])
def test_short_retry_off(policy: ShortRetryPolicy) -> None:
    assert not policy.enabled
    assert ShortRetry(policy).on_failure(0, random.Random()) is None


def test_short_retry_follows_the_configured_delays() -> None:
    p = ShortRetryPolicy(max_short_retries=0, max_short_retry_delay_s=0.2,
                         max_long_retry_delay_s=5)
    assert all(p.probe_delay_ms(i, random.Random(i)) <= 200 for i in range(50))
    assert all(4_000 <= p.long_delay_ms(9, random.Random(i)) <= 7_000 for i in range(50))
    assert P.short_retry == ShortRetryPolicy()  # QueueSettings' defaults are Synapse's


def test_the_policy_defaults_are_the_settings_defaults() -> None:
    """One home for each default (config/__init__.py's QueueSettings): a policy built
    with no argument is the one the default settings give."""
    assert BackoffPolicy() == BackoffPolicy.from_settings(QueueSettings())
    changed = QueueSettings(backoff_initial_s=5.0, max_short_retries=1,
                            short_retry_probe_window_s=2.0, return_probe_interval_s=0.0)
    assert BackoffPolicy.from_settings(changed) != BackoffPolicy()
