"""The ``federation-sender`` command line.

Commands: ``worker`` (run the sender), ``migrate`` (upgrade the schema), ``check-config``,
``generate-key``, ``demo`` (the embedded end-to-end demonstration) and ``batch`` (Spark
jobs). Configuration errors exit with status 2 and a one-line reason naming the key.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from federation_sender.config import Settings
from federation_sender.config.loading import load_settings
from federation_sender.errors import ConfigError, FederationSenderError, SchemaVersionError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

EXIT_CONFIG = 2
EXIT_SCHEMA = 3
EXIT_RUNTIME = 1


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-c",
        "--config",
        metavar="FILE",
        help="YAML configuration file (optional; embedded defaults use SQLite under ./data)",
    )


def _add_synapse_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--synapse-config",
        metavar="FILE",
        action="append",
        default=None,
        help="Synapse's homeserver.yaml (repeat for a worker file): run beside Synapse, "
        "on its database and Redis (docs/synapse.md)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="federation-sender",
        description="A standalone federation sender worker for Matrix homeservers.",
    )
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    _add_worker_parser(sub)

    p = sub.add_parser("migrate", help="upgrade the database schema (idempotent)")
    _add_config_arg(p)
    _add_synapse_arg(p)
    p.add_argument("--revision", default="head", help="target revision (default: head)")

    p = sub.add_parser("init", help="create the signing key and admin token if missing "
                       "(once, before starting workers that share them)")
    _add_config_arg(p)

    p = sub.add_parser("check-config", help="validate the configuration and print it")
    _add_config_arg(p)
    _add_synapse_arg(p)

    p = sub.add_parser("generate-key", help="write a new ed25519 signing key file")
    p.add_argument("path", help="where to write the key file (mode 0600)")
    p.add_argument("--key-id", default=None, help="key id, e.g. a_AbCd (random by default)")

    _add_demo_parser(sub)

    # Imports no pyspark: without the batch extra, 'batch' says how to install it.
    from federation_sender.batch.arguments import add_batch_parser

    add_batch_parser(sub)
    return parser


def _add_worker_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("worker", help="run the federation sender worker")
    _add_config_arg(p)
    _add_synapse_arg(p)
    p.add_argument(
        "--no-migrate",
        action="store_true",
        help="do not migrate automatically (an embedded SQLite database, or our own "
        "schema beside Synapse)",
    )
    p.add_argument(
        "--event-loop",
        choices=["auto", "uvloop", "asyncio"],
        default="asyncio",
        help="event loop: asyncio's own (default, the one the test suite runs on), "
        "uvloop (needs the uvloop extra; 3-6%% less CPU per transaction in the fan-out "
        "benchmark), or auto (uvloop when installed)",
    )


def _add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="run the end-to-end demo: simulator, fake remotes, worker")
    _add_config_arg(p)
    p.add_argument("--destinations", type=int, default=30)
    p.add_argument("--rooms", type=int, default=12)
    p.add_argument("--events", type=int, default=600)
    p.add_argument("--duration", type=float, default=45.0, help="seconds of event generation")
    p.add_argument(
        "--postgres",
        metavar="URL",
        default=None,
        help="use this PostgreSQL database instead of the embedded SQLite",
    )
    p.add_argument("--no-live", action="store_true", help="plain log lines instead of the table")
    p.add_argument("--keep-running", action="store_true",
                   help="after the delivery check, keep the worker, its dashboard and the "
                   "simulated remotes running until Ctrl-C (or SIGTERM)")
    p.add_argument("--port-base", type=_port_base, default=None, metavar="N",
                   help="fixed ports instead of random ones: admin API and dashboard N, "
                   "metrics N+1, replication N+2, the simulated remotes from N+10")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("federation-sender")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "unknown (not installed)"


def _port_base(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1024 <= value <= 65535 - 1000:
        raise argparse.ArgumentTypeError("a port from 1024 to 64535")
    return value


def _load(args: argparse.Namespace) -> Settings:
    path = getattr(args, "config", None)
    settings = load_settings(path)
    synapse_files = getattr(args, "synapse_config", None)
    if synapse_files:
        import os

        from federation_sender.synapse.config import load_synapse_config
        from federation_sender.synapse.merge import (
            SHARED_FEDERATION_KEYS,
            keys_set_in,
            merge_settings,
        )

        settings = merge_settings(
            settings,
            load_synapse_config(synapse_files),
            explicit=keys_set_in(path, os.environ, SHARED_FEDERATION_KEYS),
            # The schema is the same whichever instance migrates it: the documented
            # `migrate -c ours.yaml --synapse-config homeserver.yaml` needs no worker file;
            # nor do the batch jobs, which read the database and serve nothing.
            check_instance=args.command not in ("migrate", "batch"),
        )
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(args)
    except ConfigError as e:
        print(f"federation-sender: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except SchemaVersionError as e:
        print(f"federation-sender: {e}", file=sys.stderr)
        return EXIT_SCHEMA
    except FederationSenderError as e:
        print(f"federation-sender: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    cmd: str = args.command
    if cmd == "generate-key":
        from federation_sender.transport.signing import generate_key_file

        generate_key_file(args.path, args.key_id)
        print(f"wrote signing key to {args.path}")
        return 0
    settings = _load(args)
    if cmd == "init":
        return _init(settings)
    if cmd == "check-config":
        import json

        shown = _displayable(settings)
        if args.synapse_config:
            shown["outbound_federation_proxy"] = _outbound_proxy_shown(settings, args)
        print(json.dumps(shown, indent=2, sort_keys=True))
        return 0
    if cmd == "migrate":
        if args.synapse_config:
            return asyncio.run(_migrate_beside_synapse(settings, args.revision))
        return asyncio.run(_migrate(settings, args.revision))
    if cmd == "worker":
        from federation_sender.app.process import run_worker
        from federation_sender.runtime import run

        synapse = None
        if args.synapse_config:
            from federation_sender.synapse.config import load_synapse_config

            synapse = load_synapse_config(args.synapse_config)
        return run(
            run_worker(settings, auto_migrate=not args.no_migrate, synapse=synapse),
            args.event_loop,
        )
    if cmd == "demo":
        from federation_sender.demo import run_demo

        return run_demo(settings, args)
    if cmd == "batch":
        from federation_sender.batch.cli import run_batch
        from federation_sender.builders import running_federation_client

        beside_synapse = bool(getattr(args, "synapse_config", None))
        return int(run_batch(args, settings, receivers=lambda clock: running_federation_client(
            settings, clock, synapse_key=beside_synapse)))
    raise AssertionError(cmd)  # pragma: no cover


def _init(settings: Settings) -> int:
    """Create what workers sharing a data directory must not race to create."""

    from federation_sender.builders import (
        admin_token_path,
        create_admin_token,
        read_admin_token,
        signing_key_path,
    )
    from federation_sender.transport.signing import generate_key_file, load_signing_key

    key_path = signing_key_path(settings)
    if key_path.exists():
        key = load_signing_key(key_path)
        print(f"signing key {key.key_id} already in {key_path}")
    else:
        key_path.parent.mkdir(parents=True, exist_ok=True)
        key = generate_key_file(key_path)
        print(f"wrote signing key {key.key_id} to {key_path}")
    if read_admin_token(settings) is not None:
        print("admin token already configured")
    else:
        create_admin_token(settings)
        print(f"wrote an admin token to {admin_token_path(settings)}")
    return 0


def _displayable(settings: Settings) -> dict[str, Any]:
    """The settings as printed by ``check-config``: the admin token and the password of
    every URL (database, Redis) replaced."""
    import dataclasses

    from federation_sender.redaction import REDACTED, redact_url
    from federation_sender.transport.forward_proxy import redact_proxy

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return redact_url(value) if isinstance(value, str) else value

    data: dict[str, Any] = clean(dataclasses.asdict(settings))
    if data["admin"].get("token"):
        data["admin"]["token"] = REDACTED
    for key in ("http_proxy", "https_proxy"):  # also ``user:password@host``, no scheme
        if data["federation"].get(key):
            data["federation"][key] = redact_proxy(data["federation"][key])
    return data


def _outbound_proxy_shown(settings: Settings, args: argparse.Namespace) -> dict[str, Any] | None:
    """Where this instance serves Synapse's ``outbound_federation_restricted_to`` proxy
    (the address callers use and the addresses bound), or None when the deployment does
    not restrict outbound federation. Its shared secret is never shown."""
    from federation_sender.synapse.config import load_synapse_config
    from federation_sender.synapse.deployment import (
        outbound_proxy_location,
        proxy_bind_addresses,
    )

    syn = load_synapse_config(args.synapse_config)
    location = outbound_proxy_location(syn, settings.instance_name)
    if location is None:
        return None
    bind = proxy_bind_addresses(syn, location)
    from federation_sender.transport.outbound_proxy import default_max_connections

    cap = settings.federation.outbound_proxy_max_connections
    return {"listen": location.describe(),
            "bind": bind if bind is not None else [location.host or location.describe()],
            "max_connections": cap if cap is not None else default_max_connections()}


async def _reachable(settings: Settings, engine: AsyncEngine) -> None:
    """Wait for the database as the worker does (``database.connect_attempts``): an
    unreachable one ends in one line (StartupError), not a driver's traceback."""
    from federation_sender.clock import SystemClock
    from federation_sender.startup import wait_for_database

    db = settings.database
    await wait_for_database(engine, attempts=db.connect_attempts,
                            interval_s=db.connect_retry_s, clock=SystemClock())


async def _migrate(settings: Settings, revision: str) -> int:
    from federation_sender.storage.engine import create_engine
    from federation_sender.storage.migrate import current_revision, upgrade

    engine = create_engine(settings.database.url)
    return await _migrate_with(settings, engine, current_revision, upgrade, revision,
                               "database")


async def _migrate_beside_synapse(settings: Settings, revision: str) -> int:
    from federation_sender.storage.synapse.database import (
        OWN_SCHEMA,
        create_synapse_engine,
        own_revision,
        upgrade_own_schema,
    )

    engine = create_synapse_engine(settings.database.url)
    return await _migrate_with(settings, engine, own_revision, upgrade_own_schema, revision,
                               f"schema {OWN_SCHEMA}")


async def _migrate_with(
    settings: Settings,
    engine: AsyncEngine,
    current: Callable[[AsyncEngine], Awaitable[str | None]],
    upgrade: Callable[[AsyncEngine, str], Awaitable[None]],
    revision: str,
    what: str,
) -> int:
    """Upgrade ``what`` (our database, or our schema beside Synapse's) to ``revision``
    and say from which revision to which; the engine is disposed of either way."""
    try:
        await _reachable(settings, engine)
        before = await current(engine)
        await upgrade(engine, revision)
        after = await current(engine)
    finally:
        await engine.dispose()
    if before == after:
        print(f"{what} already at revision {after}")
    else:
        print(f"{what} migrated from {before or 'empty'} to {after}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
