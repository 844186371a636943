#!/usr/bin/env bash
# The project's whole check, used by developers (`./scripts/test.sh`) and CI (`.ci/run` runs
# exactly this): a venv with the test and bench extras, a broker with its management plugin, ruff,
# mypy --strict, then every test under tests/. Arguments go to pytest (e.g. `-k apply -x`).
#
# Works from any directory, on a fresh clone, without a terminal (CI=true, no stdin). Setup
# failures stop at once; lint and type failures are reported and the tests still run, so one
# run shows every problem. Exit 0 only when every stage passed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

# A hung test must not hang CI; the suite is meant to finish well under 15 minutes.
PYTEST_TIMEOUT="${RABBIT_RETRY_PYTEST_TIMEOUT:-1800}"
START=$SECONDS
FAILED=()

finish() {
    local took=$((SECONDS - START))
    if [ "${#FAILED[@]}" -eq 0 ]; then
        stage "PASSED in ${took}s: ruff, mypy --strict, $label"
        exit 0
    fi
    stage "FAILED in ${took}s: ${FAILED[*]}"
    exit 1
}

stage "python environment"
ensure_venv
note "pip install -e '.[test,bench]' (the bench extra: the suite runs a smoke of the benchmarks)"
pip_quiet install -e '.[test,bench]'
export PATH="$VENV/bin:$PATH"

stage "broker"
# The tests target RABBIT_RETRY_TEST_URL when set (see tests/conftest.py): make sure that one is up.
RABBIT_RETRY_URL="${RABBIT_RETRY_TEST_URL:-${RABBIT_RETRY_URL:-}}" \
    RABBIT_RETRY_MANAGEMENT_URL="${RABBIT_RETRY_TEST_MANAGEMENT_URL:-${RABBIT_RETRY_MANAGEMENT_URL:-}}" \
    "$ROOT/scripts/ensure-broker.sh" </dev/null

stage "ruff check rabbit_retry tests bench"
timeout 600 ruff check --output-format=concise rabbit_retry tests bench </dev/null || FAILED+=(ruff)

stage "mypy --strict rabbit_retry"
timeout 900 mypy --strict rabbit_retry </dev/null || FAILED+=(mypy)

# Paths among the arguments replace the default target, so `./scripts/test.sh tests/unit` works.
targets=(tests)
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        targets=()
        break
    fi
done

# In CI each test's name is printed before it runs, so a hung test is named by the log's last
# line; at a terminal, dots are enough.
verbosity=-q
case "${CI:-}" in
    "" | 0 | false) ;;
    *) verbosity=-v ;;
esac

label=pytest
for arg in ${targets[@]+"${targets[@]}"} "$@"; do label+=" $arg"; done
stage "$label"
rc=0
# SIGINT first, so a timed-out pytest still tears down (deleting its vhosts) and reports.
timeout --signal=INT --kill-after=60 "$PYTEST_TIMEOUT" \
    pytest ${targets[@]+"${targets[@]}"} "$verbosity" -ra --durations=15 -p no:cacheprovider \
    "$@" </dev/null || rc=$?
case "$rc" in
    0) ;;
    5)
        note "$label collected no tests (pytest exit 5): the suite must run tests"
        FAILED+=("pytest (no tests collected)")
        ;;
    124)
        note "pytest was stopped after ${PYTEST_TIMEOUT}s (RABBIT_RETRY_PYTEST_TIMEOUT)"
        FAILED+=("pytest (timed out)")
        ;;
    *) FAILED+=("pytest (exit $rc)") ;;
esac

finish
