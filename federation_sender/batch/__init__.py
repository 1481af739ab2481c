"""Spark batch jobs over the worker's database: backfill, audit, health report.

Theory of operation
-------------------
The worker keeps ``destination_rooms`` and ``destinations.last_successful_stream_ordering``
up to date incrementally, one event at a time. These jobs recompute the same facts from
the whole history, in bulk, on Spark (local mode by default, any cluster or Spark
Connect with the same code):

* ``backfill-destination-rooms`` rebuilds ``destination_rooms`` (adopting the worker on
  an existing database, or repairing it);
* ``audit`` compares what each destination should have received with the transaction
  log and ``destination_rooms``, and with ``--repair`` rewinds catch-up so the worker
  resends what was lost;
* ``health-report`` summarises the transaction log per destination.

Layout: :mod:`.transforms` holds every computation as a pure DataFrame function (tested
on hand-built frames); :mod:`.io` does JDBC/Parquet reads and the staged, single-
transaction apply; :mod:`.session` builds the SparkSession; one module per job
(:mod:`.backfill`, :mod:`.audit`, :mod:`.health`) sequences reads, transforms and writes;
:mod:`.cli` parses arguments. No SQL here: the driver's reads, the staging table and the
apply statements are :mod:`federation_sender.storage.batch_reads` and
:mod:`~federation_sender.storage.batch_apply`, and the same computations as plain SQL
inside PostgreSQL (for the benchmark and as a cross-check) are benchmark code,
``bench/batch_baseline.py``.

On a Synapse deployment (``--synapse-config``) the same jobs read Synapse's tables and
our transaction log beside them: :mod:`.synapse_source` (its reads named by
:mod:`federation_sender.storage.synapse.batch_reads`), the pure
:mod:`.synapse_transforms` (the audit's decision table), :mod:`.synapse_audit` and
:mod:`.synapse_health`; repairs go through
:mod:`federation_sender.storage.synapse.batch_apply` with Synapse's sender's rules
(docs/batch.md, "On a Synapse deployment").

Invariants: a job reads a consistent prefix of the events stream (up to a high-water
mark fixed at its start); it never overwrites a row the worker wrote for a newer event;
its writes commit in one transaction or not at all; running it twice gives the same
database.

Failure modes: a run that dies before the apply transaction leaves an UNLOGGED
``batch_staging_*`` table at worst (dropped on a normal failure; drop by hand after a
kill -9). A repair only lowers positions, so the cost of a wrong repair is resending
events the destination already has (receivers deduplicate by event id), never losing
one.
"""
