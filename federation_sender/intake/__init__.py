"""The intake: replication rows become queue engine calls.

The worker's data flow reads replication → intake → queue → transport. The replication
client (:mod:`federation_sender.replication`) parses and orders the rows of each stream;
:class:`ReplicationIntake` is its handler and the only way rows reach the queue engine:

* ``events``: the intake's read limit moves (several writers: only below what every
  writer has finished, :mod:`federation_sender.replication.frontier`) and the queue's
  event fan-out (:mod:`federation_sender.queue.fanout`) is poked to read the new events
  from the database;
* ``federation``: EDUs main queued for remote servers (presence to given destinations
  formatted as Synapse formats it, :func:`federation_sender.edus.presence.presence_json`)
  go to the federation stream of the queue engine;
* ``to_device`` and ``device_lists``: the destinations' outboxes are poked;
* ``receipts``, ``typing``, ``presence``, ``presence_federation``: the EDU fan-outs of
  :mod:`federation_sender.edus`, which turn them into EDUs for the rooms' hosts;
* ``caches``: another process invalidated a destination's retry timings: a wake-up.

Each of these is a stream's entry in the stream table (:mod:`.streams`, ``STREAMS``):
its row parser, its hook (what is said above), what a gap in it skips. The streams the
replication client consumes, the parsers it is given and the gap notes it logs are
derived from the table, so each stream is named once. The EDU fan-outs are built by the
composition root and given to :class:`ReplicationIntake`
(:class:`federation_sender.edus.fanouts.EduFanouts`).

:class:`DbPositionStore` keeps the replication client's positions through the storage
backend.
"""

from federation_sender.intake.handler import ReplicationIntake
from federation_sender.intake.positions import DbPositionStore

__all__ = ["DbPositionStore", "ReplicationIntake"]
