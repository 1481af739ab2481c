"""The worker as the process: logging set up before anything logs, then one
:class:`~federation_sender.app.worker.Worker` run until SIGTERM/SIGINT or a failure."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

from federation_sender.app.worker import Worker
from federation_sender.builders import admin_token_path, create_admin_token, read_admin_token
from federation_sender.config import Settings
from federation_sender.storage.instance_lock import InstanceLockLost
from federation_sender.synapse.config import SynapseConfig
from federation_sender.synapse.egress import egress_secrets
from federation_sender.telemetry.logging import setup_logging

log = logging.getLogger(__name__)


async def run_worker(
    settings: Settings, *, auto_migrate: bool = True, synapse: SynapseConfig | None = None
) -> int:
    """Run until SIGTERM/SIGINT (exit 0) or a supervised task fails (exit 1)."""
    # Many long-lived small objects (queues, shared PDUs): with the default thresholds the
    # cyclic collector runs constantly, +34 % CPU per transaction at 1,000 destinations
    # (docs/benchmarks.md, "Garbage collector thresholds").
    gc.set_threshold(100_000, 50, 100)
    # Logging is set up once, before anything can log; the admin token is resolved
    # first (it may be generated) so that it is redacted from the very first line.
    admin_token = read_admin_token(settings)
    generated = admin_token is None
    if admin_token is None:
        admin_token = create_admin_token(settings)
    setup_logging(settings.telemetry, secrets=[admin_token, *egress_secrets(settings, synapse)])
    if generated:
        log.info("generated an admin token in %s", admin_token_path(settings))
    worker = await Worker.create(settings, auto_migrate=auto_migrate, synapse=synapse)
    return await _serve(worker)


async def _serve(worker: Worker) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await worker.start()
    assert worker.supervisor is not None
    failed = await worker.supervisor.wait(stop)
    deadline_s: float | None = None
    if failed is None:
        log.info("shutdown requested; finishing in-flight transactions")
    elif isinstance(failed.cause, InstanceLockLost):
        # Another copy may be sending now: nothing more goes out, in flight or not.
        log.error("stopping at once: %s", failed.cause)
        deadline_s = 0.0
    else:
        log.error("stopping: %s", failed)
    await worker.stop(deadline_s)
    return 0 if failed is None else 1
