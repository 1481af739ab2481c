"""The Synapse backend: this worker as the federation sender of a Synapse deployment.

A second implementation behind the storage boundary (the native backend is our own
schema beside our simulated main process). Here the database is Synapse's own: events
come from ``events`` joined with ``event_json``, destinations are computed as Synapse
computes them (partial-state servers, Synapse's Redis external cache, else the joined
hosts of the prev events' state groups), positions live in Synapse's
``federation_stream_position`` so a handover to or from Synapse's own
``federation_sender`` worker loses nothing, and retry timings are written with the
cache invalidations main needs to keep its cached copy true.

This package holds what is not SQL: configuration from Synapse's own files
(:mod:`.config`), the admin-token check, the egress listeners and the wiring. The SQL is
the storage package's third dialect, :mod:`federation_sender.storage.synapse`: we write
only what Synapse's sender writes (its ``schema``); our own tables live in the
``federation_sender`` PostgreSQL schema (its ``database``). Differences from Synapse's
worker, and the limitations, are in ``docs/synapse-reference.md``.
"""
