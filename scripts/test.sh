#!/usr/bin/env bash
# The project's whole check, used by developers (`./scripts/test.sh`) and CI (`.ci/run` runs
# exactly this): a venv with the test and bench extras, ruff, mypy --strict, then the tests on
# every RabbitMQ version we support, each started by scripts/broker.sh on its own ports:
#
#   4.3   every test            (Debian sid's RabbitMQ, in a chroot)
#   3.10  every test            (the machine's own rabbitmq-server)
#   4.0   worker, provisioning and reliability tests (Debian trixie's, in a chroot)
#   a 3-node 4.3 cluster (scripts/cluster.sh): the cluster tests, with the node lists
#
#   ./scripts/test.sh                        the matrix above
#   ./scripts/test.sh --broker 4.3 [ARGS]    one version; ARGS go to pytest (e.g. -k apply -x)
#   ./scripts/test.sh --broker cluster       only the cluster stage
#   ./scripts/test.sh tests/unit             only the pure tests: no broker needed
#
# With RABBIT_RETRY_TEST_URL set (and RABBIT_RETRY_TEST_MANAGEMENT_URL), the tests run once,
# against that broker. Works from any directory, on a fresh clone, without a terminal (CI=true,
# no stdin). Setup failures stop at once; lint, type and test failures are reported and the
# other stages still run, so one run shows every problem. Exit 0 only when every stage passed.
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

stage "promtool (the alert rules' tests)"
ensure_promtool

stage "ruff check rabbit_retry tests bench"
timeout 600 ruff check --output-format=concise rabbit_retry tests bench </dev/null || FAILED+=(ruff)

stage "mypy --strict rabbit_retry"
timeout 900 mypy --strict rabbit_retry </dev/null || FAILED+=(mypy)

# The desk from the installed wheel: its migrations run on a new SQLite store and its page and
# API answer (the broker need not answer for that).
desk_smoke() {
    local tmp="$1" port pid rc=0
    port="$("$tmp/venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    "$tmp/venv/bin/rabbit-retry" desk "$ROOT/topologies/demo.yml" --store "sqlite:///$tmp/desk.db" \
        --listen "127.0.0.1:$port" >"$tmp/desk.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 100); do
        curl -fsS --max-time 2 "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
        sleep 0.2
    done
    {
        curl -fsS --max-time 5 "http://127.0.0.1:$port/api/overview" | grep -q '"parked":0' &&
            curl -fsS --max-time 5 -o /dev/null "http://127.0.0.1:$port/" &&
            note "wheel smoke: the desk migrated its store and served its page and API"
    } || { rc=1; tail -n 20 "$tmp/desk.log" >&2; }
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    return "$rc"
}

# What users install: the wheel, in a fresh venv, run from outside the source tree.
wheel_smoke() {
    local tmp rc=0
    tmp="$(mktemp -d "${TMPDIR:-/tmp}/rabbit-retry-wheel.XXXXXX")"
    # Build and install quietly; their output is shown only when they fail.
    {
        "$VENV/bin/python" -m pip wheel --no-deps -q -w "$tmp/dist" "$ROOT" >"$tmp/build.log" 2>&1 &&
            "$(find_python)" -m venv "$tmp/venv" &&
            timeout 900 "$tmp/venv/bin/python" -m pip install -q "$(echo "$tmp"/dist/*.whl)[desk]" \
                >>"$tmp/build.log" 2>&1 &&
            note "built and installed $(basename "$tmp"/dist/*.whl)" &&
            (
                cd "$tmp" &&
                    "$tmp/venv/bin/rabbit-retry" --version &&
                    "$tmp/venv/bin/rabbit-retry" validate "$ROOT/topologies/orders.yml" \
                        >"$tmp/validate.out" && head -n 1 "$tmp/validate.out" &&
                    "$tmp/venv/bin/python" -c '
import importlib.resources, rabbit_retry, rabbit_retry.worker, rabbit_retry.contract
assert rabbit_retry.__file__.startswith("'"$tmp"'/venv/"), rabbit_retry.__file__
assert importlib.resources.files("rabbit_retry").joinpath("py.typed").is_file()
assert importlib.resources.files("rabbit_retry").joinpath("desk/static/js/app.js").is_file()
print("wheel smoke: imports, py.typed, the desk page and the CLI work from", rabbit_retry.__file__)' &&
                desk_smoke "$tmp"
            )
    } </dev/null || rc=$?
    [ "$rc" -eq 0 ] || tail -n 40 "$tmp/build.log" >&2 2>/dev/null || true
    rm -rf "$tmp"
    return "$rc"
}

BROKERS=()
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --broker)
            [ $# -ge 2 ] || die "--broker needs a version: 3.10, 4.0, 4.3 or cluster"
            BROKERS+=("$2")
            shift 2
            ;;
        --broker=*) BROKERS+=("${1#--broker=}") && shift ;;
        *) args+=("$1") && shift ;;
    esac
done
set -- ${args[@]+"${args[@]}"}

# Paths among the arguments replace the default target, so `./scripts/test.sh tests/unit` works.
targets=()
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        targets=(-)
        break
    fi
done
only_unit=""
if [ "${targets[*]-}" = "-" ]; then
    only_unit=1
    for arg in "$@"; do
        [[ "$arg" != -* && -e "${arg%%::*}" && "${arg%%::*}" != tests/unit* ]] && only_unit=""
    done
fi

# In CI each test's name is printed before it runs, so a hung test is named by the log's last
# line; at a terminal, dots are enough.
verbosity=-q
case "${CI:-}" in
    "" | 0 | false) ;;
    *) verbosity=-v ;;
esac

PASSED=0
FAILED_TESTS=0
# run_pytest LABEL TARGET... -- ARGS: one pytest run, its counts added to the totals.
run_pytest() {
    local label="$1" log rc=0 line
    shift
    local run_targets=()
    while [ "$1" != -- ]; do run_targets+=("$1") && shift; done
    shift
    stage "$label"
    log="$(mktemp "${TMPDIR:-/tmp}/rabbit-retry-pytest.XXXXXX")"
    # SIGINT first, so a timed-out pytest still tears down (deleting its vhosts) and reports.
    # pytest's own exit code, through the pipe to tee (PIPESTATUS would be lost to `|| true`).
    { timeout --signal=INT --kill-after=60 "$PYTEST_TIMEOUT" \
        pytest ${run_targets[@]+"${run_targets[@]}"} "$verbosity" -ra --durations=10 \
        -p no:cacheprovider "$@" </dev/null 2>&1 && echo 0 >"$log.rc" || echo $? >"$log.rc"; } |
        tee "$log"
    rc="$(cat "$log.rc")"
    rm -f "$log.rc"
    line="$(grep -E '(passed|failed|error|no tests ran).* in [0-9.]+s' "$log" | tail -n 1 || true)"
    local n
    for n in $(grep -oE '[0-9]+ passed' <<<"$line" | grep -oE '[0-9]+' || true); do
        PASSED=$((PASSED + n))
    done
    for n in $(grep -oE '[0-9]+ (failed|error)' <<<"$line" | grep -oE '[0-9]+' || true); do
        FAILED_TESTS=$((FAILED_TESTS + n))
    done
    rm -f "$log"
    case "$rc" in
        0) ;;
        5)
            note "$label collected no tests (pytest exit 5): the suite must run tests"
            FAILED+=("$label (no tests collected)")
            ;;
        124)
            note "$label was stopped after ${PYTEST_TIMEOUT}s (RABBIT_RETRY_PYTEST_TIMEOUT)"
            FAILED+=("$label (timed out)")
            ;;
        *) FAILED+=("$label (exit $rc)") ;;
    esac
}

# The tests of a broker version: everything, or what depends on the version most.
version_targets() {
    case "$1" in
        4.0) echo tests/integration/test_worker*.py tests/integration/test_provision*.py \
            tests/integration/test_redelivery_fixtures.py tests/reliability ;;
        *) echo tests ;;
    esac
}

only_cluster=""
[ "${BROKERS[*]-}" != cluster ] || only_cluster=1

if [ -z "$only_unit" ]; then
    if [ -z "$only_cluster" ]; then
        stage "wheel: build it, install it in a fresh venv, smoke it"
        wheel_smoke || FAILED+=(wheel)
    fi
    stage "idempotency stores: PostgreSQL and Redis"
    ensure_stores
    stage "Node.js and amqplib (the header type tests' second foreign publisher)"
    ensure_amqplib
    if [ -z "$only_cluster" ]; then
        stage "chromium and chromedriver (the failure desk page's browser tests)"
        ensure_chromium
    fi
fi

# The cluster tests need every node, and a stage that started the cluster stops it again,
# however the script ends (a failure, CI's timeout): three nodes left running would hold ports
# and memory on the next run's machine.
CLUSTER_TESTS=(tests/integration/test_cluster_urls.py tests/integration/test_cluster_status.py
    tests/reliability/test_cluster.py tests/reliability/test_refusals.py)
# Starting three nodes and clustering them: well under this on a 2-core machine (about 30 s).
CLUSTER_UP_TIMEOUT="${RABBIT_RETRY_CLUSTER_UP_TIMEOUT:-600}"
started_cluster=""
stop_cluster() {
    if [ -n "$started_cluster" ]; then
        started_cluster=""
        note "stopping the cluster this run started"
        timeout 300 "$ROOT/scripts/cluster.sh" down </dev/null || note "scripts/cluster.sh down failed"
    fi
}
trap stop_cluster EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

cluster_stage() {
    local began=$SECONDS
    stage "cluster of three RabbitMQ 4.3 nodes"
    if ! "$ROOT/scripts/cluster.sh" status 2>/dev/null | grep -q '^running members: .* .* '; then
        started_cluster=1
    fi
    if timeout --kill-after=30 "$CLUSTER_UP_TIMEOUT" "$ROOT/scripts/cluster.sh" up </dev/null; then
        note "cluster up after $((SECONDS - began))s"
        # The last stage: the cluster's variables replace the single node's from here on.
        eval "$("$ROOT/scripts/cluster.sh" env)"
        run_pytest "pytest on a 3-node RabbitMQ 4.3 cluster" "${CLUSTER_TESTS[@]}" -- "$@"
    else
        FAILED+=("cluster (did not start within ${CLUSTER_UP_TIMEOUT}s)")
    fi
    stop_cluster
    note "cluster stage took $((SECONDS - began))s"
}

label=""
if [ -n "$only_unit" ]; then
    label="pytest $*"
    run_pytest "$label" -- "$@"
elif [ -n "${RABBIT_RETRY_TEST_URL:-}" ]; then
    stage "broker (RABBIT_RETRY_TEST_URL)"
    RABBIT_RETRY_URL="$RABBIT_RETRY_TEST_URL" \
        RABBIT_RETRY_MANAGEMENT_URL="${RABBIT_RETRY_TEST_MANAGEMENT_URL:-${RABBIT_RETRY_MANAGEMENT_URL:-}}" \
        "$ROOT/scripts/ensure-broker.sh" </dev/null
    label="pytest"
    if [ "${targets[*]-}" = "-" ]; then run_pytest "$label $*" -- "$@"; else run_pytest "$label tests $*" tests -- "$@"; fi
elif [ -n "$only_cluster" ]; then
    [ "${targets[*]-}" != "-" ] || die "--broker cluster runs the cluster tests; name no paths"
    label="tests on a 3-node 4.3 cluster"
    cluster_stage "$@"
else
    [ "${#BROKERS[@]}" -gt 0 ] || BROKERS=(4.3 3.10 4.0)
    for version in "${BROKERS[@]}"; do
        [ "$version" != cluster ] || continue
        stage "broker $version"
        if ! "$ROOT/scripts/broker.sh" up "$version" </dev/null; then
            FAILED+=("broker $version (did not start)")
            continue
        fi
        eval "$("$ROOT/scripts/broker.sh" env "$version")"
        if [ "${targets[*]-}" = "-" ]; then
            run_pytest "pytest on RabbitMQ $version: $*" -- "$@"
        else
            # shellcheck disable=SC2046
            run_pytest "pytest on RabbitMQ $version" $(version_targets "$version") -- "$@"
        fi
    done
    label="tests on RabbitMQ ${BROKERS[*]}"
    # The cluster tests, on three 4.3 nodes (scripts/cluster.sh), when 4.3 is in the matrix and
    # no test paths were named; label says so. A cluster this run started is stopped again.
    if [[ " ${BROKERS[*]} " == *" 4.3 "* || " ${BROKERS[*]} " == *" cluster "* ]] &&
        [ "${targets[*]-}" != "-" ]; then
        label="$label and a 3-node 4.3 cluster"
        cluster_stage "$@"
    fi
fi

printf 'total: %d passed, %d failed\n' "$PASSED" "$FAILED_TESTS"
finish
