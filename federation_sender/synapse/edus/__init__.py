"""EDUs read from Synapse's tables, built exactly as Synapse's federation sender builds
them (the Synapse backend's side of :mod:`federation_sender.edus` and of the outboxes).

* :mod:`.device_lists`: ``m.device_list_update`` and ``m.signing_key_update`` (with its
  ``org.matrix.`` twin) from ``device_lists_outbound_pokes``, ``devices``,
  ``e2e_device_keys_json`` and the cross-signing tables; after a 200 the pokes are
  deleted and ``device_lists_outbound_last_success`` upserted.
* :mod:`.to_device`: ``m.direct_to_device`` from ``device_federation_outbox``, deleted
  after a 200.
* :mod:`.rooms`: current hosts (``current_state_events``) and event metadata for typing
  and receipts.

Every function takes a connection and runs the statements Synapse runs (same filters,
same order, same limits); the module docstrings name the Synapse function each one
mirrors. Nothing here writes a table Synapse's own sender does not write.
"""
