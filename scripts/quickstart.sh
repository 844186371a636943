#!/usr/bin/env bash
# The README's first command: installs rabbit-retry into .venv, makes sure a broker answers
# (starting a local one where it can, see scripts/ensure-broker.sh), validates and applies a
# topology (default topologies/orders.yml) and shows its status; then the whole loop on
# topologies/demo.yml: a worker handles three sample orders (one succeeds, one is retried
# through a tier, one parks) and `parking show` lists what parked. Ends by itself. Safe to run
# again: apply is idempotent (each run parks one more sample order).
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
pip_quiet install -e .
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

stage "the loop: apply topologies/demo.yml, a worker handles three sample orders"
"$RR" apply topologies/demo.yml </dev/null
"$VENV/bin/python" -m examples.demo </dev/null
run parking show demo.orders

MGMT="${RABBIT_RETRY_MANAGEMENT_URL:-http://localhost:15672}"
MGMT="$(sed -E 's#://[^@/]*@#://#' <<<"${MGMT%/}")"
cat <<EOF

Done: every exchange, queue, retry tier and parking queue of $SHOWN exists on the
broker; running this again changes nothing.

Try next:
${CD_HINT}  source .venv/bin/activate                     # put rabbit-retry on PATH
  rabbit-retry plan $SHOWN       # file vs broker: all unchanged
  rabbit-retry parking replay demo.orders --yes  # the parked order back to its queue
  rabbit-retry export $SHOWN --format mermaid
  ./scripts/test.sh                             # test extras, ruff, mypy, every test
Management UI: $MGMT (guest/guest on a local broker)
EOF
