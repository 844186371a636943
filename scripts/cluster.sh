#!/usr/bin/env bash
# Runs a three-node RabbitMQ 4.3 cluster on loopback, for the cluster tests and benchmarks:
#
#   scripts/cluster.sh up        start the three nodes and cluster them (building what is
#                                missing); idempotent: a running cluster is left as it is
#   scripts/cluster.sh down      stop every node and forget the cluster's data; idempotent
#   scripts/cluster.sh kill N    kill -9 node N's VM (N = 1, 2 or 3), as a crashed machine goes
#   scripts/cluster.sh start N   start node N again; it rejoins the cluster with its data
#   scripts/cluster.sh status    one line per node: running or not, its ports
#   scripts/cluster.sh env       the test variables for the cluster, as `export` lines
#   scripts/cluster.sh ctl N ARGS  rabbitmqctl aimed at node N
#   scripts/cluster.sh queues N ARGS  rabbitmq-queues aimed at node N (add_member, grow, ...)
#
# Node N is cN@localhost: AMQP 576N, management 1576N, distribution 2576N. The nodes run from
# the RabbitMQ 4.3 chroot of scripts/broker.sh (built through `scripts/broker.sh up 4.3` when
# missing), beside that version's single node, each with its own config, data, logs and pid
# file under /var/lib/rabbitmq/rr-cluster/cN in the chroot. Needs root, as the chroot does.
# Every wait is bounded (RABBIT_RETRY_BROKER_TIMEOUT seconds, default 180).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${RABBIT_RETRY_BROKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rabbit-retry/brokers}"
TIMEOUT="${RABBIT_RETRY_BROKER_TIMEOUT:-180}"
DIR="$CACHE/4.3"
NODES=(1 2 3)
# Inside the chroot.
BASE=/var/lib/rabbitmq/rr-cluster

say() { printf 'cluster: %s\n' "$*" >&2; }
fail() { printf 'cluster: error: %s\n' "$*" >&2; exit 1; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

[ $# -ge 1 ] || usage
ACTION="$1"
shift

node_name() { printf 'c%s@localhost' "$1"; }
amqp_port() { printf '576%s' "$1"; }
mgmt_port() { printf '1576%s' "$1"; }
dist_port() { printf '2576%s' "$1"; }
host_dir() { printf '%s%s/c%s' "$DIR" "$BASE" "$1"; }

check_n() {
    case "${1:-}" in
        1 | 2 | 3) ;;
        *) fail "node number must be 1, 2 or 3, got '${1:-}'" ;;
    esac
}

amqp_open() { timeout 3 bash -c ">/dev/tcp/127.0.0.1/$(amqp_port "$1")" 2>/dev/null; }
api() { curl -fsS --max-time 5 "http://guest:guest@127.0.0.1:$(mgmt_port "$1")/api/$2" 2>/dev/null; }
# The node answers over AMQP and its management API reports it running.
node_up() { amqp_open "$1" && api "$1" overview | grep -q '"rabbitmq_version"'; }
# The names of the running members node N's management API knows of (one per line).
running_members() {
    api "$1" nodes | tr '{' '\n' | grep '"running":true' | grep -o '"name":"[^"]*"' | cut -d'"' -f4 || true
}
pid_of() {
    local file
    file="$(host_dir "$1")/pid"
    [ -s "$file" ] || return 1
    local pid
    pid="$(tr -dc '0-9' <"$file")"
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && printf '%s' "$pid"
}

mount_once() {
    mountpoint -q "$DIR/proc" || mount -t proc proc "$DIR/proc"
    mountpoint -q "$DIR/dev" || mount --bind /dev "$DIR/dev"
}

# The environment of node N, as `env` arguments: everything that sets it apart from the others.
node_env() {
    local n="$1" d="$BASE/c$1"
    printf '%s\n' HOME=/var/lib/rabbitmq PATH=/usr/sbin:/usr/bin:/sbin:/bin \
        "RABBITMQ_NODENAME=$(node_name "$n")" "RABBITMQ_DIST_PORT=$(dist_port "$n")" \
        "RABBITMQ_CONFIG_FILE=$d/rabbitmq.conf" "RABBITMQ_MNESIA_BASE=$d/mnesia" \
        "RABBITMQ_LOG_BASE=$d/log" "RABBITMQ_PID_FILE=$d/pid"
}

# in_chroot_as N [timeout SECONDS] COMMAND...: runs COMMAND in the chroot as node N's environment.
in_chroot_as() {
    local n="$1" limit=()
    shift
    if [ "$1" = timeout ]; then limit=(timeout "$2") && shift 2; fi
    local vars=()
    mapfile -t vars < <(node_env "$n")
    ${limit[@]+"${limit[@]}"} chroot "$DIR" env -i "${vars[@]}" "$@"
}

ctl() {
    local n="$1"
    shift
    in_chroot_as "$n" timeout 120 rabbitmqctl -n "$(node_name "$n")" "$@"
}

ensure_chroot() {
    if [ ! -f "$DIR/.rabbit-retry-ready" ]; then
        say "the 4.3 chroot is missing: building it through scripts/broker.sh up 4.3"
        "$ROOT/scripts/broker.sh" up 4.3 </dev/null || fail "scripts/broker.sh up 4.3 failed"
    fi
    [ "$(id -u)" -eq 0 ] || fail "needs root (chroot and mounts)"
    mount_once
}

prepare() {
    local n="$1" d
    d="$(host_dir "$n")"
    mkdir -p "$d/mnesia" "$d/log"
    cat >"$d/rabbitmq.conf" <<EOF
listeners.tcp.1 = 127.0.0.1:$(amqp_port "$n")
management.tcp.ip = 127.0.0.1
management.tcp.port = $(mgmt_port "$n")
# The tests measure what the broker holds; make its figures current.
collect_statistics_interval = 1000
EOF
    chroot "$DIR" chown -R rabbitmq:rabbitmq "$BASE"
}

start_node() {
    local n="$1"
    if pid_of "$n" >/dev/null; then
        return 0
    fi
    amqp_open "$n" && fail "something else listens on 127.0.0.1:$(amqp_port "$n")"
    prepare "$n"
    say "starting $(node_name "$n") (AMQP $(amqp_port "$n"), management $(mgmt_port "$n"))"
    # The file-descriptor limit of a node decides how many quorum queues it can hold.
    in_chroot_as "$n" sh -c "ulimit -n 65536 2>/dev/null || ulimit -n \"\$(ulimit -Hn)\"; rabbitmq-server -detached" >/dev/null 2>&1 ||
        fail "rabbitmq-server -detached failed for $(node_name "$n"); see $(host_dir "$n")/log/"
}

wait_node() {
    local n="$1" deadline=$((SECONDS + TIMEOUT))
    until node_up "$n"; do
        [ "$SECONDS" -ge "$deadline" ] && fail "$(node_name "$n") did not answer within ${TIMEOUT}s; see $(host_dir "$n")/log/"
        sleep 2
    done
}

clustered() {
    local n="$1"
    running_members 1 | grep -qx "$(node_name "$n")"
}

join() {
    local n="$1"
    say "joining $(node_name "$n") to $(node_name 1)"
    ctl "$n" stop_app >/dev/null || fail "rabbitmqctl stop_app on $(node_name "$n") failed"
    ctl "$n" join_cluster "$(node_name 1)" >/dev/null || fail "rabbitmqctl join_cluster on $(node_name "$n") failed"
    ctl "$n" start_app >/dev/null || fail "rabbitmqctl start_app on $(node_name "$n") failed"
}

up() {
    ensure_chroot
    local n
    # All at once: nodes that were clustered before wait for their peers while they boot.
    for n in "${NODES[@]}"; do start_node "$n"; done
    for n in "${NODES[@]}"; do wait_node "$n"; done
    for n in 2 3; do clustered "$n" || join "$n"; done
    local deadline=$((SECONDS + TIMEOUT))
    until [ "$(running_members 1 | grep -c '^c[123]@localhost$')" -eq 3 ]; do
        [ "$SECONDS" -ge "$deadline" ] && fail "the nodes did not form one cluster within ${TIMEOUT}s (running: $(running_members 1 | tr '\n' ' '))"
        sleep 2
    done
    for n in "${NODES[@]}"; do wait_node "$n"; done
    say "3 nodes clustered: AMQP 5761-5763, management 15761-15763"
}

down() {
    local n pid
    if [ -f "$DIR/.rabbit-retry-ready" ] && [ "$(id -u)" -eq 0 ]; then
        mount_once
        for n in "${NODES[@]}"; do
            pid_of "$n" >/dev/null && { ctl "$n" stop >/dev/null 2>&1 || true; }
        done
    fi
    # A VM may outlive a failed stop; its pid file names it.
    for n in "${NODES[@]}"; do
        if pid="$(pid_of "$n")"; then kill -9 "$pid" 2>/dev/null || true; fi
    done
    rm -rf "${DIR:?}$BASE"
    say "stopped; data removed"
}

kill_node() {
    local n="$1" pid
    check_n "$n"
    pid="$(pid_of "$n")" || { say "$(node_name "$n") is not running"; return 0; }
    kill -9 "$pid"
    local deadline=$((SECONDS + 30))
    while kill -0 "$pid" 2>/dev/null; do
        [ "$SECONDS" -ge "$deadline" ] && fail "$(node_name "$n") (pid $pid) survived kill -9 for 30s"
        sleep 0.2
    done
    say "killed $(node_name "$n") (pid $pid)"
}

start_one() {
    local n="$1"
    check_n "$n"
    [ -d "$(host_dir "$n")/mnesia" ] || fail "$(node_name "$n") has no data: run $0 up"
    ensure_chroot
    start_node "$n"
    wait_node "$n"
    say "$(node_name "$n") running"
}

status() {
    local n members=""
    for n in "${NODES[@]}"; do
        if node_up "$n"; then
            [ -n "$members" ] || members="$(running_members "$n" | tr '\n' ' ')"
            echo "$(node_name "$n") running on 127.0.0.1:$(amqp_port "$n"), management $(mgmt_port "$n")"
        elif pid_of "$n" >/dev/null; then
            echo "$(node_name "$n") starting (VM up, not answering yet)"
        else
            echo "$(node_name "$n") not running"
        fi
    done
    [ -z "$members" ] || echo "running members: ${members% }"
}

print_env() {
    local n urls=() mgmts=() names=()
    for n in "${NODES[@]}"; do
        urls+=("amqp://guest:guest@127.0.0.1:$(amqp_port "$n")/")
        mgmts+=("http://guest:guest@127.0.0.1:$(mgmt_port "$n")")
        names+=("$(node_name "$n")")
    done
    local IFS=,
    cat <<EOF
export RABBIT_RETRY_TEST_BROKER=4.3-cluster
export RABBIT_RETRY_TEST_URL=${urls[*]}
export RABBIT_RETRY_TEST_MANAGEMENT_URL=${mgmts[*]}
export RABBIT_RETRY_TEST_CLUSTER_NODES=${names[*]}
export RABBIT_RETRY_TEST_CLUSTER=$ROOT/scripts/cluster.sh
export RABBIT_RETRY_TEST_NODE=${names[0]}
export RABBIT_RETRY_TEST_CTL="$ROOT/scripts/cluster.sh ctl 1"
EOF
}

case "$ACTION" in
    up) up ;;
    down) down ;;
    kill) kill_node "${1:-}" ;;
    start) start_one "${1:-}" ;;
    status) status ;;
    env) print_env ;;
    ctl)
        check_n "${1:-}"
        n="$1"
        shift
        ensure_chroot
        in_chroot_as "$n" timeout 300 rabbitmqctl -n "$(node_name "$n")" "$@"
        ;;
    queues)
        check_n "${1:-}"
        n="$1"
        shift
        ensure_chroot
        in_chroot_as "$n" timeout 300 rabbitmq-queues -n "$(node_name "$n")" "$@"
        ;;
    *) usage ;;
esac
