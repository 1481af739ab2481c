"""``python -m federation_sender.batch <job> ...``: the batch jobs without the main CLI."""

from __future__ import annotations

import argparse
import sys

from federation_sender.batch.arguments import EXIT_USAGE, add_job_parsers
from federation_sender.batch.cli import run_batch
from federation_sender.config.loading import load_settings
from federation_sender.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m federation_sender.batch")
    jobs = parser.add_subparsers(dest="job", metavar="JOB")
    jobs.required = True
    add_job_parsers(jobs)
    args = parser.parse_args(argv)
    if args.synapse_config:
        # Synapse's files are read by the main command line (a layer above this one).
        print("--synapse-config: run 'federation-sender batch JOB --synapse-config ...'",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(f"configuration error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return run_batch(args, settings)


if __name__ == "__main__":
    sys.exit(main())
