"""Federation transport: signed ``PUT /send`` over aiohttp, discovery, address filtering.

The queue engine only sees :class:`federation_sender.transport.result.SendResult`
through the :class:`federation_sender.transport.result.TransactionSender` protocol,
implemented by :class:`federation_sender.transport.client.FederationClient`.

Theory of operation, in the order a send happens:

* :mod:`.signing` -- the server key (Synapse's key file format, refused if others can
  read it) signs each request with an X-Matrix ``Authorization`` header;
* :mod:`.discovery` (with :mod:`.dns` and :mod:`.http`) -- the destination name becomes
  connect targets, a Host header and a TLS name, per the specification, cached and
  looked up once per name at a time;
* :mod:`.addresses` -- every address is checked after DNS; private and reserved ranges
  are refused unless allow-listed (SSRF protection);
* :mod:`.client` -- one attempt under one hard deadline, bounded pools, bounded
  response size, no redirects;
* :mod:`.classify` -- the response or failure becomes SUCCESS / TRANSIENT / PERMANENT /
  TOO_LARGE; nothing the remote does raises.

:mod:`.keyserver` publishes our verify key at ``/_matrix/key/v2/server`` for
standalone deployments. See ``docs/federation-transport.md``.
"""
