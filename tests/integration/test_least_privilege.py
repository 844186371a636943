"""Every verb for a CI user that is not an administrator: tagged ``management`` (``policymaker``
where the file has policies), with configure, write and read permissions on its vhost alone, and
a password full of reserved characters, percent-encoded in both URLs (README, "Who may run
what"). The password never appears in any output."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from support.amqp import Outgoing, depth, depth_sync, publish_sync
from support.broker import version
from support.desk import desk_running
from support.poll import eventually, wait_for
from support.provision import topology
from support.worker import running

from rabbit_retry import Delivery, Permanent, RetryConsumer
from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings, parse_url
from rabbit_retry.topology import Topology

RunCli = Callable[..., Any]  # the run_cli fixture of tests/conftest.py
Q = "lp.orders"
# Every character that ends or splits a part of a URL, and a space.
PASSWORD = "Zq9 p@ss/w#rd?:x,%;" + secrets.token_hex(3)


def _file(tmp_path: Path, queue_type: str = "classic", policy: str = "") -> str:
    path = tmp_path / f"lp-{queue_type}{'-policy' if policy else ''}.yml"
    path.write_text(f"""\
version: 1
exchanges:
  lp: {{type: topic}}
queues:
  {Q}:
    queue_type: {queue_type}
    bindings: [{{exchange: lp, routing_key: "order.*"}}]
    retry: {{delays: [1h], max_attempts: 2}}
{policy}""")
    return str(path)


POLICY = "    policy: {max_length: 5000}\n    on_full: park\n"


def _as(base: Settings, user: str) -> Settings:
    """``base`` (the admin's, on the test's vhost) as ``user``, its password encoded in both."""
    userinfo = f"{quote(user, safe='')}:{quote(PASSWORD, safe='')}"
    amqp = parse_url(base.url)
    api = parse_url(base.management_url, "--management-url", ("http", "https"))
    vhost = quote(base.vhost, safe="")
    return Settings(url=f"amqp://{userinfo}@{amqp.host}:{amqp.port or 5672}/{vhost}",
                    management_url=f"http://{userinfo}@{api.host}:{api.port}")


@pytest.fixture
def ci_user(
    fresh_vhost: Settings, management: Management
) -> Iterator[Callable[[str], Settings]]:
    """Makes throwaway users with the given tags and every permission on the test's vhost
    only; deletes them after."""
    made: list[str] = []

    def make(tags: str) -> Settings:
        name = f"rr-ci-{secrets.token_hex(4)}"
        path = f"/users/{quote(name, safe='')}"
        response = management.request("PUT", path, json={"password": PASSWORD, "tags": tags})
        assert response.status_code in (201, 204), response.text
        made.append(name)
        path = f"/permissions/{quote(fresh_vhost.vhost, safe='')}/{quote(name, safe='')}"
        response = management.request("PUT", path,
                                      json={"configure": ".*", "write": ".*", "read": ".*"})
        assert response.status_code in (201, 204), response.text
        return _as(fresh_vhost, name)

    yield make
    for name in made:
        management.request("DELETE", f"/users/{quote(name, safe='')}")


class Refuses(RetryConsumer):
    queue = Q

    async def handle(self, delivery: Delivery) -> None:
        raise Permanent("refused by the test")


def _ok(result: Any, *verb: str) -> Any:
    assert result.code == 0, (verb, result)
    assert not any(s in result.out + result.err for s in (PASSWORD, quote(PASSWORD, safe=""))), (
        verb, result)
    return result


def test_a_management_user_runs_every_verb(
    ci_user: Callable[[str], Settings], run_cli: RunCli, tmp_path: Path,
    management: Management, fresh_vhost: Settings,
) -> None:
    user = ci_user("management")

    def cli(*args: str) -> Any:
        return _ok(run_cli(*args, settings=user), *args)

    path = _file(tmp_path)
    cli("validate", path)
    cli("export", path, "--format", "definitions")
    planned = json.loads(cli("plan", path, "--json").out)
    assert planned["summary"]["create"] > 0 and not planned["summary"]["conflict"]
    cli("apply", path)
    assert cli("apply", path).out.startswith(f"nothing to do: vhost {user.vhost!r} already")
    assert "no drift" in cli("status", path).out

    # The worker (AMQP alone) parks what it is given.
    publish_sync(user, [Outgoing(f"m-{i}", b"{}") for i in range(3)], routing_key="order.x",
                 exchange="lp")

    topo = topology(Path(path).read_text())

    async def park_all() -> None:
        async with running([Refuses()], topo, user):
            await eventually(lambda: _depth_is(user, f"{Q}.parking", 3), what="3 parked")

    asyncio.run(park_all())
    shown = json.loads(cli("parking", "show", Q, "--json").out)
    assert (shown["parked"], len(shown["messages"])) == (3, 3)
    cli("parking", "export", Q, "--out", str(tmp_path / "parked.jsonl"))
    assert len((tmp_path / "parked.jsonl").read_text().splitlines()) == 3
    cli("parking", "replay", Q, "--limit", "1", "--yes")
    assert (depth_sync(user, Q), depth_sync(user, f"{Q}.parking")) == (1, 2)
    cli("parking", "purge", Q, "--yes")
    assert depth_sync(user, f"{Q}.parking") == 0

    # The desk takes the parking queue into its store and replays from it.
    publish_sync(user, [Outgoing("d-1", b"{}")], routing_key=Q + ".parking")
    asyncio.run(_desk_replays(user, topo, f"sqlite:///{tmp_path / 'desk.db'}"))
    assert depth_sync(user, Q) == 2  # the replayed one, and the one replayed before

    # migrate rebuilds the queue and its tier as quorum queues and keeps the 2 messages.
    quorum = _file(tmp_path, "quorum")
    migrated = cli("migrate", quorum, "--yes")
    # The parking queue follows the main queue's type: rebuilt too.
    assert (f"migrated 3 queues in vhost {user.vhost!r}: {Q}, {Q}.retry.1h, {Q}.parking\n"
            in migrated.out)
    assert (management.queue(fresh_vhost.vhost, Q) or {}).get("type") == "quorum"
    assert depth_sync(user, Q) == 2
    cli("apply", quorum)  # the tiers and parking queue follow
    assert "no drift" in cli("status", quorum).out


async def _depth_is(settings: Settings, queue: str, n: int) -> bool:
    return await depth(settings, queue) == n


async def _desk_replays(user: Settings, topo: Topology, store: str) -> None:
    async with desk_running(topo, user, store) as client:
        await eventually(lambda: _stored(client, 1), what="1 message in the desk's store")
        [message] = (await client.get("/api/messages")).json()["items"]
        replayed = await client.post("/api/replay", json={"ids": [message["id"]]})
        assert replayed.status_code == 200 and replayed.json()["replayed"] == 1, replayed.text


async def _stored(client: object, n: int) -> bool:
    response = await client.get("/api/messages")  # type: ignore[attr-defined]
    return bool(response.json()["total"] == n)


def test_policies_need_the_policymaker_tag_and_nothing_more(
    ci_user: Callable[[str], Settings], run_cli: RunCli, tmp_path: Path,
    management: Management, fresh_vhost: Settings,
) -> None:
    path = _file(tmp_path, policy=POLICY)
    plain = ci_user("management")
    refused = run_cli("apply", path, settings=plain)
    assert (refused.code, refused.out) == (1, ""), refused
    name = parse_url(plain.url).user
    assert refused.err == (
        f"error: 1 policy to set, and setting a policy needs the policymaker tag: user "
        f"{name!r} has tags management; nothing was changed\n"
    )
    assert management.queues(fresh_vhost.vhost) == []  # nothing was declared
    # The same file with the policymaker tag (which includes management's rights).
    maker = ci_user("policymaker")
    done = _ok(run_cli("apply", path, settings=maker), "apply")
    assert f"set policy rabbit-retry:{Q} for queue {Q}" in done.out, done
    wait_for(lambda: (management.queue(fresh_vhost.vhost, Q) or {}).get("policy")
             == f"rabbit-retry:{Q}", "the policy to apply to the queue")
    assert "nothing to do" in _ok(run_cli("apply", path, settings=maker), "apply").out
    # A management user may read what the policymaker set: plan and status work.
    assert _ok(run_cli("plan", path, settings=plain), "plan").code == 0
    assert "no drift" in _ok(run_cli("status", path, settings=plain), "status").out


def test_a_vhost_the_user_has_no_permissions_on(
    ci_user: Callable[[str], Settings], run_cli: RunCli, tmp_path: Path,
) -> None:
    user = ci_user("management")
    elsewhere = user.for_vhost(f"rr-nowhere-{secrets.token_hex(4)}")
    name = parse_url(user.url).user
    result = run_cli("status", _file(tmp_path), settings=elsewhere)
    assert (result.code, result.out) == (1, ""), result
    # The broker refuses the AMQP connection to a vhost the user may not open: the API
    # then says why, from what this user may see.
    assert result.err == (
        f"error: vhost {elsewhere.vhost!r} does not exist on the broker, or user {name!r} has "
        "no permissions on it\n"
    )


def test_status_without_any_permission_on_the_queues_says_what_is_missing(
    ci_user: Callable[[str], Settings], run_cli: RunCli, tmp_path: Path,
    management: Management, fresh_vhost: Settings,
) -> None:
    user = ci_user("management")
    path = _file(tmp_path)
    _ok(run_cli("apply", path, settings=user), "apply")
    assert "no drift" in _ok(run_cli("status", path, settings=user), "status").out  # control
    name = parse_url(user.url).user
    where = f"/permissions/{quote(fresh_vhost.vhost, safe='')}/{quote(str(name), safe='')}"
    response = management.request("PUT", where, json={"configure": "", "write": "",
                                                      "read": ""})
    assert response.status_code in (201, 204), response.text
    result = run_cli("status", path, settings=user)
    if version(management) < (4, 3):
        # On 3.10 and 4.0 a passive declare needs no permission: status works all the same.
        assert "no drift" in _ok(result, "status").out
        return
    assert (result.code, result.out) == (1, ""), result
    assert result.err.startswith(f"error: counting the messages of queue '{Q}' was refused ("), (
        result.err)
    assert result.err.endswith(
        f"): user {name!r} needs a permission on the file's queues (read is enough)\n"
    ), result.err


def test_migrate_names_a_consumer_of_another_user_it_may_not_close_and_loses_nothing(
    ci_user: Callable[[str], Settings], run_cli: RunCli, tmp_path: Path,
    fresh_vhost: Settings,
) -> None:
    import pika

    user = ci_user("management")
    path = _file(tmp_path)
    _ok(run_cli("apply", path, settings=user), "apply")
    publish_sync(user, [Outgoing(f"m-{i}", b"{}") for i in range(4)], routing_key="order.x",
                 exchange="lp")
    # The administrator's consumer holds one message unacked.
    other = pika.BlockingConnection(pika.URLParameters(fresh_vhost.url))
    try:
        channel = other.channel()
        channel.basic_qos(prefetch_count=1)
        held: list[int] = []
        channel.basic_consume(Q, lambda _ch, method, _p, _b: held.append(method.delivery_tag))
        while not held:
            other.process_data_events(time_limit=0.1)
        quorum = _file(tmp_path, "quorum")
        refused = run_cli("migrate", quorum, "--yes", settings=user)
        assert refused.code == 1, refused
        name = parse_url(user.url).user
        [line] = [line for line in refused.err.splitlines() if line.startswith("error: ")]
        assert line.startswith(f"error: {Q}: cannot close its consumer connection '"), line
        assert line.endswith(
            f"': user {name!r} may close only its own connections (an administrator may close "
            f"any); its messages are safe in {Q}.migrating; stop that consumer and run migrate "
            "again"
        ), line
    finally:
        other.close()  # its message goes back to the queue
    done = _ok(run_cli("migrate", quorum, "--yes", settings=user), "migrate")
    assert f"migrated 3 queues in vhost {user.vhost!r}" in done.out, done
    assert depth_sync(user, Q) == 4


def test_the_open_file_guard_of_3x_says_it_cannot_read_the_limit(
    ci_user: Callable[[str], Settings], run_cli: RunCli, tmp_path: Path,
    management: Management,
) -> None:
    user = ci_user("management")
    done = _ok(run_cli("apply", _file(tmp_path, "quorum"), settings=user), "apply")
    major, minor = version(management)
    if major >= 4:  # 4.x holds quorum queues without a file handle each: nothing to check
        assert done.err == "", done
        return
    # The queue, its tier and its parking queue (which follows the queue) are quorum queues.
    assert done.err.startswith(f"note: the open-file limit of RabbitMQ {major}.{minor}."), done
    assert done.err.endswith(
        " for 3 new quorum queues is not checked: reading it needs the monitoring tag\n"
    ), done
    # With the monitoring tag it is read and checked: no note.
    watcher = ci_user("management,monitoring")
    again = _ok(run_cli("apply", _file(tmp_path, "quorum"), settings=watcher), "apply")
    assert again.err == "" and "nothing to do" in again.out, again
