"""Replication: Synapse's line protocol, reader and writer side, over TCP or Redis.

Layers, from pure to I/O (each module's docstring is its theory of operation):

* ``commands`` -- every command as a frozen dataclass; pure parse/serialise.
* ``rows`` -- typed rows of the consumed streams, parsed from RDATA JSON.
* ``connection`` -- sans-I/O connection: framing, direction, server name,
  keepalive on the injected clock, congestion.
* ``positions`` -- reader positions per (stream, writer): batches, duplicates,
  gaps fetched from the database, resets, history ids.
* ``server`` -- writer side: stream ids (reserve/complete), RDATA/POSITION,
  backlog, history ids, answers to REPLICATE (with the PSYNC extension).
* ``transport``, ``tcp``, ``redis`` -- the asyncio shells.
* ``client`` -- the worker's reader client: reconnect loop, dispatch,
  persistence of finished positions.

Invariants: any input either parses or raises ``ProtocolError``; a bad input
costs one reconnect on TCP and one skipped message on the Redis bus, never the
process and never a persisted position; a
writer reset never makes new rows look stale. The wire protocol, extension
included, is documented in ``docs/replication-protocol.md``.
"""
