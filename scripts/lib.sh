# shellcheck shell=bash
# Shared helpers for scripts/*.sh and .ci/run: stage logging and the project's virtualenv.
# Sourced, never run. Callers set `set -euo pipefail` and ROOT (the repository root).

# Never wait for a human: CI has no terminal, and pip must not ask for anything either.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

VENV="${VENV:-$ROOT/.venv}"

# macOS has no `timeout` unless coreutils is installed (as gtimeout): run unbounded there rather
# than not at all. The shim drops the --options and the duration.
if ! command -v timeout >/dev/null 2>&1; then
    if command -v gtimeout >/dev/null 2>&1; then
        timeout() { gtimeout "$@"; }
    else
        timeout() {
            while [[ "${1:-}" == -* ]]; do shift; done
            shift
            "$@"
        }
    fi
fi

stage() { printf '[%s] == %s\n' "$(date +%H:%M:%S)" "$*"; }
note() { printf '[%s]    %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[%s] !! %s\n' "$(date +%H:%M:%S)" "$*" >&2; exit 1; }

# The first Python >= 3.11 on PATH ($PYTHON wins when set).
find_python() {
    local candidate
    for candidate in ${PYTHON:-} python3 python3.13 python3.12 python3.11; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

# Runs pip quietly: its output goes to a log that is shown only when pip fails. This also hides
# harmless noise such as "WARNING: Location 'file:///...' is ignored" from extra local indexes.
pip_quiet() {
    local log rc=0
    log="$(mktemp "${TMPDIR:-/tmp}/rabbit-retry-pip.XXXXXX")"
    timeout 900 "$VENV/bin/python" -m pip "$@" </dev/null >"$log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        grep -v "^WARNING: Location 'file:" "$log" | tail -n 40 >&2 || true
        rm -f "$log"
        [ "$rc" -eq 124 ] && die "pip $1 timed out after 900 s"
        die "pip $1 failed (exit $rc); its output is above"
    fi
    rm -f "$log"
}

# Creates $VENV when it is missing or broken, with an up-to-date pip.
ensure_venv() {
    if "$VENV/bin/python" -c '' >/dev/null 2>&1; then
        note "using $VENV ($("$VENV/bin/python" -V 2>&1))"
        return 0
    fi
    local python
    python="$(find_python)" || die "need Python >= 3.11 (python3 on PATH is $(python3 -V 2>&1 || echo missing)); set PYTHON=/path/to/python3.11"
    note "creating $VENV with $("$python" -V 2>&1)"
    "$python" -m venv --clear "$VENV" || die "could not create $VENV (on Debian/Ubuntu: apt-get install python3-venv)"
    pip_quiet install --upgrade pip
}

# apt-get install PACKAGES..., quietly, updating the index once if a package is not found.
apt_install() {
    command -v apt-get >/dev/null 2>&1 || die "need $* (no apt-get here: install them by hand)"
    note "apt-get install $*"
    if ! DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -q "$@" </dev/null >/dev/null 2>&1; then
        timeout 900 apt-get update -q </dev/null >/dev/null 2>&1 || true
        DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -q "$@" </dev/null >/dev/null ||
            die "apt-get install $* failed"
    fi
}

# The idempotency stores' servers the tests use: PostgreSQL and Redis on this machine, started
# (installed first if missing). Exports RABBIT_RETRY_TEST_POSTGRES_URL / _REDIS_URL.
ensure_stores() {
    local pg="${RABBIT_RETRY_TEST_POSTGRES_URL:-postgresql://postgres@127.0.0.1:5432/test}"
    local redis="${RABBIT_RETRY_TEST_REDIS_URL:-redis://127.0.0.1:6379/0}"
    command -v psql >/dev/null 2>&1 || apt_install postgresql postgresql-client
    if ! psql "$pg" -Atc 'select 1' </dev/null >/dev/null 2>&1; then
        local version
        version="$(ls /etc/postgresql 2>/dev/null | sort -V | tail -n 1)"
        [ -n "$version" ] || die "PostgreSQL is installed but has no cluster in /etc/postgresql"
        note "starting PostgreSQL $version"
        pg_ctlcluster --skip-systemctl-redirect "$version" main start </dev/null >/dev/null 2>&1 || true
        local i
        for i in $(seq 1 30); do
            pg_isready -q -h 127.0.0.1 -p 5432 && break
            sleep 1
        done
        if ! psql "$pg" -Atc 'select 1' </dev/null >/dev/null 2>&1 &&
            [ -z "${RABBIT_RETRY_TEST_POSTGRES_URL:-}" ]; then
            # A fresh Debian cluster asks for a password over TCP: give postgres one, and a
            # database for the tests.
            note "PostgreSQL: a password for postgres and a database 'test' for the tests"
            su postgres -c "psql -q -c \"ALTER ROLE postgres PASSWORD 'rabbit-retry'\"" </dev/null >/dev/null
            su postgres -c "createdb test" </dev/null >/dev/null 2>&1 || true
            pg="postgresql://postgres:rabbit-retry@127.0.0.1:5432/test"
        fi
        psql "$pg" -Atc 'select 1' </dev/null >/dev/null 2>&1 || die "PostgreSQL at ${pg%%@*}@... does not answer"
    fi
    command -v redis-server >/dev/null 2>&1 || apt_install redis-server
    if ! redis-cli -u "$redis" ping </dev/null >/dev/null 2>&1; then
        note "starting Redis"
        mkdir -p /var/lib/redis /var/log/redis
        redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
            --dir /var/lib/redis --logfile /var/log/redis/ci.log </dev/null >/dev/null
        local j
        for j in $(seq 1 30); do
            redis-cli -u "$redis" ping </dev/null >/dev/null 2>&1 && break
            sleep 1
        done
        redis-cli -u "$redis" ping </dev/null >/dev/null 2>&1 || die "Redis at $redis does not answer"
    fi
    export RABBIT_RETRY_TEST_POSTGRES_URL="$pg" RABBIT_RETRY_TEST_REDIS_URL="$redis"
    note "stores: PostgreSQL and Redis answer"
}

# promtool (Debian's `prometheus` package) checks and unit-tests the alert rules that
# `export --format alerts` writes. Without it those tests fail in CI and skip elsewhere.
ensure_promtool() {
    if command -v promtool >/dev/null 2>&1; then
        note "using $(promtool --version 2>&1 | head -n 1)"
        return 0
    fi
    apt_optional promtool prometheus || return 0
    command -v promtool >/dev/null 2>&1 || { note "promtool still missing: its tests skip (fail with CI=true)"; return 0; }
    note "installed $(promtool --version 2>&1 | head -n 1)"
}

# Node.js and its amqplib client: a publisher rabbit-retry did not write, for the header type
# tests (tests/integration/test_header_types.py). amqplib goes into a cache outside the
# repository (npm, pinned); exports RABBIT_RETRY_NODE_MODULES. Without Node those tests fail in
# CI and skip elsewhere.
AMQPLIB_VERSION=2.3.1
ensure_amqplib() {
    local cache="${RABBIT_RETRY_NODE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rabbit-retry/node}"
    if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
        apt_optional "Node.js and npm" nodejs npm || return 0
    fi
    export RABBIT_RETRY_NODE_MODULES="$cache/node_modules"
    if ! grep -qs "\"version\": \"$AMQPLIB_VERSION\"" "$cache/node_modules/amqplib/package.json"; then
        mkdir -p "$cache"
        timeout 300 npm install --prefix "$cache" --no-audit --no-fund --silent \
            "amqplib@$AMQPLIB_VERSION" </dev/null >/dev/null 2>&1 ||
            { note "npm install amqplib failed: its tests skip (fail with CI=true)"; return 0; }
    fi
    note "using Node $(node --version), amqplib $AMQPLIB_VERSION in $cache"
}

# Headless Chromium and its WebDriver (Debian's `chromium` and `chromium-driver`) for the failure
# desk's browser tests (tests/browser, Selenium). Nothing downloads a browser build of its own:
# the distribution's packages are the browser. Without them those tests fail in CI and skip
# elsewhere.
ensure_chromium() {
    local browser
    browser="$(command -v chromium || command -v chromium-browser || true)"
    if [ -z "$browser" ] || ! command -v chromedriver >/dev/null 2>&1; then
        apt_optional "chromium and chromedriver" chromium chromium-driver || return 0
        browser="$(command -v chromium || command -v chromium-browser || true)"
        if [ -z "$browser" ] || ! command -v chromedriver >/dev/null 2>&1; then
            note "chromium or chromedriver still missing: the browser tests skip (fail with CI=true)"
            return 0
        fi
    fi
    note "using $("$browser" --version 2>/dev/null | head -n 1), $(chromedriver --version 2>/dev/null | cut -d' ' -f1-2)"
}

# apt_optional WHAT PACKAGES...: installs PACKAGES for tests that need WHAT, when apt-get can (as
# root, or with sudo that asks no password); the package lists are refreshed only when an install
# without that fails. Never stops the run: returns 1, saying why, when nothing was installed.
apt_optional() {
    local what="$1" as_root=""
    shift
    if ! command -v apt-get >/dev/null 2>&1; then
        note "$what missing and no apt-get: install $*; their tests skip (fail with CI=true)"
        return 1
    fi
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            as_root="sudo -n"
        else
            note "$what missing and apt-get needs root: their tests skip (fail with CI=true)"
            return 1
        fi
    fi
    note "installing $what (apt-get install $*)"
    local log rc=0
    log="$(mktemp "${TMPDIR:-/tmp}/rabbit-retry-apt.XXXXXX")"
    apt_no_recommends "$*" $as_root >"$log" 2>&1 ||
        { timeout 600 $as_root apt-get update -qq </dev/null >>"$log" 2>&1 &&
            apt_no_recommends "$*" $as_root >>"$log" 2>&1; } ||
        rc=$?
    if [ "$rc" -ne 0 ]; then
        tail -n 20 "$log" >&2 || true
        rm -f "$log"
        note "could not install $what (exit $rc); their tests skip (fail with CI=true)"
        return 1
    fi
    rm -f "$log"
}

# apt_no_recommends "PACKAGES" [sudo -n]: installs quietly, without recommends, never asking.
apt_no_recommends() {
    local packages="$1"
    shift
    # `env` inside sudo: sudo drops the caller's environment.
    # shellcheck disable=SC2086
    timeout 900 "$@" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends $packages </dev/null
}
