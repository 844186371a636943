#!/usr/bin/env bash
# The README's first command: installs rabbit-retry into .venv, makes sure a broker answers
# (starting a local one where it can, see scripts/ensure-broker.sh), validates and applies a
# topology (default topologies/orders.yml) and shows its status; then the whole loop on
# topologies/demo.yml: a shop writes each order and its event in one transaction (the outbox;
# one order rolls back and is never published), the relay publishes the events, a worker
# handles them (one succeeds, one is retried through a tier, one parks), `parking show` lists
# what parked, and the failure desk takes it in and serves its page (http://127.0.0.1:8025/, or
# the next free port). On a terminal the desk runs until Ctrl-C; without one (CI) it stops once
# it has shown what parked. Safe to run again: apply is idempotent (each run parks one more
# sample order).
#
#   ./scripts/quickstart.sh [TOPOLOGY_FILE]
#
# The broker and vhost come from RABBIT_RETRY_URL / RABBIT_RETRY_MANAGEMENT_URL (defaults:
# guest/guest on localhost, vhost /).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

TOPOLOGY="${1:-$ROOT/topologies/orders.yml}"
[ -f "$TOPOLOGY" ] || die "no topology file at $TOPOLOGY"
TOPOLOGY="$(cd "$(dirname "$TOPOLOGY")" && pwd)/$(basename "$TOPOLOGY")"
# Commands shown to the user run from the repository root.
case "$TOPOLOGY" in
    "$ROOT"/*) SHOWN="${TOPOLOGY#"$ROOT"/}" ;;
    *) SHOWN="$TOPOLOGY" ;;
esac
CD_HINT=""
[ "$PWD" = "$ROOT" ] || CD_HINT="  cd $ROOT"$'\n'
cd "$ROOT"

stage "install rabbit-retry into .venv"
ensure_venv
pip_quiet install -e '.[desk]'
RR="$VENV/bin/rabbit-retry"
note "$("$RR" --version)"

stage "broker"
"$ROOT/scripts/ensure-broker.sh" </dev/null

run() {
    stage "rabbit-retry $*"
    "$RR" "$@" </dev/null
}

run validate "$SHOWN"
run apply "$SHOWN"
if "$RR" status --help >/dev/null 2>&1; then
    run status "$SHOWN"
fi

stage "the loop: apply topologies/demo.yml; orders and their events, a relay, a worker"
"$RR" apply topologies/demo.yml </dev/null
"$VENV/bin/python" -m examples.demo </dev/null
run parking show demo.orders

stage "the failure desk: what parked, grouped by cause, in a web page"
DESK_PORT="$("$VENV/bin/python" -c '
import socket
for port in [8025, *range(8026, 8100), 0]:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
        print(s.getsockname()[1])
        break')"
DESK_URL="http://127.0.0.1:$DESK_PORT"
"$RR" desk topologies/demo.yml --store "${RABBIT_RETRY_DESK_STORE:-sqlite:///$ROOT/.rabbit-retry-desk.db}" \
    --listen "127.0.0.1:$DESK_PORT" </dev/null &
DESK_PID=$!
trap 'kill -TERM "$DESK_PID" 2>/dev/null || true; wait "$DESK_PID" 2>/dev/null || true' EXIT
for _ in $(seq 1 150); do
    if curl -fsS --max-time 2 "$DESK_URL/api/overview" 2>/dev/null |
        grep -q '"parked":[1-9]'; then
        break
    fi
    kill -0 "$DESK_PID" 2>/dev/null || die "the desk stopped; see the lines above"
    sleep 0.2
done
note "what the desk stored, grouped by cause ($DESK_URL/api/groups):"
curl -fsS --max-time 5 "$DESK_URL/api/groups" | "$VENV/bin/python" -c '
import json, sys
for g in json.load(sys.stdin):
    print("  %(count)s x %(queue)s: %(exception_type)s: %(exception_message)s (%(reason)s)" % g)'

MGMT="${RABBIT_RETRY_MANAGEMENT_URL:-http://localhost:15672}"
MGMT="$(sed -E 's#://[^@/]*@#://#' <<<"${MGMT%/}")"
cat <<EOF

Done: every exchange, queue, retry tier and parking queue of $SHOWN exists on the
broker; running this again changes nothing.

Try next:
${CD_HINT}  source .venv/bin/activate                     # put rabbit-retry on PATH
  rabbit-retry plan $SHOWN       # file vs broker: all unchanged
  rabbit-retry desk topologies/demo.yml          # the failure desk again (store: .rabbit-retry-desk.db)
  curl -H 'Content-Type: application/json' -d '{"ids": [1]}' http://127.0.0.1:8025/api/replay
  rabbit-retry export $SHOWN --format mermaid
  ./scripts/test.sh                             # test extras, ruff, mypy, every test
Management UI: $MGMT (guest/guest on a local broker)
EOF
if [ -t 0 ] && [ -t 1 ] && [ -z "${CI:-}" ]; then
    printf '\nThe failure desk: open %s/  (Ctrl-C to stop it)\n' "$DESK_URL"
    wait "$DESK_PID" || true
else
    printf '\nThe failure desk served %s/ (no terminal: stopped)\n' "$DESK_URL"
fi
