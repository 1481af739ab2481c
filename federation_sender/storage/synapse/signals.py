"""What a Synapse process says on replication about the streams it writes.

Our writes to Synapse's ``destinations`` are cache invalidations for main. Within a
transaction the backend records them (and the destinations that came back) in a
:class:`PendingSignals`; only after the commit does it hand them to its
:class:`ReplicationSignals` (a rolled-back or retried transaction emits nothing), which
publishes ``RDATA caches <instance> <id> ["get_destination_retry_timings", [dest], ts]``
and ``REMOTE_SERVER_UP <dest>``. After connecting and in answer to every ``REPLICATE``
it sends ``POSITION caches <instance> <id> <id>``, so a reader that missed rows while we
were disconnected fetches them from ``cache_invalidation_stream_by_instance`` (Synapse's
readers do).

The backend owns its :class:`ReplicationSignals` and offers it through its capabilities
(:mod:`federation_sender.storage.capabilities`); the composition root attaches it to the
replication client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from federation_sender.replication import commands as c


@dataclass
class PendingSignals:
    """Signals for other processes, sent only once the transaction that implies them
    has committed: cache invalidation rows (stream id, function, keys, ts) and
    destinations that came back (REMOTE_SERVER_UP)."""

    invalidations: list[tuple[int, str, list[str], int]] = field(default_factory=list)
    servers_up: list[str] = field(default_factory=list)


class ReplicationSignals:
    """Publishes committed signals on a replication client (see the module doc)."""

    def __init__(self, instance_name: str) -> None:
        self._instance = instance_name
        self._send: Callable[[c.Command], bool] | None = None
        self.dropped = 0
        self.caches_position = 0
        """The highest cache invalidation stream id we wrote (POSITION caches)."""

    def attach(self, send: Callable[[c.Command], bool]) -> None:
        self._send = send

    def emit(self, signals: PendingSignals) -> None:
        for stream_id, *_ in signals.invalidations:
            self.caches_position = max(self.caches_position, stream_id)
        commands: list[c.Command] = [
            c.RdataCommand("caches", self._instance, stream_id, [func, keys, ts])
            for stream_id, func, keys, ts in signals.invalidations
        ]
        commands.extend(c.RemoteServerUpCommand(d) for d in signals.servers_up)
        for command in commands:
            if self._send is None or not self._send(command):
                # Disconnected: the POSITION sent on reconnecting makes readers fetch
                # the invalidations from the database.
                self.dropped += 1

    def announce(self) -> Sequence[c.Command]:
        pos = self.caches_position
        return [c.PositionCommand("caches", self._instance, pos, pos)]
