#!/usr/bin/env bash
# Run the Synapse backend's end-to-end tests against each Synapse release of the
# supported window, each release in its own cached virtualenv
# (~/.cache/federation-sender/synapse-<version>, installed on first use: a minute or
# two each, psycopg2 built once and then taken from pip's wheel cache), and write a
# table of results.
#
#   scripts/synapse-compat.sh                  # every release of the window
#   scripts/synapse-compat.sh 1.158.0 1.161.0  # some of them
#   COMPAT_TESTS="tests/synapse/test_backend_e2e.py" scripts/synapse-compat.sh
#
# The table (Markdown, one row per release: schema and compat version from the
# release's own synapse/storage/schema/__init__.py, tests passed / failed / skipped,
# seconds) goes to stdout and to $COMPAT_OUT (default build/synapse-compat.md); each
# release's pytest output to build/synapse-compat-<version>.log. Exit status 1 when a
# release failed to install or a test failed. Not part of scripts/test.sh: the suite
# runs against the pinned release (federation_sender/testing/synapse_install.py).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  echo "synapse-compat.sh: no .venv; run scripts/bootstrap.sh test first" >&2
  exit 2
fi
# The window is the package's one list (storage/synapse/schema.py).
read -r -a WINDOW < <(.venv/bin/python -c "from federation_sender.storage.synapse.schema \
import SYNAPSE_RELEASE_WINDOW as w; print(*w)")
if [ "$#" -gt 0 ]; then WINDOW=("$@"); fi
TESTS=${COMPAT_TESTS:-"tests/synapse/test_backend_e2e.py tests/synapse/test_edu_e2e.py \
tests/storage/synapse/test_backend_queries.py tests/storage/synapse/test_backend_schema.py \
tests/synapse/test_sharded_senders.py"}
OUT=${COMPAT_OUT:-build/synapse-compat.md}
mkdir -p build "$(dirname "$OUT")"
if [ ! -x .venv/bin/pytest ]; then
  echo "synapse-compat.sh: no .venv; run scripts/bootstrap.sh test first" >&2
  exit 2
fi

{
  echo "| Synapse | schema / compat | tests passed | failed | skipped | seconds |"
  echo "|---|---|---|---|---|---|"
} > "$OUT"
status=0
for version in "${WINDOW[@]}"; do
  export FEDERATION_SENDER_SYNAPSE_VERSION=$version
  log=build/synapse-compat-$version.log
  if ! python=$(.venv/bin/python -m federation_sender.testing.synapse_install 2>"$log"); then
    echo "| $version | - | install failed: $(tail -1 "$log") | | | |" >> "$OUT"
    status=1
    continue
  fi
  schema=$("$python" - <<'EOF'
import synapse.storage.schema as s
print(f"{s.SCHEMA_VERSION} / {s.SCHEMA_COMPAT_VERSION}")
EOF
  )
  start=$(date +%s)
  # shellcheck disable=SC2086  # TESTS is a list of paths
  PYTHONPATH=$PWD .venv/bin/pytest -q -p no:cacheprovider $TESTS > "$log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  summary=$(tail -1 "$log")
  count() { echo "$summary" | grep -oE "[0-9]+ $1" | grep -oE "^[0-9]+" || echo 0; }
  passed=$(count passed); failed=$(( $(count failed) + $(count error) )); skipped=$(count skipped)
  if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then failed="exit $rc"; fi
  if [ "$rc" -ne 0 ]; then status=1; fi
  echo "| $version | $schema | $passed | $failed | $skipped | $seconds |" >> "$OUT"
  echo "synapse-compat.sh: $version: $summary" >&2
done
cat "$OUT"
exit "$status"
