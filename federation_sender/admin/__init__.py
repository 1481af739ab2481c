"""The admin listener: Synapse's federation destinations admin API, live queue state,
health/readiness and the operator dashboard.

Theory of operation: the app is a thin read layer. Persisted facts (retry timings,
rooms, the transaction log) come from the storage backend's ``AdminReads``; live
facts (queue state, in-flight transaction) come from a :class:`.protocols.QueueControl`
the composition root passes in. The only write, ``reset_connection``, is delegated to
that QueueControl, which owns backoff both in memory and in the database, so the admin
API can never disagree with the queue about whether a destination is backing off.

Failure modes: a database error answers 500 ``M_UNKNOWN`` (after the engine's bounded
retries of transient errors) and is logged; a bad or missing token answers 401 before
any handler runs; bad parameters answer 400 ``M_INVALID_PARAM``.
"""
