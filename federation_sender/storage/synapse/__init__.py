"""The Synapse dialect of the storage boundary: the Protocols over a Synapse 1.163
database (Synapse's tables, ours in the ``federation_sender`` schema)."""
