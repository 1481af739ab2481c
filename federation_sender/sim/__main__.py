"""``python -m federation_sender.sim``: run the simulator as a stand-in main process.

It writes simulated rooms, memberships and events into the configured database (the
same configuration file and environment variables as the worker) and publishes them
over TCP replication or Redis, until interrupted or ``--steps`` are done. Used by
``docker-compose.yml`` as the ``main`` service.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from federation_sender.clock import SystemClock
from federation_sender.config.loading import load_settings
from federation_sender.errors import ConfigError
from federation_sender.sim.driver import Driver, Scenario
from federation_sender.sim.publish import WriterPublisher, serve_replication
from federation_sender.sim.store import DuplicateEventError
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import check_schema

log = logging.getLogger("federation_sender.sim")


async def _main(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    clock = SystemClock()
    engine = create_engine(settings.database.url)
    await check_schema(engine)
    publisher = await WriterPublisher.for_database(engine, settings.server_name)
    scenario = Scenario(
        server_name=settings.server_name,
        remote_servers=args.remote_servers,
        rooms=args.rooms,
        steps=args.steps,
        rate_per_s=args.rate,
        seed=args.seed,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serve_replication(
        publisher.writer,
        transport=args.publish,
        clock=clock,
        host=args.host,
        port=args.port,
        redis_url=settings.replication.redis_url,
    ):
        driver = Driver.build(scenario, engine=engine, publisher=publisher, clock=clock)
        await driver.setup()
        run = asyncio.create_task(driver.run())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({run, stopper}, return_when=asyncio.FIRST_COMPLETED)
        run.cancel()
        stopper.cancel()
        log.info("simulator finished: %s", driver.progress.describe())
        if run.done() and not run.cancelled():
            run.result()  # the run's error, if it failed
    await engine.dispose()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m federation_sender.sim")
    p.add_argument("-c", "--config", default=None)
    p.add_argument("--publish", choices=["tcp", "redis", "none"], default="tcp")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=9092)
    p.add_argument("--remote-servers", type=int, default=20)
    p.add_argument("--rooms", type=int, default=40)
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--rate", type=float, default=20.0, help="operations per second")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    try:
        return asyncio.run(_main(args))
    except ConfigError as e:
        print(f"simulator: configuration error: {e}", file=sys.stderr)
        return 2
    except DuplicateEventError as e:
        print(f"simulator: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
