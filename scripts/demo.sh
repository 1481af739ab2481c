#!/usr/bin/env bash
# The main job on embedded defaults: set up, then run the end-to-end demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh runtime
exec .venv/bin/federation-sender demo "$@"
