"""The reconnect delay shared by every replication connection we open (the TCP and
Redis reader, the Redis writer bridge): the one copy."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential reconnect delay, capped, with jitter in [50 %, 100 %]."""

    initial_s: float = 0.5
    max_s: float = 30.0
    multiplier: float = 2.0

    def delay_s(self, attempt: int, rng: random.Random) -> float:
        """The pause before reconnect ``attempt`` (0 after a session that delivered)."""
        base = min(self.max_s, self.initial_s * self.multiplier ** min(attempt, 64))
        return base * rng.uniform(0.5, 1.0)


DEFAULT_BACKOFF = Backoff()
