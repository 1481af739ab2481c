"""The Synapse dialect of the storage boundary: the Protocols over a Synapse 1.163
database (Synapse's tables, ours in the ``federation_sender`` schema). A module here has
the name of its native counterpart in ``storage/`` where there is one; the table groups
and the theory of operation are :mod:`federation_sender.storage`'s."""
