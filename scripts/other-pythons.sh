#!/usr/bin/env bash
# The supported Pythons besides .venv's 3.11 (scripts/test.sh runs this beside its set-up,
# before the linters and the whole suite). For each of 3.12 and 3.13, the two side by side
# (each mostly waits: on two cores together they take about as long as one):
#   install  the worker alone, as an operator installs it: `pip install .` of the working
#            tree (pyproject.toml, README.md and federation_sender/ copied to a scratch
#            directory), no extras, in .venv-3.X;
#   demo     `federation-sender demo` from that install, short, in a scratch directory,
#            ending with its delivery check;
#   tests    the unit tests that need no service (no PostgreSQL, Redis, Java/Spark,
#            Chromium, Synapse, tinyproxy: FEDERATION_SENDER_SERVICE_FREE=1, which
#            tests/conftest.py reads, leaves the others out) in .venv-3.X-test: the test
#            dependencies (the dev extra's pins, not all of it), layered on .venv-3.X (the
#            package and its runtime dependencies, installed once).
# The virtualenvs are cached: each is made again when pyproject.toml, this script or the
# interpreter changed (a stamp, as scripts/bootstrap.sh keeps for .venv); the package
# itself is built and reinstalled from the working tree every run.
# An interpreter is python3.X on PATH or /root/.pyenv/versions/3.X*/bin/python3. A
# missing one fails the run when CI is set (.ci/run sets it), and is skipped locally.
# Output: one line per version at the end, everything in build/other-pythons-3.X*.log
# (the tail of it when a part failed).
# Usage: scripts/other-pythons.sh [3.12] [3.13]     Exit status 1 when any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# The tests' order is drawn at random (pytest-randomly): from scripts/test.sh's seed when
# it runs us (PYTEST_SEED), else from a new one, printed either way.
ORDER=(--randomly-seed="${PYTEST_SEED:-$(( (RANDOM << 15) | RANDOM ))}")
echo "test order: pytest-randomly ${ORDER[0]}"

VERSIONS=(3.12 3.13)
if [ "$#" -gt 0 ]; then VERSIONS=("$@"); fi
# The dev extra's packages the service-free tests import (versions from pyproject.toml).
TEST_PACKAGES=(pytest pytest-asyncio pytest-timeout pytest-randomly hypothesis uvloop
               openapi-spec-validator)
DEMO_ARGS=(--destinations 6 --rooms 4 --events 120 --duration 6 --no-live)
# Run first in their own process, as scripts/test.sh does on 3.11 (ast.parse and threads).
BOUNDARY=tests/storage/test_boundary.py
DEMO_TEST=tests/worker/test_demo.py::test_demo_runs_end_to_end_and_passes_the_delivery_check

# As federation_sender/testing/prereq.py reads CI.
in_ci() { case "$(printf %s "${CI:-}" | tr -d '[:space:]' | tr '[:upper:]' '[:lower:]')" in
  ""|0|false|no) return 1;; esac; }
say() { echo "other-pythons: $*"; }

# The interpreter for version $1 (e.g. 3.12), or nothing.
find_python() {
  local version=$1 cand exe
  local -a cands=()
  exe=$(command -v "python$version" 2>/dev/null) && cands+=("$exe")
  while IFS= read -r dir; do
    [ -n "$dir" ] && cands+=("$dir/bin/python3")
  done < <(ls -d /root/.pyenv/versions/"$version"* 2>/dev/null | sort -rV)
  for cand in "${cands[@]}"; do
    # pyenv puts a shim on PATH for versions it does not select: it must run, as $version.
    if exe=$("$cand" -c "import sys; v = '%d.%d' % sys.version_info[:2]
print(sys.executable) if v == '$version' else sys.exit(1)" 2>/dev/null); then
      echo "$exe"; return 0
    fi
  done
  return 1
}

# The requirements of the dev extra named in TEST_PACKAGES, one a line.
test_requirements() {
  "$1" - "${TEST_PACKAGES[@]}" <<'EOF'
import re, sys, tomllib
wanted = set(sys.argv[1:])
with open("pyproject.toml", "rb") as f:
    dev = tomllib.load(f)["project"]["optional-dependencies"]["dev"]
found = {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower(): r for r in dev}
lost = wanted - found.keys()
if lost:
    sys.exit(f"not in the dev extra: {sorted(lost)}")
print("\n".join(found[n] for n in sorted(wanted)))
EOF
}

# A virtualenv at $2 for interpreter $1, made anew unless its stamp is $3. Status 10
# when it was (re)made (the caller then installs the dependencies), 0 when cached.
cached_venv() {
  local py=$1 dir=$2 want=$3
  if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  rm -rf "$dir"
  "$py" -m venv "$dir" || return 1
  "$dir/bin/python" -m pip install -q --upgrade pip || return 1
  return 10
}

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p build
export PIP_DISABLE_PIP_VERSION_CHECK=1

# What `pip install .` builds from: the working tree's package, not the checkout itself
# (no build/ or egg-info left in it, nothing stale from an earlier build); one copy per
# version, since setuptools builds in the source directory.
copy_source() {
  mkdir -p "$1"
  cp pyproject.toml README.md "$1"/
  tar -cf - --exclude=__pycache__ --exclude='*.pyc' federation_sender | tar -xf - -C "$1"
}

# One version's three parts; its result line goes to $scratch/result-$1.
run_version() {
  # $2: the version's slot (0, 1, ...). The loopback ports are cut in two slices per
  # version, one for its tests and one for its demo.
  local version=$1 slot=${2:-0} py stamp rt tv wheel start rc rc_first rc_demo log
  local t_install t_demo t_tests summary
  result() { echo "$version: $*" > "$scratch/result-$version"; }
  if ! py=$(find_python "$version"); then
    if in_ci; then
      result "FAILED, no interpreter (python$version, /root/.pyenv/versions/$version*); CI needs one"
      return 1
    fi
    result "skipped, no interpreter (python$version, /root/.pyenv/versions/$version*)"
    return 0
  fi
  say "Python $version: $py"
  stamp="$("$py" -c 'import sys; print(sys.version.split()[0])') $(
    cat pyproject.toml scripts/other-pythons.sh | sha256sum | cut -d' ' -f1)"
  rt=.venv-$version
  tv=.venv-$version-test
  log=build/other-pythons-$version
  copy_source "$scratch/src-$version"

  # --- install: the worker alone
  start=$SECONDS
  cached_venv "$py" "$rt" "$stamp"; rc=$?
  [ "$rc" -eq 0 ] || [ "$rc" -eq 10 ] || { result "FAILED, creating $rt"; return 1; }
  "$rt/bin/python" -m pip wheel -q --no-deps -w "$scratch/dist-$version" "$scratch/src-$version" \
    || { result "FAILED, building the wheel (pip install .)"; return 1; }
  wheel=$(ls "$scratch/dist-$version"/federation_sender-*.whl)
  if [ "$rc" -eq 10 ]; then
    say "Python $version: installing the worker and its runtime dependencies into $rt"
    "$rt/bin/python" -m pip install -q "$wheel" || { result "FAILED, pip install ."; return 1; }
    echo "$stamp" > "$rt/.stamp"
  else
    "$rt/bin/python" -m pip install -q --no-deps --force-reinstall "$wheel" \
      || { result "FAILED, pip install ."; return 1; }
  fi
  "$rt/bin/python" -m pip check || { result "FAILED, pip check in $rt"; return 1; }
  # The worker alone: nothing of the dev or batch extras came with it.
  "$rt/bin/python" -c "import importlib.util as u, sys
extra = [m for m in ('pytest', 'hypothesis', 'selenium', 'pyspark', 'pandas') if u.find_spec(m)]
sys.exit(f'the runtime install carries {extra}' if extra else 0)" \
    || { result "FAILED, the runtime install has dev or batch packages"; return 1; }
  t_install=$((SECONDS - start))

  # --- demo, from that install, in a directory of its own (its SQLite under ./data).
  # It runs beside the test set-up and the tests below (it waits on its own 6 s of
  # traffic most of its 16-19 s), in a slice of the loopback ports of its own: the
  # tests and demos of both versions run at once and pick free ports independently.
  local demo_pid demo_started=$SECONDS
  mkdir -p "$scratch/demo-$version"
  local slices=$((2 * ${#VERSIONS[@]}))
  (cd "$scratch/demo-$version" && FEDERATION_SENDER_PORT_SLICE="$((2 * slot + 1))/$slices" \
    timeout 180 "$ROOT/$rt/bin/federation-sender" demo "${DEMO_ARGS[@]}"; \
    echo "$? $((SECONDS - demo_started))" > "$scratch/demo-$version.rc") > "$log-demo.log" 2>&1 &
  demo_pid=$!

  # --- tests: the service-free unit tests, in $tv layered on $rt: a .pth file puts $rt's
  # site-packages (the worker just installed, its runtime dependencies) on $tv's path
  # after its own, so $tv holds only the test packages and $rt stays the worker alone.
  # Each dependency is installed once per version (a second full install cost about 70 s
  # on a new machine).
  start=$SECONDS
  cached_venv "$py" "$tv" "$stamp"; rc=$?
  [ "$rc" -eq 0 ] || [ "$rc" -eq 10 ] || { result "FAILED, creating $tv"; return 1; }
  if [ "$rc" -eq 10 ]; then
    local -a reqs=()
    local site_of='import sysconfig; print(sysconfig.get_path("purelib"))'
    mapfile -t reqs < <(test_requirements "$tv/bin/python")
    [ "${#reqs[@]}" -gt 0 ] || { result "FAILED, reading the test requirements"; return 1; }
    "$rt/bin/python" -c "$site_of" > "$("$tv/bin/python" -c "$site_of")/worker-runtime.pth" \
      || { result "FAILED, layering $tv on $rt"; return 1; }
    say "Python $version: installing ${reqs[*]} into $tv (layered on $rt)"
    "$tv/bin/python" -m pip install -q "${reqs[@]}" \
      || { result "FAILED, installing the test dependencies"; return 1; }
    echo "$stamp" > "$tv/.stamp"
  fi
  # $tv sees the worker installed in $rt, and its dependencies (outside the checkout,
  # whose own federation_sender/ the tests import).
  (cd "$scratch" && "$ROOT/$tv/bin/python" -c "import federation_sender, aiohttp, sys
sys.exit(0 if federation_sender.__file__.startswith('$ROOT/$rt/') else
         f'federation_sender comes from {federation_sender.__file__}, not $rt')") \
    || { result "FAILED, $tv does not see the worker of $rt"; return 1; }
  local -a pytest=(env FEDERATION_SENDER_SERVICE_FREE=1
                   FEDERATION_SENDER_PORT_SLICE="$((2 * slot))/$slices" "$tv/bin/python" -m pytest
                   -q -p no:cacheprovider "${ORDER[@]}")
  "${pytest[@]}" "$BOUNDARY" > "$log-tests-first.log" 2>&1
  rc_first=$?
  # The demo's own end-to-end test is left out: the demo part above ran the same demo,
  # with its delivery check, from the worker installed alone on this interpreter.
  # One process per version: on two xdist workers each, 3.12 alone took 128 s instead
  # of 220 s, but beside the other version and the set-up (every core busy) its second
  # collection only added work: 258-267 s against 245-248 s.
  "${pytest[@]}" --ignore="$BOUNDARY" --deselect "$DEMO_TEST" > "$log-tests.log" 2>&1
  rc=$?
  t_tests=$((SECONDS - start))
  wait "$demo_pid"
  # The demo's status in its own variable: read into rc, it hid the tests' (a run with
  # two failed tests on 3.13 was reported OK).
  read -r rc_demo t_demo < "$scratch/demo-$version.rc" 2>/dev/null || { rc_demo=255; t_demo=0; }
  if [ "$rc_demo" -ne 0 ] || ! grep -q "delivery check: OK" "$log-demo.log" \
      || grep -q Traceback "$log-demo.log"; then
    tail -40 "$log-demo.log"
    result "FAILED, the demo (exit $rc_demo, ${t_demo}s; $log-demo.log)"
    return 1
  fi
  summary="$(tail -1 "$log-tests-first.log"); $(tail -1 "$log-tests.log")"
  local times="install ${t_install}s, demo ${t_demo}s, tests ${t_tests}s"
  if [ "$rc" -eq 5 ] || [ "$rc_first" -eq 5 ]; then
    result "FAILED, pytest collected no tests ($times)"; return 1
  fi
  if [ "$rc" -ne 0 ] || [ "$rc_first" -ne 0 ]; then
    sed -n '/short test summary info/,$p' "$log-tests-first.log" "$log-tests.log" | tail -60
    result "FAILED, tests: $summary ($times; $log-tests*.log)"; return 1
  fi
  result "OK: worker installed alone, demo delivery check OK, tests: $summary ($times)"
}

say "Python ${VERSIONS[*]} side by side; logs in build/other-pythons-<version>*.log"
pids=()
for i in "${!VERSIONS[@]}"; do
  version=${VERSIONS[$i]}
  run_version "$version" "$i" > "build/other-pythons-$version.log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!VERSIONS[@]}"; do
  if ! wait "${pids[$i]}"; then
    status=1
    echo "--- Python ${VERSIONS[$i]}: the end of build/other-pythons-${VERSIONS[$i]}.log"
    grep -v "^WARNING: Location" "build/other-pythons-${VERSIONS[$i]}.log" | tail -80
  fi
done
echo "== other Pythons"
for version in "${VERSIONS[@]}"; do
  cat "$scratch/result-$version" 2>/dev/null || { echo "$version: FAILED, no result"; status=1; }
done
exit "$status"
