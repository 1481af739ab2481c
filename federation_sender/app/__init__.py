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

Failure policy: the replication client reconnects forever by itself; the queue
manager supervises its own loops; anything that still escapes is caught by the
:class:`Supervisor`, logged with the task name, and stops the process with a non-zero
exit status rather than leaving a zombie.
"""
