"""The composition root: builds every component from :class:`Settings` and runs them.

:class:`~.worker.Worker` owns the parts; :mod:`.assembly` holds the steps of building
them (the one place that chooses the backend); :func:`~.process.run_worker` runs one
worker as the process (signals, exit status).

Nothing else in the package constructs subsystems or reads settings globally; this
package only wires. Start order: logging → database (schema check) → signing key →
federation client → sharding → queue manager → replication client → admin, metrics
and key listeners. Stop order is the reverse, with in-flight transactions given
``shutdown_deadline_s`` to finish and positions persisted by the components as they
advance.

Failure policy: every background task runs under the worker's one
:class:`~federation_sender.supervisor.Supervisor`, given to the parts that have some
(the shard heartbeat, the queue manager's fan-out and housekeeping ticks). Periodic
work skips a failed tick (a database outage is one line) and the queue's fan-out
restarts after a failure, forever; the replication client reconnects forever by
itself; anything that still escapes is logged with the task name and stops the process
with a non-zero exit status rather than leaving a zombie. Each part stops its own tasks
at its place in the stop order; the supervisor's shutdown, last, cancels what is left.
"""
