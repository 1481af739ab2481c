from __future__ import annotations

import itertools
import random

import pytest

from federation_sender.config import QueueSettings
from federation_sender.queue.backoff import RESET, BackoffPolicy, BackoffState

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
