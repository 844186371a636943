"""Tunables as policies on a real broker: ``apply`` sets one exactly anchored policy per queue,
changes it live (same queue, same messages, nothing redeclared), deletes it when the file drops
it; ``plan`` names other policies and operator policies that match before anything changes."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from support.amqp import blocking, depth_sync, publish
from support.poll import wait_for
from support.vhosts import delete_vhost, import_definitions

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

Q = "pol.orders"


def _file(policy: str = "") -> str:
    return f"""\
version: 1
queues:
  {Q}:
    queue_type: classic
    retry: {{delays: [1h]}}
{policy}"""


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "pol.yml"
    path.write_text(text)
    return str(path)


def _effective(management: Management, settings: Settings) -> tuple[Any, Any]:
    info = management.queue(settings.vhost, Q) or {}
    return info.get("policy"), info.get("effective_policy_definition")


def _policies(management: Management, settings: Settings) -> dict[str, dict[str, Any]]:
    raw = management.get(f"/policies/{quote(settings.vhost, safe='')}")
    return {p["name"]: p for p in raw}


@pytest.fixture
def operator_policy(fresh_vhost: Settings, management: Management) -> Iterator[None]:
    path = f"/operator-policies/{quote(fresh_vhost.vhost, safe='')}/cap"
    body = {"pattern": "^pol\\.", "definition": {"max-length": 50}, "priority": 0,
            "apply-to": "queues"}
    response = management.request("PUT", path, json=body)
    assert response.status_code < 300, response.text
    yield
    management.request("DELETE", path)


def test_tunables_are_applied_live_as_one_policy_and_other_policies_are_named_first(
    tmp_path: Path, fresh_vhost: Settings, management: Management,
    run_cli: Callable[..., Any], operator_policy: None,
) -> None:
    file = _write(tmp_path, _file("    policy: {max_length: 1000, message_ttl: 1h}\n"
                                     "    on_full: park\n    on_expire: park\n"))
    result = run_cli("apply", file, settings=fresh_vhost)
    assert result.code == 0, result.err
    assert f"set policy rabbit-retry:{Q} for queue {Q}: {{max-length: 1000, message-ttl: " \
           "3600000} priority 10" in result.out
    policy = _policies(management, fresh_vhost)[f"rabbit-retry:{Q}"]
    assert (policy["pattern"], policy["apply-to"], policy["priority"]) == (
        "^pol\\.orders$", "queues", 10
    )
    wait_for(lambda: _effective(management, fresh_vhost)[0] == f"rabbit-retry:{Q}",
             "the policy applied to the queue")

    # Another user's policy with a higher priority, and an operator policy: named before
    # anything changes.
    path = f"/policies/{quote(fresh_vhost.vhost, safe='')}/greedy"
    management.request("PUT", path, json={"pattern": "orders$", "definition": {"max-length": 1},
                                          "priority": 50, "apply-to": "queues"})
    changed = _write(tmp_path, _file("    policy: {max_length: 2000}\n    on_full: park\n"))
    plan = run_cli("plan", changed, settings=fresh_vhost)
    assert plan.code == 0, plan.err
    assert (
        f"update    policy   rabbit-retry:{Q}  (live {{max-length: 1000, message-ttl: 3600000}} "
        "priority 10, file {max-length: 2000} priority 10)" in plan.out.splitlines()
    )
    assert [line for line in plan.err.splitlines() if line.startswith("note: ")] == [
        f"note: policy greedy (priority 50, max-length) wins over rabbit-retry:{Q} (priority 10) "
        f"on queue {Q}: the file's tunables do not apply; raise policy.priority or change that "
        "policy",
        f"note: operator policy cap (max-length) also applies to queue {Q}: where both set a "
        "limit, the lower one wins",
    ]
    # ... and what they do to every queue of the file: the greedy one's limit of 1 on the main
    # queue, the operator policy's 50 on the tier and the parking queue (the main queue's 50
    # is merged with the greedy 1, which is lower).
    warnings = [line for line in plan.err.splitlines() if line.startswith("warning: ")]
    assert [w.split(": ", 2)[1] for w in warnings] == [
        f"policy greedy (pattern 'orders$', priority 50) sets max-length 1 on main queue {Q}",
        f"operator policy cap (pattern '^pol\\.', priority 0) sets max-length 50 on retry "
        f"tier {Q}.retry.1h",
        f"operator policy cap (pattern '^pol\\.', priority 0) sets max-length 50 on parking "
        f"queue {Q}.parking",
    ]
    assert _policies(management, fresh_vhost)[f"rabbit-retry:{Q}"]["definition"] == {
        "max-length": 1000, "message-ttl": 3_600_000
    }
    management.request("DELETE", path)
    wait_for(lambda: _effective(management, fresh_vhost)[0] == f"rabbit-retry:{Q}",
             "our policy applied again once the greedy one is gone")
    blocking(publish(fresh_vhost, b"{}", routing_key=Q, count=3))

    before = management.queue(fresh_vhost.vhost, Q) or {}
    result = run_cli("apply", changed, settings=fresh_vhost)
    assert result.code == 0, result.err
    assert _policies(management, fresh_vhost)[f"rabbit-retry:{Q}"]["definition"] == {
        "max-length": 2000
    }
    wait_for(lambda: (_effective(management, fresh_vhost)[1] or {}).get("max-length") == 50,
             "the operator policy's lower limit merged in")
    after = management.queue(fresh_vhost.vhost, Q) or {}
    assert after["arguments"] == before["arguments"]
    assert depth_sync(fresh_vhost, Q) == 3  # same queue, same messages: nothing redeclared
    assert "nothing to do" in run_cli("apply", changed, settings=fresh_vhost).out

    dropped = _write(tmp_path, _file())
    result = run_cli("apply", dropped, settings=fresh_vhost)
    assert result.code == 0, result.err
    assert f"deleted policy rabbit-retry:{Q}" in result.out
    assert f"rabbit-retry:{Q}" not in _policies(management, fresh_vhost)


def test_status_shows_the_policy_that_applies_as_the_broker_does(
    tmp_path: Path, fresh_vhost: Settings, management: Management,
    run_cli: Callable[..., Any], operator_policy: None,
) -> None:
    file = _write(tmp_path, _file("    policy: {max_length: 1000}\n    on_full: park\n"))
    assert run_cli("apply", file, settings=fresh_vhost).code == 0

    def policy_of_status() -> tuple[dict[str, Any], list[str]]:
        result = run_cli("status", file, "--json", settings=fresh_vhost)
        data = json.loads(result.out)
        # The operator policy's limit of 50 on the tier and the parking queue: a problem.
        assert (result.code, data["ok"]) == (1, False), result.err
        assert {h["queue"] for h in data["policy_hazards"]} >= {f"{Q}.retry.1h", f"{Q}.parking"}
        return data["queues"][0]["policy"], data["warnings"]

    policy, warnings = policy_of_status()
    assert policy == {
        "name": f"rabbit-retry:{Q}", "priority": 10, "definition": {"max-length": 1000},
        "tied": [], "operator_policy": "cap", "operator_definition": {"max-length": 50},
        "ours": f"rabbit-retry:{Q}", "ours_applies": True,
    }
    assert warnings == []
    # The broker says the same.
    wait_for(lambda: _effective(management, fresh_vhost)[0] == f"rabbit-retry:{Q}",
             "the broker applying our policy")

    path = f"/policies/{quote(fresh_vhost.vhost, safe='')}/greedy"
    management.request("PUT", path, json={"pattern": "orders$", "definition": {"max-length": 1},
                                          "priority": 50, "apply-to": "queues"})
    policy, warnings = policy_of_status()
    assert (policy["name"], policy["priority"], policy["ours_applies"]) == ("greedy", 50, False)
    warning = (f"{Q}: policy greedy (priority 50) wins over rabbit-retry:{Q} (priority 10): the "
               "file's tunables do not apply")
    assert warnings == [warning]
    wait_for(lambda: _effective(management, fresh_vhost)[0] == "greedy",
             "the broker applying the greedy policy")
    shown = run_cli("status", file, settings=fresh_vhost)
    assert shown.code == 1, shown.err  # the policies' limits, not drift
    assert f"WARNING: {warning}" in " ".join(shown.out.split())  # however rich wraps it
    assert "no drift" not in shown.out and "POLICIES:" in shown.out


def test_exported_definitions_carry_the_policy(
    tmp_path: Path, vhost_factory: Callable[[], Settings], management: Management,
    run_cli: Callable[..., Any],
) -> None:
    imported = vhost_factory()
    try:
        file = _write(tmp_path, _file("    policy: {max_length: 1000, priority: 20}\n"
                                     "    on_full: park\n"))
        exported = run_cli("export", file, "--format", "definitions")
        assert exported.code == 0, exported.err
        import_definitions(management, imported.vhost, json.loads(exported.out))
        policy = _policies(management, imported)[f"rabbit-retry:{Q}"]
        assert (policy["pattern"], policy["apply-to"], policy["priority"], policy["definition"]) \
            == ("^pol\\.orders$", "queues", 20, {"max-length": 1000})
        # What apply would have made: nothing left to do.
        again = run_cli("apply", file, settings=imported)
        assert again.out == f"nothing to do: vhost {imported.vhost!r} already matches {file}\n"
    finally:
        delete_vhost(management, imported.vhost)
