"""Federation transport: signed ``PUT /send`` over aiohttp, discovery, address filtering.

The queue engine only sees :class:`federation_sender.transport.result.SendResult`
through the :class:`federation_sender.transport.result.TransactionSender` protocol.
"""
