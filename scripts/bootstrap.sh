#!/usr/bin/env bash
# Set up everything this project needs on a fresh Debian machine with Python 3.11 to 3.13:
# system packages and the virtualenv in .venv.  Idempotent and quick when nothing changed.
#   runtime (scripts/demo.sh): the worker and the batch extra (Spark jobs), Java and the
#           SQLite JDBC driver so that `federation-sender batch ...` runs on the demo's
#           database. Without root, a missing Java is reported and the demo still runs.
#   test    (scripts/test.sh): also PostgreSQL, Redis, tinyproxy, the PostgreSQL JDBC driver,
#           Chromium, openssl, the build tools Synapse needs, the dev extra and Synapse.
# Usage: scripts/bootstrap.sh [runtime|test]
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${1:-runtime}"

# The supported Pythons are 3.11, 3.12 and 3.13 (.venv: the first found, 3.11 preferred,
# the one CI runs the whole suite on; scripts/other-pythons.sh covers the other two).
# A pyenv shim is on PATH for every version pyenv knows; it must also run.
supported() {
  "$1" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))' 2>/dev/null
}
PY="${PYTHON:-}"
if [ -n "$PY" ]; then
  supported "$PY" || { echo "bootstrap: PYTHON=$PY is not Python 3.11, 3.12 or 3.13" >&2; exit 1; }
else
  for cand in python3.11 python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1 && supported "$cand"; then
      PY="$cand"; break
    fi
  done
fi
[ -n "$PY" ] || { echo "bootstrap: Python 3.11, 3.12 or 3.13 is required" >&2; exit 1; }

need=()
have_cmd() { command -v "$1" >/dev/null 2>&1; }
# The batch jobs (both profiles): Java for Spark, and the driver that reads the demo's
# SQLite database.
have_cmd java || need+=(openjdk-17-jre-headless)
[ -f /usr/share/java/sqlite-jdbc.jar ] || need+=(libxerial-sqlite-jdbc-java)
if [ "$profile" = test ]; then
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
  have_cmd redis-server || need+=(redis-server)
  have_cmd tinyproxy || need+=(tinyproxy)
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
# The system packages and then the pinned Synapse (whose psycopg2 builds with gcc and
# libpq-dev from them) go on beside the .venv install, which needs neither: on a new
# machine apt-get and the two pip installs each wait on downloads and unpacking much of
# the time, and one after the other they left a core idle.
side() {
  if [ ${#need[@]} -gt 0 ]; then
    echo "bootstrap: apt-get install ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || return 1
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null || return 1
    # Debian starts a system redis; the tests run their own on free ports.
    (service redis-server stop >/dev/null 2>&1 || true)
  fi
  if [ "$profile" = test ]; then
    # The real-Synapse tests' pinned Synapse, in its own cached virtualenv (once per
    # machine). The module is standard library only: the base Python runs it.
    "$PY" federation_sender/testing/synapse_install.py || return 1
  fi
}
side &
side_pid=$!
trap 'kill "$side_pid" 2>/dev/null || true' EXIT

stamp=".venv/.installed-$profile"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing Python packages into .venv"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  if [ "$profile" = test ]; then
    # Not byte-compiled at install: the suite imports a fraction of the dev extra (most
    # of pyspark, pandas and matplotlib never), and compiles what it imports as it goes;
    # compiling everything cost 35 of 125 CPU seconds on this 2-core machine.
    .venv/bin/python -m pip install -q --no-compile -e '.[dev]'
  else
    .venv/bin/python -m pip install -q -e '.[batch]'
  fi
  echo "$want" > "$stamp"
fi
if ! wait "$side_pid"; then
  echo "bootstrap: installing the system packages or Synapse failed (above)" >&2
  exit 1
fi
trap - EXIT
