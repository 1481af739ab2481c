"""The queue engine: fan-out, per-destination queues, the transaction loop, backoff,
catch-up and wake-ups.

Theory of operation
-------------------
In short here; its one full home is docs/queue-engine.md ("Theory of operation"), and
the pure core's own docstring (``queue/core/__init__.py``) says what each module of it
decides. The :class:`~federation_sender.queue.fanout.EventFanout` reads new events from the
database past its persisted position when poked (or polled), works out the destinations
of each of our events, records them durably in ``destination_rooms`` together with the
new position, then hands the PDUs to per-destination queues.

Each destination has a queue only while it has something to do. A queue is a pure,
sans-I/O :class:`~federation_sender.queue.core.destination.DestinationCore` (state
machine, pending items, frozen in-flight transaction, backoff state, catch-up mode,
item isolation) driven by a thin asyncio
:class:`~federation_sender.queue.runner.DestinationRunner`. Everything pure lives in
the folder ``queue/core/`` (its ``__init__`` says what is there); an import-linter
contract keeps asyncio, aiohttp, SQLAlchemy, storage, the clock and telemetry out of it,
indirect imports included. The rest of ``queue/`` is the asyncio shell around it.
Exactly one transaction is in flight per destination, and a global semaphore bounds
them all. Transactions are built by :mod:`~federation_sender.queue.core.batching` (limits,
byte budget, EDU order) and retried with the same txn id until a 200. Failures back off
per :class:`~federation_sender.queue.core.backoff.BackoffPolicy`; past one hour the queue
drops its volatile items and catches up from ``destination_rooms``
(:mod:`~federation_sender.queue.core.catchup`), which is also how every queue starts.

All database access goes through the storage boundary
(:mod:`federation_sender.storage.protocols`): ``queue/persistence.py`` and the fan-out speak
its Protocols, and the pure core (``queue/core/``) imports no storage module, only the
neutral rows of :mod:`federation_sender.model`. The same engine therefore runs
on either backend (the native schema, or Synapse's own tables beside Synapse).

Failure modes: a crash at any point loses nothing that was persisted as an event -
positions only advance past what was recorded or delivered, and catch-up replays the
rest (duplicates are possible and harmless: receivers deduplicate by event id). A
destination that hangs costs one attempt deadline. A poison item is isolated by
splitting and dropped after ``max_item_failures`` refusals, only if other transactions
got through meanwhile (:mod:`~federation_sender.queue.core.isolation`).

Public API (called by the composition root)
-------------------------------------------
This package's ``__init__`` imports nothing, so ``import federation_sender.queue.core``
loads only the pure core.

``federation_sender.queue.manager.QueueManager(storage, sender, settings.queue,
server_name, instance_name, clock, rng, shard_filter, observer=None, *,
attempt_deadline_s=120.0, poll_interval_s=None, db_concurrency=16, leases=None)``

* ``await start(supervisor=None)`` (its fan-out, wake-up sweep and idle eviction run
  under the worker's supervisor) / ``await stop(deadline_s)``
* ``notify_new_events(max_stream_ordering)``: poke from the events stream (with
  ``poll_interval_s`` set, the fan-out also polls the database)
* ``enqueue_edu(destination, edu_type, content, key=None)``,
  ``enqueue_presence(destination, states)``,
  ``enqueue_receipt(destination, room_id, receipt_type, user_id, data)``,
  ``notify_outbox(destination)``
* ``await process_federation_batch(token, edus)`` with
  :class:`~federation_sender.queue.federation_stream.FederationEdu`;
  ``set_federation_ack(async callback(token))``; ``federation_position`` (resume point)
* ``await remote_server_up(destination)``, ``await reset_connection(destination) -> bool``
* ``status(destination) -> DestinationStatus | None``, ``statuses()``, ``snapshot() ->
  QueueSnapshot`` (the metrics' whole-queue gauges at scrape time: the statuses'
  sums and the counters), ``oldest_in_flight_age_s() -> float | None``, ``active_queues``,
  ``events_position``
* ``await wake_due_destinations() -> int``: one wake-up sweep (the loop runs it every
  ``wakeup_interval_s``)

Metrics go through :class:`~federation_sender.queue.observer.QueueObserver`; the worker's
is :class:`~federation_sender.queue.telemetry_observer.TelemetryObserver` (metrics, spans
and logs).
"""
