"""Generic asyncio helpers, no Matrix and no queue in them: a FIFO slot limit
(:mod:`.slots`) and waits bounded by an injected clock (:mod:`.timing`). The queue
engine, the batch jobs and the transport use them; they import nothing of ours but
:mod:`federation_sender.clock`."""
