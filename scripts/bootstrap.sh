#!/usr/bin/env bash
# Set up everything this project needs on a fresh Debian machine with Python 3.11:
# system packages and the virtualenv in .venv.  Idempotent and quick when nothing changed.
#   runtime (scripts/demo.sh): the worker and the batch extra (Spark jobs), Java and the
#           SQLite JDBC driver so that `federation-sender batch ...` runs on the demo's
#           database. Without root, a missing Java is reported and the demo still runs.
#   test    (scripts/test.sh): also PostgreSQL, Redis, the PostgreSQL JDBC driver,
#           Chromium, openssl, the build tools Synapse needs, the dev extra and Synapse.
# Usage: scripts/bootstrap.sh [runtime|test]
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${1:-runtime}"

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      PY="$cand"; break
    fi
  done
fi
[ -n "$PY" ] || { echo "bootstrap: Python >= 3.11 is required" >&2; exit 1; }

need=()
have_cmd() { command -v "$1" >/dev/null 2>&1; }
# The batch jobs (both profiles): Java for Spark, and the driver that reads the demo's
# SQLite database.
have_cmd java || need+=(openjdk-17-jre-headless)
[ -f /usr/share/java/sqlite-jdbc.jar ] || need+=(libxerial-sqlite-jdbc-java)
if [ "$profile" = test ]; then
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
  have_cmd redis-server || need+=(redis-server)
  [ -f /usr/share/java/postgresql.jar ] || need+=(libpostgresql-jdbc-java)
  have_cmd chromium || need+=(chromium)
  have_cmd chromedriver || need+=(chromium-driver)
  have_cmd openssl || need+=(openssl)
  # Synapse's [postgres] extra builds psycopg2 from source.
  have_cmd pg_config || need+=(libpq-dev)
  have_cmd gcc || need+=(gcc)
fi
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" -ne 0 ]; then
  if [ "$profile" = test ]; then
    echo "bootstrap: please install: ${need[*]} (needs root)" >&2; exit 1
  fi
  echo "bootstrap: the batch jobs need: ${need[*]} (apt-get install, as root); the demo runs without them" >&2
  need=()
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "bootstrap: apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  # Debian starts a system redis; the tests run their own on free ports.
  (service redis-server stop >/dev/null 2>&1 || true)
fi

stamp=".venv/.installed-$profile"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing Python packages into .venv"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  if [ "$profile" = test ]; then
    .venv/bin/python -m pip install -q -e '.[dev]'
  else
    .venv/bin/python -m pip install -q -e '.[batch]'
  fi
  echo "$want" > "$stamp"
fi
if [ "$profile" = test ]; then
  # The real-Synapse tests' pinned Synapse, in its own cached virtualenv (once per machine).
  .venv/bin/python -m federation_sender.testing.synapse_install
fi
