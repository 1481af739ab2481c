"""Storage: the boundary every SQL read and write of the worker goes through.

Theory of operation
===================

Nothing outside this package builds SQL, writes SQL text or reads the schema
(``tests/storage/test_boundary.py`` fails otherwise; the stand-ins for Synapse's main
process in ``testing/`` and ``sim/`` are the exception by design). The queue engine, the
intake, the EDU fan-outs and the admin API speak only the Protocols of :mod:`.protocols`,
over the neutral rows of :mod:`federation_sender.model`. A :class:`~.protocols.Backend`
owns connections and transactions: :meth:`~.protocols.Backend.run` calls a function with
a :class:`~.protocols.Tx`, one transaction's view of the storage with one object per
aggregate (``tx.events``, ``tx.hosts``, ``tx.destinations``, ``tx.catchup``,
``tx.visibility``, ``tx.outbox``, ``tx.positions``, ``tx.txlog``, ``tx.admin``). What
a backend offers beyond a transaction (the replication gap fetchers, the signals it
publishes, the EDU fan-outs' rooms and presence, outbox reads bounded by stream tokens)
is its :class:`~.capabilities.Capabilities`. The composition root (``app/assembly.py``)
chooses the backend once and asks it for those; nothing downstream asks which backend
it has.

Two backends
------------

* **native** (:mod:`.backend`): the project's own schema (:mod:`.schema`, alembic's
  single source) on SQLite or PostgreSQL. The two SQL dialects are branches inside one
  module where they differ (PostgreSQL: one statement over ``unnest`` of arrays;
  SQLite: executemany), never two modules.
* **Synapse** (:mod:`.synapse.backend`, ``--synapse-config``): a Synapse
  PostgreSQL database, read and written as Synapse's own federation sender does; the
  tables Synapse lacks live in our schema ``federation_sender``, first on every
  connection's ``search_path`` (:mod:`.synapse.database`).

Each rule is written once, the dialects below it, as in Dendrite's
``federationapi/storage``: where the tables are the same, the native module holds the
statement and its Synapse namesake only what Synapse adds (Synapse's ``destinations``
and ``destination_rooms`` have our columns, so :class:`~.destinations.DestinationsTable`
serves both and :class:`~.synapse.destinations.SynapseDestinations` adds the cache
invalidations; the event reads of :mod:`.events` serve both over each schema's
``EventSource``). Where the backends' rules differ (which servers receive an event; what
acknowledging an outbox row does; where positions live) the difference is behind a
Protocol method, never in the callers.

Table groups
------------

One module per table group; a Synapse module has the name of its native counterpart.

===================  ===================================  ===============================
table group          native, ``storage/``                 Synapse, ``storage/synapse/``
===================  ===================================  ===============================
the backend, ``Tx``  ``backend.py``                       ``backend.py``
events               ``events.py`` (the reads of both)    ``events.py`` (sending rules)
room hosts           ``hosts.py``                         ``hosts.py`` (state groups)
membership history   ``membership_history.py``            ``membership_history.py``
destinations         ``destinations.py``, ``catchup.py``  ``destinations.py``
to-device outbox     ``to_device.py``                     ``to_device.py``
device-list outbox   ``device_lists.py``                  ``device_lists.py``
positions            ``positions.py``                     ``positions.py``
transaction log      ``txlog.py`` (both backends)
admin reads          ``admin_queries.py`` (both)
sharding             ``leases.py`` (both)
batch jobs           ``batch_apply.py``,                  ``batch_apply.py``,
                     ``batch_reads.py``                   ``batch_reads.py``
replication gaps     ``stream_fetchers.py``               ``stream_fetchers.py``
schema               ``schema.py`` (alembic's)            ``schema.py`` (Synapse's)
===================  ===================================  ===============================

Synapse only: ``visibility.py`` (what catch-up may send: erasures, history visibility),
``send_time.py`` (erasures and redactions just before sending), ``edu_rooms.py`` (the
``edu_rooms`` capability), ``signals.py`` (cache invalidations and ``REMOTE_SERVER_UP``
for main), ``access_tokens.py`` (the admin-token check), ``database.py``. For either
backend: :mod:`.protocols`, :mod:`.capabilities`, :mod:`.engine`, :mod:`.migrate`,
:mod:`.instance_lock`, :mod:`.pgarray` and :mod:`.shared_tables_ddl`. Catch-up's
reads are ``tx.catchup`` (:mod:`.catchup`: the ``destination_rooms`` keyset read and
the schema's membership history); what catch-up does with them is
:mod:`federation_sender.queue.core.catchup`.

Transactions and the group commit
---------------------------------

:meth:`~.protocols.Backend.run` is :func:`.engine.run_in_transaction`: one transaction,
committed when the function returns, retried whole (bounded, jittered) on a transient
error (connection lost, serialization failure, deadlock, SQLite's "database is locked");
any other error surfaces at once. So the function must have no effect outside the
transaction, and whatever it does through one ``Tx`` commits or rolls back together:
that is how the fan-out writes ``destination_rooms`` and its position atomically on any
backend (invariant 1 of docs/architecture.md). State that outlives a transaction belongs
to the backend: the native room-membership cache (:class:`.hosts.RoomHostsCache`), the
Synapse state-group hosts cache; the cache invalidations a Synapse transaction records
are published only after it commits. The queue's results (backoffs, positions, outbox
acknowledgements, prunes, log rows) are group-committed by
:mod:`federation_sender.queue.persistence`: everything submitted while one commit runs
goes into the next ``run``, whose multi-row statements
(:meth:`~.protocols.DestinationStore.set_last_successful_many`, ``clear_retry_many``,
the log's ``COPY`` on PostgreSQL) cost one round trip whatever the number of
destinations.

The contract
------------

``tests/storage/test_backend_contract.py`` states what any backend must do, through the
Protocols only (the rules listed in :mod:`.protocols`), and runs against every dialect:
native SQLite, native PostgreSQL and Synapse on a schema Synapse itself created
(``subject`` in ``tests/storage/conftest.py``; a new backend joins by a case of
``open_subject`` in ``tests/storage/contract_support.py``).
``test_backend_contract_main_rows.py`` adds what needs the main process's rows on the
native backends; Synapse's own rows are checked in ``tests/storage/synapse/`` and
``tests/synapse/``. The PostgreSQL cases start their own server. The batch jobs write
through the same aggregate (``tx.destinations.apply_batch``, ``apply_staged_batch``:
the statements of :mod:`.batch_apply`, whose rule is not the worker's: rows only at or
below the job's high-water mark, positions only lowered), and the contract runs those on
every dialect too. ``tests/storage/test_boundary.py`` pins the import rules: the pure
core imports no storage module, the queue engine, admin API, EDU fan-outs and intake
import only :mod:`.protocols`, and no module asks which backend it has.

Migrations
----------

Two alembic chains, driven from our async engines by :mod:`.migrate` (``upgrade`` is
idempotent; ``check_schema`` refuses one never migrated, behind or ahead): the native
schema's in ``storage/migrations/`` (``r0001``...), and beside Synapse our own tables in
schema ``federation_sender`` in ``storage/synapse/migrations/`` (``s0001``..., run by
:mod:`.synapse.database`, which checks Synapse's own schema version first and never
creates or alters a table of Synapse's). They stay two chains: the native one also
creates the tables Synapse owns on its side (``events``, ``destinations``...), which must
never be created in a Synapse database, and deployments of either kind carry their
chain's revision ids. The tables both chains make are declared once,
:mod:`.shared_tables_ddl`, frozen with the first revisions (a later change is a new
revision in each chain). ``tests/storage/test_migrations.py`` checks that ``r0001``
still makes the schema it made when released (``tests/storage/r0001_native_sqlite.sql``)
and upgrades to head; ``tests/storage/synapse/test_backend_schema.py`` that the shared
tables are the same in both chains.
"""
