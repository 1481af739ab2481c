#!/usr/bin/env bash
# Set up everything (virtualenv, PostgreSQL, Redis, Java, JDBC driver, Chromium) and run
# the whole test suite plus the linters. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh test
echo "== ruff"; .venv/bin/ruff check federation_sender tests bench migrations
echo "== mypy"; .venv/bin/mypy
echo "== pytest"
set +e
.venv/bin/pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a broken run" >&2
  exit 1
fi
exit "$rc"
