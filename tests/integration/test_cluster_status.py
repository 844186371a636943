"""``status`` and ``plan`` on the three-node cluster of scripts/cluster.sh (skipped without it):
every quorum queue's leader and replicas, a warning while a node is down, and what to do when
a live queue has fewer replicas than the file asks for."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.cluster import cluster_or_skip
from support.poll import wait_for

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

Run = Callable[..., Any]
QUORUM = ["orders", "orders.retry.1s", "orders.parking"]
ADD_MEMBER = re.compile(r"rabbitmq-queues add_member --vhost (\S+) (\S+) (\S+?)[;( ]")


def topology(tmp_path: Path, *, replicas: int | None, queues: tuple[str, ...] = ("orders",),
             name: str = "orders.yml") -> Path:
    text = "version: 1\ndefaults:\n  parking: {queue_type: quorum}\n"
    if replicas is not None:
        text += f"  replicas: {replicas}\n"
    text += "queues:\n" + "".join(
        f"  {q}:\n    retry: {{delays: [1s], max_attempts: 2}}\n" for q in queues)
    path = tmp_path / name
    path.write_text(text)
    return path


def status_of(run_cli: Run, settings: Settings, file: Path) -> dict[str, Any]:
    result = run_cli("status", str(file), "--json", settings=settings)
    assert result.code == 0, result.err  # a replica down is a warning, never drift
    data: dict[str, Any] = json.loads(result.out)
    return data


def replicas_of(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["queue"]: r for q in data["queues"] for r in q["replicas"]}


def test_status_warns_while_a_replica_is_down_and_not_before_or_after(
    fresh_vhost: Settings, run_cli: Run, management: Management, tmp_path: Path
) -> None:
    cluster = cluster_or_skip(management)
    file = topology(tmp_path, replicas=3)
    applied = run_cli("apply", str(file), settings=fresh_vhost)
    assert applied.code == 0, applied.err
    everyone = sorted(cluster.nodes)

    # Positive control: with every node up, each quorum queue of orders is listed with its
    # leader and three replicas online, and nothing is warned about.
    before = wait_for(
        lambda: (d := status_of(run_cli, fresh_vhost, file))
        and all(sorted(r["online"]) == everyone for r in replicas_of(d).values()) and d,
        "every replica online in status")
    assert sorted(replicas_of(before)) == sorted(QUORUM)
    for replica in replicas_of(before).values():
        assert sorted(replica["members"]) == everyone and replica["leader"] in everyone
        assert replica["warning"] is None and replica["replicas_asked"] == 3
    assert before["warnings"] == []

    victim = cluster.nodes[2]
    with cluster.down(victim):
        during = wait_for(
            lambda: (d := status_of(run_cli, fresh_vhost, file)) and len(d["warnings"]) == 3
            and d,
            f"status to warn that {victim} is down")
        assert during["warnings"] == [
            f"{q}: 2 of 3 replicas online ({victim} down)" for q in QUORUM]
        assert during["ok"] is True and during["drift"] == []
        # The table comes from a call of its own, and the management API's view of the
        # replicas can change between two calls while a node is down (CI once saw the JSON
        # warn and the table a moment later not): it is polled too.
        warned = f"WARNING: orders.parking: 2 of 3 replicas online ({victim} down)"
        wait_for(
            lambda: (r := run_cli("status", str(file), settings=fresh_vhost)).code == 0
            and warned in r.out and f"{victim} (down)" in r.out and r,
            f"the status table to warn that {victim} is down")
        print(f"[cluster] while {victim} was down: {during['warnings']}")

    wait_for(lambda: status_of(run_cli, fresh_vhost, file)["warnings"] == [],
             f"the warnings to clear once {victim} is back")


def test_plan_tells_how_to_add_the_replicas_a_live_queue_lacks(
    fresh_vhost: Settings, run_cli: Run, management: Management, tmp_path: Path
) -> None:
    cluster = cluster_or_skip(management)
    vhost = fresh_vhost.vhost

    # replicas set on queues that already have every replica: the broker would refuse the
    # changed argument (inequivalent), apply leaves them, plan says why and exits 0.
    plain = topology(tmp_path, replicas=None, name="plain.yml")
    assert run_cli("apply", str(plain), settings=fresh_vhost).code == 0
    asked = topology(tmp_path, replicas=3)
    planned = run_cli("plan", str(asked), settings=fresh_vhost)
    assert planned.code == 0, planned.err
    line = next(x for x in planned.out.splitlines() if x.split()[2:3] == ["orders"])
    assert line.startswith("unchanged queue    orders  (x-quorum-initial-group-size: live "
                           "absent, file 3; the broker reads it only when it creates a queue")
    assert line.endswith(", as asked: nothing to do)"), line
    applied = run_cli("apply", str(asked), settings=fresh_vhost)
    assert (applied.code, applied.out.splitlines()[0]) == (
        0, f"nothing to do: vhost {vhost!r} already matches {asked}"), applied.err

    # Queues declared with one replica (as on a cluster that had one node then) and the file
    # now asking for three: plan names the commands that add the others, and is no conflict.
    one = topology(tmp_path, replicas=1, queues=("late",), name="one.yml")
    assert run_cli("apply", str(one), settings=fresh_vhost).code == 0
    more = topology(tmp_path, replicas=3, queues=("orders", "late"), name="more.yml")
    planned = run_cli("plan", str(more), "--json", settings=fresh_vhost)
    assert planned.code == 0, planned.err
    document = json.loads(planned.out)
    grow = {c["name"]: c["detail"] for c in document["changes"] if c["kind"] == "grow"}
    assert sorted(grow) == ["late", "late.parking", "late.retry.1s"], document["changes"]
    assert document["summary"]["grow"] == 3 and document["summary"]["conflict"] == 0
    commands = {name: ADD_MEMBER.findall(detail) for name, detail in grow.items()}
    for name, found in commands.items():
        assert len(found) == 2 and {q for _, q, _ in found} == {name}, grow[name]
        assert {v for v, _, _ in found} == {vhost}
        assert grow[name].startswith("1 replica ("), grow[name]
    status = status_of(run_cli, fresh_vhost, more)
    assert "late: 1 replica, the file asks for 3" in status["warnings"]

    # The advice works: run each command it gave, and plan has nothing more to say.
    for found in commands.values():
        for v, queue, node in found:
            cluster.queues(node, "add_member", "--vhost", v, queue, node)
    # (The API shows new members at its next statistics collection.)
    wait_for(lambda: json.loads(run_cli("plan", str(more), "--json", settings=fresh_vhost).out
                                )["summary"]["grow"] == 0, "plan to see the added replicas")
    wait_for(lambda: status_of(run_cli, fresh_vhost, more)["warnings"] == [],
             "status to see the new replicas online")


def test_queues_on_one_node_are_named_by_plan_apply_and_status(
    fresh_vhost: Settings, run_cli: Run, management: Management, tmp_path: Path
) -> None:
    cluster_or_skip(management)
    # Positive control first: the default topology (quorum queues, their parking queues quorum
    # too) leaves nothing on one node, and nothing is said.
    default = tmp_path / "default.yml"
    default.write_text("version: 1\nqueues:\n  orders: {retry: {delays: [1s]}}\n")
    applied = run_cli("apply", str(default), settings=fresh_vhost)
    assert (applied.code, applied.err) == (0, ""), applied.err
    assert status_of(run_cli, fresh_vhost, default)["warnings"] == []
    classic = tmp_path / "classic.yml"
    classic.write_text("version: 1\nqueues:\n  orders: {retry: {delays: [1s]}}\n"
                       "  mail: {queue_type: classic, retry: {delays: [1s]}}\n")
    line = ("warning: 3 queues of mail (mail, mail.retry.1s, mail.parking) live on one node of "
            "this 3-node cluster: messages there are lost with that node's disk; "
            "queue_type: quorum keeps them on several")
    planned = run_cli("plan", str(classic), settings=fresh_vhost)
    assert (planned.code, planned.err.splitlines()) == (0, [line])
    applied = run_cli("apply", str(classic), settings=fresh_vhost)
    assert (applied.code, applied.err.splitlines()) == (0, [line])
    warnings = status_of(run_cli, fresh_vhost, classic)["warnings"]
    assert warnings == [line.removeprefix("warning: ")]
