#!/usr/bin/env bash
# Makes sure a RabbitMQ broker with its management plugin answers where rabbit-retry will look:
# RABBIT_RETRY_URL (default amqp://guest:guest@localhost:5672/) and RABBIT_RETRY_MANAGEMENT_URL
# (default http://guest:guest@localhost:15672).
#
#   1. both answer already: done;
#   2. a remote broker is configured: only report whether it answers;
#   3. the rabbitmq-server package is installed: start the node, enable rabbitmq_management;
#   4. a Docker engine runs: `docker compose up -d --wait` with the repository's docker-compose.yml;
#   5. otherwise: one line on how to get a broker, exit 1.
#
# Idempotent, never prompts, every wait bounded (RABBIT_RETRY_BROKER_TIMEOUT seconds, default
# 120). On success it prints one line; while starting a broker, one more.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"
AMQP_URL="${RABBIT_RETRY_URL:-amqp://guest:guest@localhost:5672/}"
MGMT_URL="${RABBIT_RETRY_MANAGEMENT_URL:-http://guest:guest@localhost:15672}"
MGMT_URL="${MGMT_URL%/}"
TIMEOUT="${RABBIT_RETRY_BROKER_TIMEOUT:-120}"

say() { printf 'broker: %s\n' "$*"; }
fail() { printf 'broker: error: %s\n' "$*" >&2; exit 1; }
mask() { sed -E 's#(://[^:/@]*):[^@/]*@#\1:***@#g' <<<"$1"; }

SAFE_AMQP="$(mask "$AMQP_URL")"
SAFE_MGMT="$(mask "$MGMT_URL")"

# host and port of a URL; bracketed IPv6 literals and missing ports handled.
host_port() {
    local url="$1" default_port="$2" authority host port
    authority="${url#*://}"
    authority="${authority%%/*}"
    authority="${authority##*@}"
    if [[ "$authority" == \[* ]]; then
        host="${authority%%]*}"
        host="${host#[}"
        port="${authority#*]}"
        port="${port#:}"
    elif [[ "$authority" == *:* ]]; then
        host="${authority%%:*}"
        port="${authority##*:}"
    else
        host="$authority"
        port=""
    fi
    printf '%s %s\n' "${host:-localhost}" "${port:-$default_port}"
}

case "$AMQP_URL" in
    amqps://*) AMQP_DEFAULT_PORT=5671 ;;
    amqp://*) AMQP_DEFAULT_PORT=5672 ;;
    *) fail "RABBIT_RETRY_URL must be an amqp:// or amqps:// URL, got $SAFE_AMQP" ;;
esac
read -r AMQP_HOST AMQP_PORT < <(host_port "$AMQP_URL" "$AMQP_DEFAULT_PORT")
read -r MGMT_HOST _ < <(host_port "$MGMT_URL" 15672)
# Probe the loopback address itself: "localhost" may resolve to ::1 first, where the Debian
# package's node (listeners.tcp.local = 127.0.0.1:5672) does not listen.
[ "$AMQP_HOST" = localhost ] && AMQP_HOST=127.0.0.1

is_local() {
    local host
    for host in "$AMQP_HOST" "$MGMT_HOST"; do
        case "$host" in
            localhost | 127.* | ::1) ;;
            *) return 1 ;;
        esac
    done
}

amqp_open() { timeout 3 bash -c ">/dev/tcp/$AMQP_HOST/$AMQP_PORT" 2>/dev/null; }

OVERVIEW=""
MGMT_ERROR=""
management_ok() {
    local out
    if out="$(curl -fsS --max-time 5 "$MGMT_URL/api/overview" 2>&1)"; then
        OVERVIEW="$out"
        return 0
    fi
    MGMT_ERROR="$(mask "$out" | tail -n 1)"
    # Waiting cannot fix refused credentials: say so at once.
    case "$MGMT_ERROR" in
        *" 401"*) fail "the management API at $SAFE_MGMT refuses its credentials (HTTP 401); fix the user and password in RABBIT_RETRY_MANAGEMENT_URL" ;;
    esac
    return 1
}

ready() { amqp_open && management_ok; }

# Polls until both ports answer, at most $1 seconds.
wait_ready() {
    local deadline=$((SECONDS + $1))
    until ready; do
        [ "$SECONDS" -ge "$deadline" ] && return 1
        sleep 2
    done
}

version() {
    local v
    v="$(grep -o '"rabbitmq_version":"[^"]*"' <<<"$OVERVIEW" | head -n 1 | cut -d'"' -f4)"
    printf '%s' "${v:-(version unknown)}"
}

done_line() { say "RabbitMQ $(version) ready at $SAFE_AMQP, management $SAFE_MGMT ($1)"; exit 0; }

if ready; then
    done_line "already running"
fi

if ! is_local; then
    if amqp_open; then
        fail "management API $SAFE_MGMT/api/overview does not answer ($MGMT_ERROR); enable the rabbitmq_management plugin on that broker or fix RABBIT_RETRY_MANAGEMENT_URL"
    fi
    fail "no broker answers at $SAFE_AMQP (TCP $AMQP_HOST:$AMQP_PORT closed); start it or fix RABBIT_RETRY_URL"
fi

# --- a locally installed rabbitmq-server (Debian/Ubuntu package, or a generic-unix install) ----

RMQ_SERVER="$(command -v rabbitmq-server || { [ -x /usr/sbin/rabbitmq-server ] && echo /usr/sbin/rabbitmq-server; } || true)"
SUDO=()
local_possible() {
    [ -n "$RMQ_SERVER" ] || return 1
    # The package's wrappers only run as root (they switch to the rabbitmq user) or as rabbitmq.
    if [ "$(id -u)" -eq 0 ] || [ "$(id -un)" = rabbitmq ]; then
        return 0
    fi
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
        return 0
    fi
    return 1
}

rmq() {
    # rabbitmq-server, rabbitmqctl and rabbitmq-plugins live next to each other.
    local tool="$1"
    shift
    timeout 60 ${SUDO[@]+"${SUDO[@]}"} "$(dirname "$RMQ_SERVER")/$tool" "$@" </dev/null
}

# The open-file limit of the running local node (0 when unknown). A node the machine started
# through Debian's su wrapper has 1024, which parallel tests exhaust (4.x: connections; 3.x:
# also three per quorum queue): as root, such a node is restarted with the hard limit.
node_file_limit() {
    local pid
    pid="$(pgrep -u rabbitmq -f 'beam.*-s rabbit' 2>/dev/null | head -n 1 || true)"
    [ -n "$pid" ] || pid="$(pgrep -f 'beam.*rabbit@' 2>/dev/null | head -n 1 || true)"
    [ -n "$pid" ] && awk '/Max open files/ {print $4}' "/proc/$pid/limits" 2>/dev/null || echo 0
}

start_local() {
    local log started=""
    log="$(mktemp "${TMPDIR:-/tmp}/rabbit-retry-broker.XXXXXX")"
    if [ "$(id -u)" = 0 ] && rmq rabbitmqctl -q ping >/dev/null 2>&1; then
        local limit
        limit="$(node_file_limit)"
        if [ "$limit" -gt 0 ] 2>/dev/null && [ "$limit" -lt 4096 ] && [ "$(ulimit -Hn)" -gt "$limit" ]; then
            say "restarting the local node: it may hold $limit files, the machine allows $(ulimit -Hn)"
            rmq rabbitmqctl -q shutdown >/dev/null 2>&1 || true
        fi
    fi
    if ! rmq rabbitmqctl -q ping >/dev/null 2>&1; then
        say "starting the local RabbitMQ node (rabbitmq-server -detached), waiting up to ${TIMEOUT}s"
        # As many file descriptors as the machine allows: a node's connections and (on 3.x)
        # its quorum queues each hold some, and parallel tests open many. Debian's wrapper
        # switches user with su, which resets the limit to 1024: as root, switch here.
        if [ "$(id -u)" = 0 ] && [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] &&
            id rabbitmq >/dev/null 2>&1; then
            su -s /bin/sh -c 'ulimit -n "$(ulimit -Hn)"; cd /var/lib/rabbitmq &&
                exec /usr/lib/rabbitmq/bin/rabbitmq-server -detached' rabbitmq >"$log" 2>&1
        else
            rmq rabbitmq-server -detached >"$log" 2>&1
        fi || {
            cat "$log" >&2
            fail "rabbitmq-server -detached failed; see above and /var/log/rabbitmq/"
        }
        started=1
    fi
    local deadline=$((SECONDS + TIMEOUT))
    until rmq rabbitmqctl -q await_startup --timeout 30 >"$log" 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            tail -n 5 "$log" >&2
            fail "the local RabbitMQ node did not finish booting within ${TIMEOUT}s; see /var/log/rabbitmq/"
        fi
        sleep 2
    done
    if ! management_ok && ! rmq rabbitmq-plugins -q is_enabled rabbitmq_management >/dev/null 2>&1; then
        say "enabling the rabbitmq_management plugin"
        rmq rabbitmq-plugins -q enable rabbitmq_management >"$log" 2>&1 || {
            cat "$log" >&2
            fail "rabbitmq-plugins enable rabbitmq_management failed"
        }
    fi
    rm -f "$log"
    if ! wait_ready "$TIMEOUT"; then
        amqp_open || fail "the local node is up but nothing answers on $AMQP_HOST:$AMQP_PORT; check its listeners in /etc/rabbitmq/rabbitmq.conf"
        fail "the local node is up but $SAFE_MGMT/api/overview does not answer ($MGMT_ERROR)"
    fi
    done_line "${started:+started }local rabbitmq-server"
}

# --- Docker -------------------------------------------------------------------------------------

docker_possible() {
    command -v docker >/dev/null 2>&1 &&
        timeout 20 docker info >/dev/null 2>&1 &&
        timeout 20 docker compose version >/dev/null 2>&1
}

start_docker() {
    say "starting RabbitMQ with docker compose (docker-compose.yml), waiting until it is healthy"
    # The first run pulls the image, hence the longer bound than for a local node.
    timeout $((TIMEOUT + 480)) docker compose -f "$ROOT/docker-compose.yml" up -d --wait </dev/null ||
        fail "docker compose up failed; see: docker compose -f $ROOT/docker-compose.yml logs"
    wait_ready "$TIMEOUT" || fail "the container is healthy but $SAFE_MGMT/api/overview does not answer ($MGMT_ERROR)"
    done_line "docker compose"
}

if local_possible; then
    start_local
elif docker_possible; then
    start_docker
elif amqp_open; then
    fail "something listens on $AMQP_HOST:$AMQP_PORT but the management API $SAFE_MGMT does not answer ($MGMT_ERROR); enable rabbitmq_management on that broker"
elif [ -n "$RMQ_SERVER" ]; then
    fail "no broker answers on $AMQP_HOST:$AMQP_PORT; rabbitmq-server is installed but needs root: run 'sudo rabbitmq-server -detached && sudo rabbitmq-plugins enable rabbitmq_management'"
else
    fail "no broker answers on $AMQP_HOST:$AMQP_PORT and none can be started here: install rabbitmq-server (Debian/Ubuntu: sudo apt-get install rabbitmq-server) or Docker (then rerun, or: docker compose up -d --wait), or point RABBIT_RETRY_URL and RABBIT_RETRY_MANAGEMENT_URL at a broker with the management plugin"
fi
