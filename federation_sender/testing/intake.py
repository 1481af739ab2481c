"""The replication intake as the worker builds it without Synapse, for tests that feed
it rows directly: the EDU fan-outs on the rooms the storage Protocols read, at the
default receipt pacing, without presence
(:func:`federation_sender.app.assembly.build_edu_fanouts`)."""

from __future__ import annotations

from collections.abc import Collection

from federation_sender.app.assembly import build_edu_fanouts
from federation_sender.clock import Clock
from federation_sender.intake import ReplicationIntake
from federation_sender.queue.manager import QueueManager
from federation_sender.replication.positions import PositionStore
from federation_sender.storage.protocols import Backend


def native_intake(
    manager: QueueManager,
    storage: Backend,
    server_name: str,
    clock: Clock,
    *,
    event_writers: Collection[str] | None = None,
    device_list_writers: Collection[str] | None = None,
    stored_positions: PositionStore | None = None,
) -> ReplicationIntake:
    fanouts = build_edu_fanouts(server_name, storage, manager, clock, None)
    return ReplicationIntake(
        manager, storage, fanouts, clock,
        event_writers=event_writers, device_list_writers=device_list_writers,
        stored_positions=stored_positions,
    )  # fmt: skip
