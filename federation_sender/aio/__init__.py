"""Generic asyncio helpers, no Matrix and no queue in them: a FIFO slot limit
(:mod:`.slots`), waits bounded by an injected clock (:mod:`.timing`) and the signal
of components going idle that tests wait on (:mod:`.idle`). The queue
engine, the batch jobs and the transport use them; they import nothing of ours but
:mod:`federation_sender.clock`."""
