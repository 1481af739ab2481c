"""What a destination's runner needs from the settings (one object shared by every
runner of a manager)."""

from __future__ import annotations

from dataclasses import dataclass

from federation_sender.config import QueueSettings
from federation_sender.queue.core.pacing import PacingPolicy

NO_PACING = PacingPolicy(deadline_s=0)


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    server_name: str
    instance_name: str
    attempt_deadline_s: float
    idle_ttl_s: float
    catchup_rooms_per_batch: int
    catchup_max_gap_events: int
    outbox_read_limit: int
    pacing: PacingPolicy = NO_PACING
    send_time_filter: bool = True
    """Erasures and redactions checked just before each transaction (``send_time.py``)."""

    @classmethod
    def from_settings(
        cls, q: QueueSettings, server_name: str, instance_name: str, attempt_deadline_s: float
    ) -> RunnerConfig:
        return cls(
            server_name=server_name,
            instance_name=instance_name,
            attempt_deadline_s=attempt_deadline_s,
            idle_ttl_s=q.idle_queue_ttl_s,
            catchup_rooms_per_batch=q.catchup_rooms_per_batch,
            catchup_max_gap_events=q.catchup_max_gap_events,
            outbox_read_limit=q.max_edus_per_txn,
            pacing=PacingPolicy(deadline_s=q.pacing_confirm_deadline_s),
            send_time_filter=q.send_time_filter,
        )
