"""Homeserver simulator and fake remote homeservers, for the demo, benchmarks and tests.

Theory of operation
-------------------
The simulator plays the main process around the worker::

    Driver ──steps──▶ World (pure model) ──Batch──▶ SimStore ──rows──▶ database
                                                        └──ids/rows──▶ Publisher (RDATA)
                              Oracle ◀──persisted batch─┘
    worker ──signed PUT /send──▶ RemoteFleet (FakeRemote per server) ──records──▶ check

* :mod:`.world` is a seeded, deterministic model of rooms, memberships, the DAG tip and
  EDU outboxes; each operation returns a :class:`.model.Batch`.
* :mod:`.store` writes a batch through the real schema in one transaction and then
  completes its stream ids through a :class:`.publish.Publisher` (the real replication
  writer, or a recorder when the worker polls).
* :mod:`.expected` is the oracle: from the model alone, what each destination must
  receive. :mod:`.check` compares it with what :mod:`.remotes` recorded.
* :mod:`.remotes` are loopback aiohttp servers that verify X-Matrix and answer like
  Synapse, with fault profiles from :mod:`federation_sender.testing.faults`.
* :mod:`.driver` runs a :class:`.driver.Scenario`: setup, then paced traffic with
  membership churn, exposing :class:`.driver.Progress`.

Invariant that makes the check meaningful: the oracle learns of a batch only after the
database committed it, and computes destinations from the model, never from SQL.
"""
