"""Other policies and operator policies on a real broker (issue 28): a company-wide ``.*``
policy with a TTL, or an operator policy with a length limit, that reaches a parking queue is
named by ``plan`` and makes ``status`` a problem (exit 1), not "no drift"; the broker does
drop the parked messages it warned about. Policies are the broker's, and the management API's
fields too: runs on every version."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from support.amqp import blocking, depth_sync, publish
from support.poll import wait_for

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

Q = "other.orders"
TOPOLOGY = f"""\
version: 1
queues:
  {Q}:
    queue_type: classic
    retry: {{delays: [1h]}}
"""


def _put(management: Management, kind: str, vhost: str, name: str, body: dict[str, Any]) -> None:
    response = management.request("PUT", f"/{kind}/{quote(vhost, safe='')}/{name}", json=body)
    assert response.status_code < 300, response.text


def _status(run_cli: Callable[..., Any], file: str, settings: Settings) -> tuple[int, Any]:
    result = run_cli("status", file, "--json", settings=settings)
    return result.code, json.loads(result.out)


def test_a_company_wide_ttl_that_empties_parking_queues_is_a_problem_for_status(
    tmp_path: Path, fresh_vhost: Settings, management: Management,
    run_cli: Callable[..., Any],
) -> None:
    file = str(tmp_path / "other.yml")
    Path(file).write_text(TOPOLOGY)
    assert run_cli("apply", file, settings=fresh_vhost).code == 0

    # Positive control: no other policy, nothing said, status ok.
    plan = run_cli("plan", file, settings=fresh_vhost)
    assert (plan.code, plan.err) == (0, "")
    code, data = _status(run_cli, file, fresh_vhost)
    assert (code, data["ok"], data["policy_hazards"]) == (0, True, [])

    _put(management, "policies", fresh_vhost.vhost, "company-ttl",
         {"pattern": ".*", "definition": {"message-ttl": 3000}, "priority": 0,
          "apply-to": "all"})
    plan = run_cli("plan", file, settings=fresh_vhost)
    assert plan.code == 0, plan.err
    warnings = [line for line in plan.err.splitlines() if line.startswith("warning: ")]
    assert (
        "warning: policy company-ttl (pattern '.*', priority 0) sets message-ttl 3000 on parking "
        f"queue {Q}.parking: deletes parked messages 3s after they arrive"
    ) in warnings
    assert len(warnings) == 3  # the main queue, its tier and its parking queue: one line each
    document = json.loads(run_cli("plan", file, "--json", settings=fresh_vhost).out)
    assert {h["queue"] for h in document["policy_hazards"]} == {
        Q, f"{Q}.retry.1h", f"{Q}.parking"
    }

    code, data = _status(run_cli, file, fresh_vhost)
    assert (code, data["ok"], data["drift"]) == (1, False, [])
    assert {(h["queue"], h["key"], h["value"]) for h in data["policy_hazards"]} == {
        (Q, "message-ttl", 3000), (f"{Q}.retry.1h", "message-ttl", 3000),
        (f"{Q}.parking", "message-ttl", 3000),
    }
    shown = run_cli("status", file, settings=fresh_vhost)
    assert shown.code == 1
    assert "no drift" not in shown.out and "POLICIES:" in shown.out

    # What it warned about: parked messages deleted by the broker.
    wait_for(lambda: ((management.queue(fresh_vhost.vhost, f"{Q}.parking") or {}).get(
        "effective_policy_definition") or {}).get("message-ttl") == 3000,
        "the policy applied to the parking queue")
    blocking(publish(fresh_vhost, b"{}", routing_key=f"{Q}.parking", count=5))
    wait_for(lambda: depth_sync(fresh_vhost, f"{Q}.parking") == 0,
             "the broker deleting the parked messages")


def test_an_operator_policy_limit_on_parking_queues_is_named_and_drops_messages(
    tmp_path: Path, fresh_vhost: Settings, management: Management,
    run_cli: Callable[..., Any],
) -> None:
    file = str(tmp_path / "other.yml")
    Path(file).write_text(TOPOLOGY)
    assert run_cli("apply", file, settings=fresh_vhost).code == 0
    _put(management, "operator-policies", fresh_vhost.vhost, "cap",
         {"pattern": "parking$", "definition": {"max-length": 2}, "priority": 0,
          "apply-to": "queues"})
    plan = run_cli("plan", file, settings=fresh_vhost)
    assert plan.code == 0, plan.err
    assert plan.err.splitlines() == [
        "warning: operator policy cap (pattern 'parking$', priority 0) sets max-length 2 on "
        f"parking queue {Q}.parking: deletes the oldest parked messages beyond 2 messages"
    ]
    code, data = _status(run_cli, file, fresh_vhost)
    assert (code, data["ok"]) == (1, False)
    assert [(h["queue"], h["operator"]) for h in data["policy_hazards"]] == [
        (f"{Q}.parking", True)
    ]

    wait_for(lambda: ((management.queue(fresh_vhost.vhost, f"{Q}.parking") or {}).get(
        "effective_policy_definition") or {}).get("max-length") == 2,
        "the operator policy applied to the parking queue")
    blocking(publish(fresh_vhost, b"{}", routing_key=f"{Q}.parking", count=5))
    assert depth_sync(fresh_vhost, f"{Q}.parking") == 2  # three of five parked messages gone
