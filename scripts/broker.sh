#!/usr/bin/env bash
# Runs RabbitMQ nodes of the versions rabbit-retry is tested on, each on its own ports, side by
# side on one machine:
#
#   scripts/broker.sh up VERSION       start (building what is missing); idempotent
#   scripts/broker.sh down VERSION     stop; idempotent
#   scripts/broker.sh status VERSION   one line: running or not, and its version
#   scripts/broker.sh env VERSION      the test variables for it, as `export` lines
#   scripts/broker.sh ctl VERSION ARGS rabbitmqctl of that version, aimed at that node
#   scripts/broker.sh plugins VERSION ARGS  rabbitmq-plugins likewise (enable: no restart)
#
# VERSION is one of:
#   3.10  the machine's own rabbitmq-server package (5672, management 15672), as scripts/ensure-broker.sh
#   4.0   Debian trixie's rabbitmq-server, in a chroot (AMQP 5740, management 15740)
#   4.3   Debian sid's rabbitmq-server, in a chroot (AMQP 5743, management 15743)
#
# A chroot is built once with debootstrap (under a minute, about 400 MB) from the Debian mirror
# this machine's apt sources name, and cached outside the repository in
# RABBIT_RETRY_BROKER_CACHE (default ~/.cache/rabbit-retry/brokers); a half-built one is rebuilt.
# Needs root (debootstrap, chroot, mounts); without root, where a Docker engine runs, the same
# versions come from docker-compose.yml's profiles instead (3.10 then on 5710 / 15710). Every
# wait is bounded (RABBIT_RETRY_BROKER_TIMEOUT seconds, default 180).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${RABBIT_RETRY_BROKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rabbit-retry/brokers}"
TIMEOUT="${RABBIT_RETRY_BROKER_TIMEOUT:-180}"

say() { printf 'broker %s: %s\n' "$VERSION" "$*" >&2; }
fail() { printf 'broker %s: error: %s\n' "${VERSION:-?}" "$*" >&2; exit 1; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

[ $# -ge 2 ] || usage
ACTION="$1"
VERSION="$2"
shift 2

case "$VERSION" in
    3.10) SUITE="" PORT=5672 ;;
    4.0) SUITE=trixie PORT=5740 ;;
    4.3) SUITE=sid PORT=5743 ;;
    *) bad="$VERSION" VERSION="" && fail "unknown version '$bad': use 3.10, 4.0 or 4.3" ;;
esac
MGMT_PORT=$((PORT + 10000))
DIST_PORT=$((PORT + 20000))
NODE="rr${VERSION//./}@localhost"
DIR="$CACHE/$VERSION"

amqp_open() { timeout 3 bash -c ">/dev/tcp/127.0.0.1/$PORT" 2>/dev/null; }
overview() { curl -fsS --max-time 5 "http://guest:guest@127.0.0.1:$MGMT_PORT/api/overview" 2>/dev/null; }
running_version() { overview | grep -o '"rabbitmq_version":"[^"]*"' | head -n 1 | cut -d'"' -f4; }

report_status() {
    local v
    v="$(running_version || true)"
    if [ -n "$v" ]; then echo "running RabbitMQ $v on 127.0.0.1:$PORT"; else echo "not running"; fi
}

print_env() {
    cat <<EOF
export RABBIT_RETRY_TEST_BROKER=$VERSION
export RABBIT_RETRY_TEST_URL=amqp://guest:guest@127.0.0.1:$PORT/
export RABBIT_RETRY_TEST_MANAGEMENT_URL=http://guest:guest@127.0.0.1:$MGMT_PORT
export RABBIT_RETRY_TEST_NODE=$NODE
export RABBIT_RETRY_TEST_CTL="$(ctl_prefix)"
EOF
}

ctl_prefix() {
    if [ -z "$SUITE" ]; then
        printf 'rabbitmqctl'
    else
        printf '%s ctl %s' "$ROOT/scripts/broker.sh" "$VERSION"
    fi
}

# --- Docker, where chroots cannot be built ------------------------------------------------------

docker_ok() {
    command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1 &&
        timeout 20 docker compose version >/dev/null 2>&1
}

if [ "$(id -u)" -ne 0 ] && { [ -n "$SUITE" ] || ! command -v rabbitmq-server >/dev/null 2>&1; } &&
    docker_ok; then
    [ "$VERSION" = 3.10 ] && PORT=5710 MGMT_PORT=15710
    compose() { timeout $((TIMEOUT + 480)) docker compose -f "$ROOT/docker-compose.yml" --profile "$VERSION" "$@" </dev/null; }
    case "$ACTION" in
        up) compose up -d --wait "rabbitmq-$VERSION" >&2 || fail "docker compose up failed" ;;
        down) compose stop "rabbitmq-$VERSION" >&2 ;;
        status) report_status ;;
        env) NODE="rabbit@rr${VERSION//./}" SUITE=docker && print_env ;;
        ctl) exec timeout 300 docker compose -f "$ROOT/docker-compose.yml" --profile "$VERSION" \
            exec -T "rabbitmq-$VERSION" rabbitmqctl "$@" ;;
        plugins) exec timeout 300 docker compose -f "$ROOT/docker-compose.yml" --profile "$VERSION" \
            exec -T "rabbitmq-$VERSION" rabbitmq-plugins "$@" ;;
        *) usage ;;
    esac
    exit 0
fi

# --- the machine's own node -----------------------------------------------------------------

if [ -z "$SUITE" ]; then
    export RABBIT_RETRY_URL="amqp://guest:guest@127.0.0.1:$PORT/"
    export RABBIT_RETRY_MANAGEMENT_URL="http://guest:guest@127.0.0.1:$MGMT_PORT"
    NODE="$(overview | grep -o '"node":"[^"]*"' | head -n 1 | cut -d'"' -f4 || true)"
    NODE="${NODE:-rabbit@$(hostname -s)}"
    case "$ACTION" in
        up) "$ROOT/scripts/ensure-broker.sh" </dev/null >&2 ;;
        down) timeout 120 rabbitmqctl stop >/dev/null 2>&1 || true ;;
        status) report_status ;;
        env) print_env ;;
        ctl) exec rabbitmqctl "$@" ;;
        plugins) exec rabbitmq-plugins "$@" ;;
        *) usage ;;
    esac
    exit 0
fi

# --- a chroot of Debian's package ---------------------------------------------------------------

[ "$(id -u)" -eq 0 ] || fail "needs root (debootstrap, chroot and mounts)"

# The mirror this machine's apt already uses: deb822 sources first, then one-line sources.
mirror() {
    local url
    url="$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v -- '-security' | head -n 1 || true)"
    [ -n "$url" ] || url="$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list |
        awk '{for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}' | grep -v -- '-security' | head -n 1 || true)"
    [ -n "$url" ] || fail "no Debian mirror found in /etc/apt/sources.list*"
    printf '%s' "$url"
}

in_chroot() { chroot "$DIR" env -i HOME=/var/lib/rabbitmq PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"; }

mount_once() {
    mountpoint -q "$DIR/proc" || mount -t proc proc "$DIR/proc"
    mountpoint -q "$DIR/dev" || mount --bind /dev "$DIR/dev"
}

build() {
    [ -f "$DIR/.rabbit-retry-ready" ] && return 0
    command -v debootstrap >/dev/null 2>&1 || {
        say "installing debootstrap"
        timeout 600 apt-get install -y -qq debootstrap >/dev/null 2>&1 ||
            { timeout 600 apt-get update -qq >/dev/null 2>&1 && timeout 600 apt-get install -y -qq debootstrap >/dev/null; } ||
            fail "could not install debootstrap"
    }
    unmount
    rm -rf "$DIR"
    mkdir -p "$DIR"
    local log="$CACHE/$VERSION.debootstrap.log" url
    url="$(mirror)"
    say "building a Debian $SUITE chroot with rabbitmq-server in $DIR (about a minute)"
    timeout 900 debootstrap --variant=minbase --include=rabbitmq-server,curl "$SUITE" "$DIR" "$url" \
        >"$log" 2>&1 || { tail -n 20 "$log" >&2; fail "debootstrap failed; full log: $log"; }
    cp /etc/hosts "$DIR/etc/hosts"
    cat >"$DIR/etc/rabbitmq/rabbitmq.conf" <<EOF
listeners.tcp.1 = 127.0.0.1:$PORT
management.tcp.ip = 127.0.0.1
management.tcp.port = $MGMT_PORT
# The tests measure what the broker holds; make its figures current.
collect_statistics_interval = 1000
EOF
    cat >"$DIR/etc/rabbitmq/rabbitmq-env.conf" <<EOF
NODENAME=$NODE
DIST_PORT=$DIST_PORT
EOF
    cat >"$DIR/etc/rabbitmq/enabled_plugins" <<'EOF'
[rabbitmq_management].
EOF
    touch "$DIR/.rabbit-retry-ready"
}

unmount() {
    local m
    for m in dev proc; do
        mountpoint -q "$DIR/$m" 2>/dev/null && umount -l "$DIR/$m"
    done
    return 0
}

wait_up() {
    local deadline=$((SECONDS + TIMEOUT))
    until amqp_open && [ -n "$(running_version || true)" ]; do
        [ "$SECONDS" -ge "$deadline" ] && fail "did not answer within ${TIMEOUT}s; see $DIR/var/log/rabbitmq/"
        sleep 2
    done
}

up() {
    if [ -n "$(running_version || true)" ]; then
        say "RabbitMQ $(running_version) already running on 127.0.0.1:$PORT, management $MGMT_PORT"
        return 0
    fi
    amqp_open && fail "something else listens on 127.0.0.1:$PORT"
    build
    mount_once
    say "starting $NODE, waiting up to ${TIMEOUT}s"
    # The file-descriptor limit of a node decides how many connections and (3.x) quorum queues
    # it holds. Debian's rabbitmq-server wrapper switches user with su, whose PAM session
    # resets the limit to 1024: switch here, raise it to the hard limit, start the node.
    in_chroot su -s /bin/sh -c 'ulimit -n "$(ulimit -Hn)"; cd /var/lib/rabbitmq &&
        exec /usr/lib/rabbitmq/bin/rabbitmq-server -detached' rabbitmq >/dev/null 2>&1 ||
        fail "rabbitmq-server -detached failed; see $DIR/var/log/rabbitmq/"
    wait_up
    say "RabbitMQ $(running_version) ready on 127.0.0.1:$PORT, management $MGMT_PORT"
}

down() {
    if [ -f "$DIR/.rabbit-retry-ready" ] && [ -d "$DIR/proc/1" ]; then
        timeout 120 in_chroot rabbitmqctl -n "$NODE" stop >/dev/null 2>&1 || true
    fi
    # The VM may outlive a failed stop; its pid file names it.
    local pid
    for pid in $(cat "$DIR"/var/lib/rabbitmq/mnesia/*.pid 2>/dev/null); do
        kill -9 "$pid" 2>/dev/null || true
    done
    unmount
    say "stopped"
}

case "$ACTION" in
    up) up ;;
    down) down ;;
    status) report_status ;;
    env) print_env ;;
    ctl)
        [ -f "$DIR/.rabbit-retry-ready" ] || fail "not built; run: $0 up $VERSION"
        mount_once
        exec timeout 300 chroot "$DIR" env -i HOME=/var/lib/rabbitmq PATH=/usr/sbin:/usr/bin:/sbin:/bin \
            rabbitmqctl -n "$NODE" "$@"
        ;;
    plugins)
        [ -f "$DIR/.rabbit-retry-ready" ] || fail "not built; run: $0 up $VERSION"
        mount_once
        exec timeout 300 chroot "$DIR" env -i HOME=/var/lib/rabbitmq PATH=/usr/sbin:/usr/bin:/sbin:/bin \
            rabbitmq-plugins -n "$NODE" "$@"
        ;;
    *) usage ;;
esac
