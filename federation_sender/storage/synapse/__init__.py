"""The Synapse dialect of the storage boundary: the Protocols over a Synapse
database (Synapse's tables, ours in the ``federation_sender`` schema) of a release in
:data:`~.schema.SYNAPSE_RELEASE_WINDOW`, the one list of the releases tested (a new
release: that list, and :data:`~.schema.TESTED_SCHEMA_VERSIONS` if its schema moved).
A module here has the name of its native counterpart in ``storage/`` where there is
one; the table groups and the theory of operation are :mod:`federation_sender.storage`'s.
"""
