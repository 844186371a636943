#!/usr/bin/env bash
# The project's whole check, used by developers (`./scripts/test.sh`) and CI (`.ci/run` runs
# exactly this): a venv with the test and bench extras, ruff, mypy --strict, the wheel, then the
# tests, each where it belongs (tests/conftest.py marks every test from its file; its docstring
# says how to classify a new one):
#
#   unit tests          once, no broker
#   4.3                 every broker test            (Debian sid's RabbitMQ, in a chroot)
#   3.10                the version-dependent ones   (the machine's own rabbitmq-server)
#   4.0                 the version-dependent ones   (Debian trixie's, in a chroot)
#   a 3-node 4.3 cluster (scripts/cluster.sh): the cluster tests, with the node lists
#
# Within a stage the tests run in parallel (pytest-xdist: each test has a vhost of its own), the
# slowest first (tests/conftest.py's SLOW), 5 at a time on 4.3 (RABBIT_RETRY_TEST_WORKERS); the
# few marked `alone` (they restart their stage's broker) run after, one at a time (4.3's beside
# the later stages). ruff, mypy and the wheel run beside the first stages, the unit tests (in
# the whole matrix) after the cluster stage, beside the older versions' tests; the two older
# versions (2 at a time each, RABBIT_RETRY_TEST_WORKERS_BESIDE) and the cluster stage run side
# by side after 4.3, on nodes and ports of their own; RABBIT_RETRY_TEST_SERIAL=1 runs every
# stage after the other. Every stage prints its time, and the run ends with all of them;
# RABBIT_RETRY_TEST_DURATIONS=0 lists every test's time (default: the 10 slowest per run).
#
#   ./scripts/test.sh                        the matrix above
#   ./scripts/test.sh --broker 4.3 [ARGS]    one version (every broker test); ARGS go to pytest
#                                            (e.g. -k apply -x, or test paths: run as named)
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

# Bytecode is written (a machine may say PYTHONDONTWRITEBYTECODE=1): pytest rewrites the asserts
# of every test module it collects and keeps the result beside it only then; without, each of
# the run's 20 or so pytest processes spent 3 of its 6 s collecting on rewriting them again.
unset PYTHONDONTWRITEBYTECODE
# A hung test fails alone after pyproject's per-test timeout; this bounds a whole pytest run
# (45 minutes: on a slow day of the 2-core machine, 2026-11-29, the 3.10 stage took 1,428 s,
# close to the 30 minutes it was bounded by, with no test hung).
PYTEST_TIMEOUT="${RABBIT_RETRY_PYTEST_TIMEOUT:-2700}"
# Broker tests at a time in the first version's stage (alone on the machine): they mostly wait
# on the broker, so more than the cores; and in each of the older versions' stages, which run
# side by side with each other and with the cluster's (whose tests run one at a time).
WORKERS="${RABBIT_RETRY_TEST_WORKERS:-5}"
WORKERS_BESIDE="${RABBIT_RETRY_TEST_WORKERS_BESIDE:-2}"
START=$SECONDS
FAILED=()
TIMES=()

# took LABEL SINCE: prints and keeps how long the stage LABEL took (since $SECONDS was SINCE).
took() {
    local seconds=$((SECONDS - $2))
    note "$1 took ${seconds}s"
    TIMES+=("$(printf '%5ds  %s' "$seconds" "$1")")
}

finish() {
    local took=$((SECONDS - START))
    rm -f ${PREPARED_LOGS[@]+"${PREPARED_LOGS[@]}"}
    stage "stage times"
    printf '    %s\n' "${TIMES[@]}"
    if [ "${#FAILED[@]}" -eq 0 ]; then
        stage "PASSED in ${took}s: ruff, mypy --strict, $label"
        exit 0
    fi
    stage "FAILED in ${took}s: ${FAILED[*]}"
    exit 1
}

began=$SECONDS
stage "python environment"
ensure_venv
note "pip install -e '.[test,bench]' (the bench extra: the suite runs a smoke of the benchmarks)"
pip_quiet install -e '.[test,bench]'
export PATH="$VENV/bin:$PATH"

stage "promtool (the alert rules' tests)"
ensure_promtool
took "python environment, promtool" "$began"

# Every test module imports, checked before any broker starts: one that does not stops every
# stage's pytest at collection (on 2026-11-29 a rename left a test importing the old name, and
# the run took 27 minutes to fail with no broker test run). The whole matrix only; about 15 s,
# and the asserts it rewrites are kept for the stages.
if [ $# -eq 0 ]; then
    began=$SECONDS
    stage "every test module imports (pytest --collect-only)"
    if ! collected=$(timeout 600 pytest --collect-only -q -p no:cacheprovider tests </dev/null 2>&1); then
        printf '%s\n' "$collected" | grep -E '^(ERROR|E) ' | head -20
        die "a test module does not import (above); nothing else was run"
    fi
    took "collecting every test" "$began"
fi

# ruff and mypy --strict: their failures are reported with the rest.
static_checks() {
    local began=$SECONDS
    stage "ruff check rabbit_retry tests bench"
    timeout 600 ruff check --output-format=concise rabbit_retry tests bench </dev/null || FAILED+=(ruff)
    stage "mypy --strict rabbit_retry"
    timeout 900 mypy --strict rabbit_retry </dev/null || FAILED+=(mypy)
    took "ruff, mypy --strict" "$began"
}

# apart NAME FUNCTION ARGS...: runs FUNCTION in the background, its output kept aside and shown
# whole when `gather` collects it, so stages that run side by side do not mix their lines. Its
# failures, test counts and stage times join this run's.
APART=()
apart() {
    local name="$1" dir
    shift
    dir="$(mktemp -d "${TMPDIR:-/tmp}/rabbit-retry-stage.XXXXXX")"
    (
        trap - EXIT INT TERM
        FAILED=() TIMES=() PASSED=0 FAILED_TESTS=0 FAILED_NAMES=()
        "$@" >"$dir/log" 2>&1 </dev/null
        printf '%s\n' ${FAILED[@]+"${FAILED[@]}"} >"$dir/failed"
        printf '%s\n' ${FAILED_NAMES[@]+"${FAILED_NAMES[@]}"} >"$dir/failed-tests"
        printf '%s\n' ${TIMES[@]+"${TIMES[@]}"} >"$dir/times"
        echo "$PASSED $FAILED_TESTS" >"$dir/counts"
    ) &
    APART+=("$!|$dir|$name")
    note "$name: running beside the next stages (its output follows when it ends)"
}

# tree PID: PID and every process below it (`timeout` puts the command it runs in a process
# group of its own, so a signal to the stage's group would miss them).
tree() {
    local child
    echo "$1"
    for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do tree "$child"; done
}

# stop_apart: ends the stages still running beside (the script is leaving early).
stop_apart() {
    local job pid dir name
    for job in ${APART[@]+"${APART[@]}"}; do
        IFS='|' read -r pid dir name <<<"$job"
        # shellcheck disable=SC2046
        kill -TERM $(tree "$pid") 2>/dev/null || true
        rm -rf "$dir"
        note "stopped $name"
    done
    APART=()
}

# append_lines ARRAY FILE: each line of FILE that is not empty, added to the array named ARRAY.
append_lines() {
    local -n into="$1"
    local line
    while IFS= read -r line; do [ -z "$line" ] || into+=("$line"); done <"$2"
}

# gather: waits for every stage started by `apart`, shows its output and counts its results.
gather() {
    local job pid dir name passed failed
    for job in ${APART[@]+"${APART[@]}"}; do
        IFS='|' read -r pid dir name <<<"$job"
        wait "$pid" || true
        stage "$name (ran beside the others): its output"
        cat "$dir/log"
        if [ -f "$dir/counts" ]; then
            read -r passed failed <"$dir/counts"
            PASSED=$((PASSED + passed))
            FAILED_TESTS=$((FAILED_TESTS + failed))
            append_lines FAILED "$dir/failed"
            append_lines TIMES "$dir/times"
            append_lines FAILED_NAMES "$dir/failed-tests"
        else
            FAILED+=("$name (stopped before it finished)")
        fi
        rm -rf "$dir"
    done
    APART=()
}

# The desk from the installed wheel: its migrations run on a new SQLite store and its page and
# API answer (the broker need not answer for that).
desk_smoke() {
    local tmp="$1" port="" pid rc=0
    # Port 0: the system picks a free one when the desk binds, and the desk prints it.
    "$tmp/venv/bin/rabbit-retry" desk "$ROOT/topologies/demo.yml" --store "sqlite:///$tmp/desk.db" \
        --listen "127.0.0.1:0" >"$tmp/desk.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 100); do
        port="$(sed -n 's|^rabbit-retry desk: open http://127\.0\.0\.1:\([0-9]*\)/.*|\1|p' "$tmp/desk.log")"
        [ -n "$port" ] && break
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

wheel_stage() {
    local began=$SECONDS
    stage "wheel: build it, install it in a fresh venv, smoke it"
    wheel_smoke || FAILED+=(wheel)
    took "wheel smoke" "$began"
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

# In CI each test's name is printed as it ends (with the xdist worker that ran it); a hung test
# is named by pytest-timeout's report after pyproject's per-test timeout. At a terminal, dots.
verbosity=-q
case "${CI:-}" in
    "" | 0 | false) ;;
    *) verbosity=-v ;;
esac

PASSED=0
FAILED_TESTS=0
# Each failed test's line from pytest's summary, with its stage: shown again at the very end, so
# the last lines of a long run name what failed.
FAILED_NAMES=()
# pytest_run LABEL TARGET... -- ARGS: one pytest run, its counts added to the totals and its
# exit code left in PYTEST_RC (5: it collected no tests; the caller judges whether that may be).
pytest_run() {
    local label="$1" log line n
    shift
    local run_targets=()
    while [ "$1" != -- ]; do run_targets+=("$1") && shift; done
    shift
    stage "$label"
    log="$(mktemp "${TMPDIR:-/tmp}/rabbit-retry-pytest.XXXXXX")"
    # SIGINT first, so a timed-out pytest still tears down (deleting its vhosts) and reports.
    # pytest's own exit code, through the pipe to tee (PIPESTATUS would be lost to `|| true`).
    { timeout --signal=INT --kill-after=60 "$PYTEST_TIMEOUT" \
        pytest ${run_targets[@]+"${run_targets[@]}"} "$verbosity" -ra \
        --durations="${RABBIT_RETRY_TEST_DURATIONS:-10}" \
        -p no:cacheprovider "$@" </dev/null 2>&1 && echo 0 >"$log.rc" || echo $? >"$log.rc"; } |
        tee "$log"
    PYTEST_RC="$(cat "$log.rc")"
    rm -f "$log.rc"
    line="$(grep -E '(passed|failed|error|no tests ran).* in [0-9.]+s' "$log" | tail -n 1 || true)"
    for n in $(grep -oE '[0-9]+ passed' <<<"$line" | grep -oE '[0-9]+' || true); do
        PASSED=$((PASSED + n))
    done
    for n in $(grep -oE '[0-9]+ (failed|errors?)' <<<"$line" | grep -oE '[0-9]+' || true); do
        FAILED_TESTS=$((FAILED_TESTS + n))
    done
    while IFS= read -r line; do
        FAILED_NAMES+=("$label: ${line:0:300}")
    done < <(grep -E '^(FAILED|ERROR) ' "$log" || true)
    rm -f "$log"
    case "$PYTEST_RC" in
        0 | 5) ;;
        124) note "$label was stopped after ${PYTEST_TIMEOUT}s (RABBIT_RETRY_PYTEST_TIMEOUT)" ;;
    esac
}

# judge LABEL RC: a failed pytest run (or one that collected nothing) fails the stage LABEL.
judge() {
    case "$2" in
        0) ;;
        5)
            note "$1 collected no tests (pytest exit 5): the suite must run tests"
            FAILED+=("$1 (no tests collected)")
            ;;
        124) FAILED+=("$1 (timed out)") ;;
        *) FAILED+=("$1 (exit $2)") ;;
    esac
}

# run_pytest LABEL TARGET... -- ARGS: one pytest run that must collect tests and pass.
run_pytest() {
    local began=$SECONDS
    pytest_run "$@"
    judge "$1" "$PYTEST_RC"
    took "$1" "$began"
}

# broker_stage LABEL SELECT TARGET... -- ARGS: the tests SELECTed (a -m expression) against the
# broker of the environment: in parallel, then those marked `alone` one at a time. Together they
# must collect tests; either failing fails the stage. The parallel run takes the tests in
# tests/conftest.py's order, the slowest first (--no-loadscope-reorder keeps that order;
# loadgroup keeps an xdist_group's tests on one worker). STAGE_PART=parallel or alone runs one
# of the two parts (the first version's `alone` tests run beside the older versions' stages).
broker_stage() {
    local label="$1" select="$2" began=$SECONDS parallel_rc=5 alone_rc=5 part="${STAGE_PART:-both}"
    local workers="${STAGE_WORKERS:-$WORKERS}"
    shift 2
    local run_targets=()
    while [ "$1" != -- ]; do run_targets+=("$1") && shift; done
    shift
    if [ "$part" != alone ]; then
        pytest_run "$label: in parallel" ${run_targets[@]+"${run_targets[@]}"} -- \
            -m "($select) and not alone" -n "$workers" --dist loadgroup --no-loadscope-reorder "$@"
        parallel_rc=$PYTEST_RC
    fi
    if [ "$part" != parallel ]; then
        pytest_run "$label: the tests that need the broker alone" \
            ${run_targets[@]+"${run_targets[@]}"} -- -m "($select) and alone" "$@"
        alone_rc=$PYTEST_RC
    fi
    case "$part" in
        parallel) judge "$label" "$parallel_rc" ;;
        alone) [ "$alone_rc" = 5 ] || judge "$label (alone)" "$alone_rc" ;;
        *)
            if [ "$parallel_rc" = 5 ] && [ "$alone_rc" = 5 ]; then
                judge "$label" 5
            else
                [ "$parallel_rc" = 5 ] || judge "$label" "$parallel_rc"
                [ "$alone_rc" = 5 ] || judge "$label (alone)" "$alone_rc"
            fi
            ;;
    esac
    case "$part" in
        parallel) took "$label (in parallel)" "$began" ;;
        alone) took "$label (the tests that need the broker alone)" "$began" ;;
        *) took "$label" "$began" ;;
    esac
}

# What a version stage selects: every broker test on the first version of the run, the
# version-dependent ones on the others; test paths given on the command line run as named.
version_select() {
    if [ "${targets[*]-}" = "-" ]; then
        echo "not needs_cluster"
    elif [ "$1" = first ]; then
        echo "integration and not needs_cluster"
    else
        echo "integration and not needs_cluster and not any_version"
    fi
}

only_cluster=""
[ "${BROKERS[*]-}" != cluster ] || only_cluster=1
# Stages one after the other, nothing beside them (slower; for a machine that cannot bear more).
serial=""
case "${RABBIT_RETRY_TEST_SERIAL:-}" in "" | 0 | false) ;; *) serial=1 ;; esac

# The cluster tests need every node, and a stage that started the cluster stops it again,
# however the script ends (a failure, CI's timeout): three nodes left running would hold ports
# and memory on the next run's machine.
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
trap 'stop_apart; stop_cluster' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ruff, mypy and the wheel run beside the first test stages; in `tests/unit` mode, before them.
if [ -n "$only_unit" ] || [ -n "$only_cluster" ] || [ -n "$serial" ]; then
    static_checks
    [ -n "$only_unit" ] || [ -n "$only_cluster" ] || wheel_stage
else
    apart "ruff, mypy --strict and the wheel" eval 'static_checks; wheel_stage'
fi

# Nodes started ahead of their stage, in the background (a chroot built first where it is
# missing: about a minute on a fresh machine): VERSION -> "pid log". A stage waits for its own.
declare -A PREPARED=()
PREPARED_LOGS=()
# prepare_broker VERSION...: starts them one after the other, beside whatever runs now. Only
# chroots' nodes, and only with debootstrap at hand: installing it (apt-get) could meet the lock
# of another install.
prepare_broker() {
    local version ready=()
    command -v debootstrap >/dev/null 2>&1 || return 0
    for version in "$@"; do
        [ "$version" = 3.10 ] || [ -n "${PREPARED[$version]:-}" ] || ready+=("$version")
    done
    [ "${#ready[@]}" -gt 0 ] || return 0
    local log
    log="$(mktemp "${TMPDIR:-/tmp}/rabbit-retry-broker.XXXXXX")"
    (
        for version in "${ready[@]}"; do "$ROOT/scripts/broker.sh" up "$version" || true; done
    ) </dev/null >"$log" 2>&1 &
    for version in "${ready[@]}"; do PREPARED[$version]="$! $log"; done
    PREPARED_LOGS+=("$log")
    note "broker ${ready[*]}: starting beside the next steps"
}

# prepared VERSION: waits until a node prepare_broker started is up (or failed: the stage's own
# `up` says why), and shows what it printed.
prepared() {
    local pid log
    [ -n "${PREPARED[$1]:-}" ] || return 0
    read -r pid log <<<"${PREPARED[$1]}"
    # Not always this shell's child (a stage run beside the others is a subshell): watched.
    while kill -0 "$pid" 2>/dev/null; do sleep 1; done
    [ ! -f "$log" ] || grep -F "broker $1:" "$log" >&2 || true
    PREPARED[$1]=""
}

# The first version's node starts while the stores, Node.js and chromium are installed.
first_version=4.3
for version in ${BROKERS[@]+"${BROKERS[@]}"}; do
    [ "$version" = cluster ] || { first_version="$version" && break; }
done
if [ -z "$only_unit" ] && [ -z "$only_cluster" ] && [ -z "${RABBIT_RETRY_TEST_URL:-}" ]; then
    prepare_broker "$first_version"
fi

if [ -z "$only_unit" ]; then
    began=$SECONDS
    stage "idempotency stores: PostgreSQL and Redis"
    ensure_stores
    if [ -z "$only_cluster" ]; then
        stage "Node.js and amqplib (the header type tests' second foreign publisher)"
        ensure_amqplib
        stage "chromium and chromedriver (the failure desk page's browser tests)"
        ensure_chromium
    fi
    took "PostgreSQL, Redis, amqplib, chromium" "$began"
fi


# The tests marked cluster or needs_cluster (tests/conftest.py), one at a time: some of them kill
# a node of the cluster.
cluster_running() {
    "$ROOT/scripts/cluster.sh" status 2>/dev/null | grep -q '^running members: .* .* '
}

# The caller notes first whether this run starts the cluster (started_cluster), so that the
# EXIT trap stops it whether this stage ran in this shell or beside it.
cluster_stage() {
    local began=$SECONDS
    stage "cluster of three RabbitMQ 4.3 nodes"
    if timeout --kill-after=30 "$CLUSTER_UP_TIMEOUT" "$ROOT/scripts/cluster.sh" up </dev/null; then
        note "cluster up after $((SECONDS - began))s"
        # The last stage: the cluster's variables replace the single node's from here on.
        eval "$("$ROOT/scripts/cluster.sh" env)"
        pytest_run "pytest on a 3-node RabbitMQ 4.3 cluster" tests -- \
            -m "cluster or needs_cluster" "$@"
        judge "pytest on a 3-node RabbitMQ 4.3 cluster" "$PYTEST_RC"
    else
        FAILED+=("cluster (did not start within ${CLUSTER_UP_TIMEOUT}s)")
    fi
    stop_cluster
    took "cluster stage (3 nodes up, tests, down)" "$began"
}

# The unit tests, once: CPU-bound, so one at a time per core.
unit_stage() {
    run_pytest "unit tests (no broker)" tests -- -m unit -n auto "$@"
}

# version_stage VERSION FIRST ARGS: the broker VERSION started (if it is not running) and the
# tests of version_select run against it.
version_stage() {
    local version="$1" first="$2"
    shift 2
    stage "broker $version"
    prepared "$version"
    if ! "$ROOT/scripts/broker.sh" up "$version" </dev/null; then
        FAILED+=("broker $version (did not start)")
        return 0
    fi
    eval "$("$ROOT/scripts/broker.sh" env "$version")"
    if [ "${targets[*]-}" = "-" ]; then
        broker_stage "pytest on RabbitMQ $version: $*" "$(version_select "$first")" -- "$@"
    else
        broker_stage "pytest on RabbitMQ $version" "$(version_select "$first")" tests -- "$@"
    fi
}

# alone_stage VERSION: the first version's `alone` tests (its other tests ran already).
alone_stage() {
    STAGE_PART=alone version_stage "$1" first
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
    if [ "${targets[*]-}" = "-" ]; then
        broker_stage "pytest $*" "$(version_select first)" -- "$@"
    else
        unit_stage "$@"
        broker_stage "pytest on $RABBIT_RETRY_TEST_URL" "$(version_select first)" tests -- "$@"
    fi
elif [ -n "$only_cluster" ]; then
    [ "${targets[*]-}" != "-" ] || die "--broker cluster runs the cluster tests; name no paths"
    label="tests on a 3-node 4.3 cluster"
    cluster_running || started_cluster=1
    cluster_stage "$@"
else
    [ "${#BROKERS[@]}" -gt 0 ] || BROKERS=(4.3 3.10 4.0)
    versions=()
    for version in "${BROKERS[@]}"; do
        [ "$version" = cluster ] || versions+=("$version")
    done
    label="tests on RabbitMQ ${versions[*]}"
    # The cluster tests, on three 4.3 nodes (scripts/cluster.sh), when 4.3 is in the matrix and
    # no test paths were named; label says so. A cluster this run started is stopped again.
    with_cluster=""
    if [[ " ${BROKERS[*]} " == *" 4.3 "* || " ${BROKERS[*]} " == *" cluster "* ]] &&
        [ "${targets[*]-}" != "-" ]; then
        with_cluster=1
        label="$label and a 3-node 4.3 cluster"
    fi
    # In the whole matrix the stages after the first version's overlap: its `alone` tests
    # (broker restarts, mostly waiting) run beside the older versions' stages and the cluster's
    # (their nodes are their own), and the unit tests after the cluster's, when the older
    # versions' tests mostly wait (measured: the two cores 10-50% busy then). Otherwise the
    # unit tests run first, and each version's tests in one stage.
    split=""
    if [ $# -eq 0 ] && [ -z "$serial" ] && [ "${#versions[@]}" -gt 1 ] && [ -n "$with_cluster" ]; then
        split=1
    fi
    [ -n "$split" ] || [ "${targets[*]-}" = "-" ] || unit_stage "$@"
    # The first version gets every broker test, alone on the machine but for the checks beside
    # (and, in the whole matrix, the other versions' nodes starting).
    if [ -n "$split" ]; then
        prepared "${versions[0]}"  # one chroot built at a time
        prepare_broker "${versions[@]:1}"
        STAGE_PART=parallel version_stage "${versions[0]}" first
    else
        version_stage "${versions[0]}" first "$@"
    fi
    gather
    [ -z "$with_cluster" ] || cluster_running || started_cluster=1
    # The others (the version-dependent tests only) and the cluster side by side: their own
    # nodes and ports. (All stages at once was tried: on 2 cores the load reached 15-19 and
    # tests with bounded waits failed.)
    if [ -n "$serial" ]; then
        for version in "${versions[@]:1}"; do version_stage "$version" "" "$@"; done
        [ -z "$with_cluster" ] || cluster_stage "$@"
    else
        [ -z "$split" ] ||
            apart "RabbitMQ ${versions[0]}: the tests that need the broker alone" alone_stage "${versions[0]}"
        for version in "${versions[@]:1}"; do
            STAGE_WORKERS=$WORKERS_BESIDE apart "RabbitMQ $version" version_stage "$version" "" "$@"
        done
        if [ -n "$split" ]; then
            apart "the cluster, then the unit tests" eval 'cluster_stage; unit_stage'
        elif [ -n "$with_cluster" ]; then
            apart "the cluster" cluster_stage "$@"
        fi
        gather
        # Stopped by its stage already, unless that stage was stopped early.
        [ -z "$with_cluster" ] || cluster_running || started_cluster=""
    fi
fi

gather
printf 'total: %d passed, %d failed\n' "$PASSED" "$FAILED_TESTS"
[ "${#FAILED_NAMES[@]}" -eq 0 ] || printf '  %s\n' "${FAILED_NAMES[@]}"
finish
