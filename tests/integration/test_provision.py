"""``validate``, ``plan``, ``apply`` and ``export`` against the real broker, each test in a vhost
of its own; every result is read back through the management API or counted over AMQP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import pytest
from support.broker import version
from support.vhosts import delete_vhost, import_definitions

from rabbit_retry.broker.diff import capacity_problem
from rabbit_retry.broker.inspect import read_capacity
from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

RunCli = Callable[..., Any]  # the run_cli fixture of tests/conftest.py

TOPOLOGY = """\
version: 1
exchanges:
  orders: {type: topic}
queues:
  orders.fraud-check:
    bindings:
      - {exchange: orders, routing_key: order.created}
    retry: {delays: [200ms, 1s], max_attempts: 3}
  orders.email:
    queue_type: classic
    bindings: [{exchange: orders, routing_key: "order.*"}]
    retry: {delays: [1s], max_attempts: 2}
    arguments: {x-max-length: 100000}
    on_full: park
"""

QUORUM_DL = {"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}
EXPECTED_QUEUES: dict[str, tuple[str, dict[str, Any]]] = {
    "orders.fraud-check": ("quorum", {
        "x-queue-type": "quorum", **QUORUM_DL,
        "x-dead-letter-exchange": "orders.fraud-check.retry",
        "x-dead-letter-routing-key": "orders.fraud-check",
    }),
    "orders.fraud-check.retry.200ms": ("quorum", {
        "x-queue-type": "quorum", **QUORUM_DL, "x-message-ttl": 200,
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "orders.fraud-check",
    }),
    "orders.fraud-check.retry.1s": ("quorum", {
        "x-queue-type": "quorum", **QUORUM_DL, "x-message-ttl": 1000,
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "orders.fraud-check",
    }),
    "orders.fraud-check.parking": ("quorum", {"x-queue-type": "quorum",
                                              "x-delivery-limit": 2**31 - 1}),
    "orders.email": ("classic", {
        "x-queue-type": "classic", "x-max-length": 100000,
        "x-dead-letter-exchange": "orders.email.retry",
        "x-dead-letter-routing-key": "orders.email",
    }),
    "orders.email.retry.1s": ("classic", {
        "x-queue-type": "classic", "x-message-ttl": 1000,
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "orders.email",
    }),
    "orders.email.parking": ("classic", {"x-queue-type": "classic"}),
}
EXPECTED_EXCHANGES = {
    "orders": "topic",
    "orders.fraud-check.retry": "direct",
    "orders.email.retry": "direct",
}
EXPECTED_BINDINGS = {
    ("orders", "orders.fraud-check", "order.created"),
    ("orders.fraud-check.retry", "orders.fraud-check.retry.200ms", "200ms"),
    ("orders.fraud-check.retry", "orders.fraud-check.retry.200ms", "orders.fraud-check"),
    ("orders.fraud-check.retry", "orders.fraud-check.retry.1s", "1s"),
    ("orders", "orders.email", "order.*"),
    ("orders.email.retry", "orders.email.retry.1s", "1s"),
    ("orders.email.retry", "orders.email.parking", "orders.email"),  # on_full: park
}


# --- helpers --------------------------------------------------------------------------------


def write(tmp_path: Path, text: str, name: str = "topology.yml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def vhost_of(settings: Settings) -> str:
    return settings.vhost


def queues(api: Management, settings: Settings) -> dict[str, tuple[str, dict[str, Any]]]:
    return {q["name"]: (q["type"], q["arguments"]) for q in api.queues(settings.vhost)}


def exchanges(api: Management, settings: Settings) -> dict[str, str]:
    # The broker's own exchanges (amq.*, the default one) are in every vhost.
    return {
        e["name"]: e["type"]
        for e in api.exchanges(settings.vhost)
        if e["name"] and not e["name"].startswith("amq.")
    }


def bindings(api: Management, settings: Settings) -> set[tuple[str, str, str]]:
    return {
        (b["source"], b["destination"], b["routing_key"])
        for b in api.bindings(settings.vhost)
        if b["source"]  # the default exchange's implicit bindings are not ours
    }


def definitions(api: Management, settings: Settings) -> dict[str, Any]:
    """The vhost's full definitions with every list in a stable order."""
    raw = api.definitions(settings.vhost)
    return {
        key: sorted(value, key=lambda v: json.dumps(v, sort_keys=True))
        if isinstance(value, list)
        else value
        for key, value in raw.items()
    }


def is_empty(api: Management, settings: Settings) -> bool:
    return not queues(api, settings) and not exchanges(api, settings)


async def _counts(settings: Settings, names: list[str]) -> dict[str, int]:
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel()
        out = {}
        for name in names:
            queue = await channel.declare_queue(name, passive=True)
            assert queue.declaration_result.message_count is not None
            out[name] = queue.declaration_result.message_count
        return out


def counts(settings: Settings, *names: str) -> dict[str, int]:
    """Exact message counts from the broker (the management statistics lag)."""
    return asyncio.run(_counts(settings, list(names)))


async def _publish(settings: Settings, exchange: str, routing_key: str, n: int) -> None:
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        target = await channel.get_exchange(exchange) if exchange else channel.default_exchange
        for i in range(n):
            await target.publish(
                aio_pika.Message(f"m{i}".encode()), routing_key=routing_key, mandatory=True
            )


def publish(settings: Settings, exchange: str, routing_key: str, n: int = 1) -> None:
    """Publish with confirms and mandatory: returns once the broker has every message."""
    asyncio.run(_publish(settings, exchange, routing_key, n))


def declare_queue(
    api: Management, settings: Settings, name: str, arguments: dict[str, Any]
) -> None:
    path = f"/queues/{_q(settings.vhost)}/{_q(name)}"
    response = api.request("PUT", path, json={"durable": True, "arguments": arguments})
    assert response.status_code in (201, 204), response.text


def _q(name: str) -> str:
    from urllib.parse import quote

    return quote(name, safe="")


# --- apply ----------------------------------------------------------------------------------


def test_apply_creates_exactly_the_expected_objects(
    tmp_path: Path, fresh_vhost: Settings, management: Management, run_cli: RunCli
) -> None:
    file = write(tmp_path, TOPOLOGY)
    result = run_cli("apply", file, settings=fresh_vhost)
    assert (result.code, result.err) == (0, "")
    assert result.out == (
        f"created 3 exchanges, 7 queues and 7 bindings in vhost {fresh_vhost.vhost!r}\n"
    )
    assert queues(management, fresh_vhost) == EXPECTED_QUEUES
    assert exchanges(management, fresh_vhost) == EXPECTED_EXCHANGES
    assert bindings(management, fresh_vhost) == EXPECTED_BINDINGS
    for q in management.queues(fresh_vhost.vhost):
        assert (q["durable"], q["auto_delete"], q["exclusive"]) == (True, False, False), q["name"]
    for e in management.exchanges(fresh_vhost.vhost):
        if e["name"] in EXPECTED_EXCHANGES:
            assert (e["durable"], e["auto_delete"], e["internal"]) == (True, False, False)


def test_second_apply_and_plan_have_nothing_to_do(
    tmp_path: Path,
    fresh_vhost: Settings,
    management: Management,
    run_cli: RunCli,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    file = write(tmp_path, TOPOLOGY)
    assert run_cli("apply", file, settings=fresh_vhost).code == 0
    before = definitions(management, fresh_vhost)

    async def no_amqp(*args: object, **kwargs: object) -> None:
        raise AssertionError("a no-op apply must not open an AMQP connection")

    monkeypatch.setattr("rabbit_retry.broker.declare.connect", no_amqp)
    again = run_cli("apply", file, settings=fresh_vhost)
    assert (again.code, again.err) == (0, "")
    assert again.out == f"nothing to do: vhost {fresh_vhost.vhost!r} already matches {file}\n"
    assert definitions(management, fresh_vhost) == before

    plan = run_cli("plan", file, settings=fresh_vhost)
    assert (plan.code, plan.err) == (0, "")
    summary = (
        f"vhost {fresh_vhost.vhost!r}: 0 to create, 17 unchanged, 0 to update, 0 in conflict, "
        "0 to migrate, 0 to unbind, 0 to prune, 0 obsolete but not empty"
    )
    # Compact by default: the changes (none), a count of the rest; --all lists every object.
    assert plan.out.splitlines() == ["unchanged: 17 objects not listed (--all lists them)",
                                     summary]
    every = run_cli("plan", file, "--all", "--detailed-exitcode", settings=fresh_vhost)
    assert (every.code, every.err) == (0, "")
    lines = every.out.splitlines()
    assert len(lines) == 18
    assert all(line.startswith("unchanged ") for line in lines[:-1])
    assert lines[-1] == summary

    as_json = run_cli("plan", file, "--json", settings=fresh_vhost)
    assert as_json.code == 0
    document = json.loads(as_json.out)
    assert document["summary"] == {
        "create": 0, "unchanged": 17, "update": 0, "conflict": 0, "migrate": 0, "unbind": 0,
        "prune": 0, "keep": 0, "grow": 0,
    }
    assert document["vhost"] == fresh_vhost.vhost
    assert {c["name"] for c in document["changes"] if c["object"] == "queue"} == set(
        EXPECTED_QUEUES
    )
    # Stable: the same state gives byte-identical JSON.
    assert run_cli("plan", file, "--json", settings=fresh_vhost).out == as_json.out


def test_plan_and_dry_run_on_an_empty_vhost_touch_nothing(
    tmp_path: Path, fresh_vhost: Settings, management: Management, run_cli: RunCli
) -> None:
    file = write(tmp_path, TOPOLOGY)
    plan = run_cli("plan", file, "--json", settings=fresh_vhost)
    assert plan.code == 0
    assert json.loads(plan.out)["summary"]["create"] == 17
    dry = run_cli("apply", file, "--dry-run", settings=fresh_vhost)
    assert dry.code == 0
    assert "create    queue    orders.fraud-check.retry.200ms  (quorum, tier, ttl 200ms)" in (
        dry.out.splitlines()
    )
    assert dry.out.endswith("dry run: nothing was changed\n")
    assert is_empty(management, fresh_vhost)


# --- conflicts ------------------------------------------------------------------------------

CONFLICTS = {
    "classic where the file says quorum": (
        "orders.fraud-check",
        {},
        "type: live classic, file quorum; "
        "x-dead-letter-exchange: live absent, file orders.fraud-check.retry; "
        "x-dead-letter-routing-key: live absent, file orders.fraud-check; "
        "x-dead-letter-strategy: live absent, file at-least-once; "
        "x-overflow: live absent, file reject-publish",
    ),
    "a tier with another TTL": (
        "orders.email.retry.1s",
        {
            "x-message-ttl": 5000,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": "orders.email",
        },
        "x-message-ttl: live 5000, file 1000",
    ),
}


@pytest.mark.parametrize("case", list(CONFLICTS))
def test_changed_queue_exits_3_names_migrate_and_changes_nothing(
    case: str,
    tmp_path: Path,
    fresh_vhost: Settings,
    management: Management,
    run_cli: RunCli,
) -> None:
    name, arguments, difference = CONFLICTS[case]
    declare_queue(management, fresh_vhost, name, arguments)
    file = write(tmp_path, TOPOLOGY)
    before = definitions(management, fresh_vhost)

    result = run_cli("apply", file, settings=fresh_vhost)
    assert result.code == 3
    assert result.out == ""
    assert result.err.splitlines() == [
        f"error: queue {name} in vhost {fresh_vhost.vhost!r} differs from the file: "
        f"{difference}; migrate keeps its 0 messages",
        f"error: nothing was changed; `rabbit-retry migrate {file}` rebuilds these queues and "
        "keeps their messages",
    ]
    assert definitions(management, fresh_vhost) == before

    plan = run_cli("plan", file, settings=fresh_vhost)
    assert plan.code == 3
    assert (
        f"migrate   queue    {name}  ({difference}; migrate keeps its 0 messages)"
        in plan.out.splitlines()
    )
    assert plan.err == (
        f"error: 1 queue must be rebuilt to match {file} (the broker cannot change them in "
        f"place); apply would refuse; `rabbit-retry migrate {file}` does it and keeps their "
        "messages\n"
    )
    assert definitions(management, fresh_vhost) == before


# --- changing delays, pruning ----------------------------------------------------------------

DELAYS = """\
version: 1
queues:
  jobs:
    queue_type: {queue_type}
    retry: {{delays: [{delays}], max_attempts: 4}}
"""


def test_changing_delays_is_additive_and_moves_the_first_tier_key(
    tmp_path: Path, fresh_vhost: Settings, management: Management, run_cli: RunCli
) -> None:
    # Long delays: nothing expires while the test counts.
    v1 = write(tmp_path, DELAYS.format(queue_type="quorum", delays="1m, 2m"), "v1.yml")
    v2 = write(tmp_path, DELAYS.format(queue_type="quorum", delays="90s, 2m"), "v2.yml")
    assert run_cli("apply", v1, settings=fresh_vhost).code == 0
    before = queues(management, fresh_vhost)

    result = run_cli("apply", v2, settings=fresh_vhost)
    assert (result.code, result.err) == (0, "")
    assert result.out.splitlines() == [
        f"created 0 exchanges, 1 queue and 2 bindings in vhost {fresh_vhost.vhost!r}",
        "unbound jobs.retry -> jobs.retry.1m [jobs]: jobs.retry.1m is no longer the first "
        "tier of jobs",
        "left jobs.retry.1m (obsolete, empty); apply --prune deletes it once empty",
    ]
    after = queues(management, fresh_vhost)
    assert set(after) == set(before) | {"jobs.retry.90s"}
    assert {name: after[name] for name in before} == before  # nothing redeclared differently
    assert bindings(management, fresh_vhost) == {
        ("jobs.retry", "jobs.retry.1m", "1m"),  # old tier stays reachable by its label
        ("jobs.retry", "jobs.retry.2m", "2m"),
        ("jobs.retry", "jobs.retry.90s", "90s"),
        ("jobs.retry", "jobs.retry.90s", "jobs"),
    }

    # What the broker dead-letters from `jobs` goes to the new first tier, and only there.
    publish(fresh_vhost, "jobs.retry", "jobs", 3)
    assert counts(fresh_vhost, "jobs", "jobs.retry.1m", "jobs.retry.2m", "jobs.retry.90s") == {
        "jobs": 0, "jobs.retry.1m": 0, "jobs.retry.2m": 0, "jobs.retry.90s": 3,
    }


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_prune_removes_only_empty_obsolete_tiers(
    queue_type: str,
    tmp_path: Path,
    fresh_vhost: Settings,
    management: Management,
    run_cli: RunCli,
) -> None:
    v1 = write(tmp_path, DELAYS.format(queue_type=queue_type, delays="10m, 20m, 30m"), "v1.yml")
    v2 = write(tmp_path, DELAYS.format(queue_type=queue_type, delays="1h"), "v2.yml")
    assert run_cli("apply", v1, settings=fresh_vhost).code == 0
    publish(fresh_vhost, "jobs.retry", "jobs", 2)  # dead letters, waiting in the first tier
    publish(fresh_vhost, "", "jobs", 1)
    publish(fresh_vhost, "", "jobs.parking", 1)

    result = run_cli("apply", v2, "--prune", settings=fresh_vhost)
    assert (result.code, result.err) == (0, "")
    lines = result.out.splitlines()
    assert lines[:2] == [
        f"created 0 exchanges, 1 queue and 2 bindings in vhost {fresh_vhost.vhost!r}",
        "unbound jobs.retry -> jobs.retry.10m [jobs]: jobs.retry.10m is no longer the first "
        "tier of jobs",
    ]
    assert sorted(lines[2:]) == [
        "kept jobs.retry.10m (obsolete, 2 messages still in it); prune again once it has "
        "drained",
        "pruned jobs.retry.20m (obsolete, empty)",
        "pruned jobs.retry.30m (obsolete, empty)",
    ]
    assert set(queues(management, fresh_vhost)) == {
        "jobs", "jobs.parking", "jobs.retry.10m", "jobs.retry.1h",
    }
    assert counts(fresh_vhost, "jobs", "jobs.parking", "jobs.retry.10m", "jobs.retry.1h") == {
        "jobs": 1, "jobs.parking": 1, "jobs.retry.10m": 2, "jobs.retry.1h": 0,
    }
    # The kept tier is still reachable by its label (a retry aimed at it is not lost), but no
    # longer by the main queue's key: dead letters go to the new first tier alone.
    assert bindings(management, fresh_vhost) == {
        ("jobs.retry", "jobs.retry.10m", "10m"),
        ("jobs.retry", "jobs.retry.1h", "1h"),
        ("jobs.retry", "jobs.retry.1h", "jobs"),
    }

    # Without --prune nothing is deleted, and once drained the tier goes.
    asyncio.run(_purge(fresh_vhost, "jobs.retry.10m"))
    plain = run_cli("apply", v2, settings=fresh_vhost)
    assert plain.code == 0
    assert "jobs.retry.10m" in queues(management, fresh_vhost)
    pruned = run_cli("apply", v2, "--prune", settings=fresh_vhost)
    assert pruned.out.splitlines() == ["pruned jobs.retry.10m (obsolete, empty)"]
    assert set(queues(management, fresh_vhost)) == {"jobs", "jobs.parking", "jobs.retry.1h"}


async def _purge(settings: Settings, name: str) -> None:
    connection = await aio_pika.connect(settings.url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, passive=True)
        await queue.purge()


# --- export ----------------------------------------------------------------------------------


def test_exported_definitions_import_to_the_same_objects(
    tmp_path: Path,
    vhost_factory: Callable[[], Settings],
    management: Management,
    run_cli: RunCli,
) -> None:
    applied, imported = vhost_factory(), vhost_factory()
    try:
        file = write(tmp_path, TOPOLOGY)
        assert run_cli("apply", file, settings=applied).code == 0
        out = tmp_path / "definitions.json"
        result = run_cli("export", file, "--format", "definitions", "--out", str(out))
        assert (result.code, result.out, result.err) == (0, "", f"wrote {out}\n")
        import_definitions(management, imported.vhost, json.loads(out.read_text()))

        assert queues(management, imported) == queues(management, applied) == EXPECTED_QUEUES
        assert exchanges(management, imported) == exchanges(management, applied)
        assert bindings(management, imported) == bindings(management, applied)
        # An imported vhost is one that `apply` considers done.
        again = run_cli("apply", file, settings=imported)
        assert again.out == f"nothing to do: vhost {imported.vhost!r} already matches {file}\n"
    finally:
        delete_vhost(management, applied.vhost)
        delete_vhost(management, imported.vhost)


def test_export_mermaid_and_stdout(tmp_path: Path, run_cli: RunCli) -> None:
    file = write(tmp_path, TOPOLOGY)
    mermaid = run_cli("export", file, "--format", "mermaid")
    assert mermaid.code == 0, mermaid.err
    assert mermaid.out.strip()
    assert "orders.fraud-check.retry.200ms" in mermaid.out
    stdout = run_cli("export", file, "--format", "definitions")
    assert stdout.code == 0
    assert {q["name"] for q in json.loads(stdout.out)["queues"]} == set(EXPECTED_QUEUES)
    bad = run_cli("export", file, "--format", "dot")
    assert bad.code == 2


# --- validate --------------------------------------------------------------------------------


def test_validate_lists_what_it_would_create(tmp_path: Path, run_cli: RunCli) -> None:
    file = write(tmp_path, TOPOLOGY)
    result = run_cli("validate", file)
    assert (result.code, result.err) == (0, "")
    lines = result.out.splitlines()
    assert lines[0] == f"{file}: valid; 3 exchanges, 7 queues, 7 bindings"
    assert "  queue    orders.email.retry.1s  (classic, tier, ttl 1s)" in lines
    assert "  binding  orders -> orders.email [order.*]" in lines
    # Where Outbox.add of this file may send an event (README, "The outbox").
    assert lines[-1] == ("outbox destinations: exchanges orders; queues orders.email, "
                         "orders.fraud-check")
    assert len(lines) == 1 + 17 + 1


def test_validate_bad_file_exits_2(tmp_path: Path, run_cli: RunCli) -> None:
    file = write(tmp_path, TOPOLOGY.replace("max_attempts: 3", "max_attempts: 0"))
    result = run_cli("validate", file)
    assert result.code == 2
    assert result.out == ""
    assert result.err == (
        f"error: {file}:8: queues.orders.fraud-check.retry.max_attempts: must be at least 1, "
        "got 0\n"
    )


# --- what apply refuses before touching anything ---------------------------------------------


def test_names_amqp_clients_cannot_send_exit_2_and_touch_nothing(
    tmp_path: Path, fresh_vhost: Settings, management: Management, run_cli: RunCli
) -> None:
    # RabbitMQ would take it; pamqp, under aio-pika, refuses to send it (declare, consume or
    # publish). The loader says so first; apply's own check (unit-tested) is the backstop.
    file = write(tmp_path, TOPOLOGY.replace("orders.email", "orders.émail"))
    for args in (("apply", file), ("apply", file, "--dry-run")):
        result = run_cli(*args, settings=fresh_vhost)
        assert result.code == 2
        assert result.out == ""
        [line] = result.err.splitlines()
        assert line.startswith(f"error: {file}:9: queues.orders.émail: ")
        assert "AMQP" in line
    assert is_empty(management, fresh_vhost)


def test_quorum_queues_beyond_the_brokers_file_handles_are_refused(
    tmp_path: Path, fresh_vhost: Settings, management: Management, run_cli: RunCli
) -> None:
    # Enough queues x 3 tiers to go past what a 3.x node holds: at the default open-file limit
    # of 1024, 100 main queues (400 quorum queues) are far too many; a node with a raised limit
    # gets more. Nothing is declared either way, so the size costs the broker nothing.
    capacity = read_capacity(management)
    assert capacity.fd_total is not None, capacity
    many = max(100, capacity.fd_total // 4)
    text = "version: 1\ndefaults: {retry: {delays: [1s, 2s, 3s]}}\nqueues:\n" + "".join(
        f"  big.q{i}: {{}}\n" for i in range(many)
    )
    file = write(tmp_path, text)
    # The file is too big for a 3.x node with this open-file limit, whatever the version here.
    as_3x = replace(capacity, version="3.13.7")
    # Per main queue: itself, three tiers and its parking queue.
    assert capacity_problem(as_3x, 5 * many) is not None, as_3x
    dry = run_cli("apply", file, "--dry-run", settings=fresh_vhost)
    assert dry.code == 0, dry.err
    assert dry.out.endswith("dry run: nothing was changed\n")
    assert dry.out.count("(quorum, ") == 5 * many  # what the check weighs
    if version(management) >= (4, 0):
        # 4.x holds no file handles per quorum queue (no file handle cache): no budget applies,
        # so the same file passes the check `apply` makes before it declares anything.
        assert capacity_problem(capacity, 5 * many) is None, capacity
        assert dry.err == "", f"RabbitMQ {capacity.version}: {dry.err}"
        assert is_empty(management, fresh_vhost)
        return
    assert f"warning: apply would refuse: refusing to declare {5 * many} quorum queues" in dry.err
    result = run_cli("apply", file, settings=fresh_vhost)
    assert result.code == 1
    assert result.out == ""
    assert result.err.startswith(
        f"error: refusing to declare {5 * many} quorum queues: the broker would hold "
    )
    assert result.err.endswith("or use classic queues for some; nothing was changed\n")
    assert result.err.count("\n") == 1
    assert is_empty(management, fresh_vhost)


# --- the broker is not there, or not as the URL says ----------------------------------------


def test_missing_vhost_is_one_line_exit_1(
    tmp_path: Path, fresh_vhost: Settings, run_cli: RunCli
) -> None:
    missing = fresh_vhost.for_vhost(fresh_vhost.vhost + "-missing")
    file = write(tmp_path, TOPOLOGY)
    for verb in ("apply", "plan"):
        result = run_cli(verb, file, settings=missing)
        assert result.code == 1
        assert result.out == ""
        assert result.err == f"error: vhost {missing.vhost!r} does not exist on the broker\n"


def _with_password(url: str, password: str) -> str:
    scheme, rest = url.split("://", 1)
    user = rest.split(":", 1)[0]
    host = rest.split("@", 1)[1]
    return f"{scheme}://{user}:{password}@{host}"


def test_wrong_password_is_one_line_exit_1_without_the_password(
    tmp_path: Path, fresh_vhost: Settings, management: Management, run_cli: RunCli
) -> None:
    file = write(tmp_path, TOPOLOGY)
    secret = "s3cr3t-Pa55"
    wrong_amqp = Settings(_with_password(fresh_vhost.url, secret), fresh_vhost.management_url)
    result = run_cli("apply", file, settings=wrong_amqp)
    assert result.code == 1
    assert secret not in result.out + result.err
    assert result.err == (
        f"error: broker at {wrong_amqp.safe_url} refused the credentials (wrong user or "
        "password)\n"
    )
    assert is_empty(management, fresh_vhost)

    wrong_http = Settings(fresh_vhost.url, _with_password(fresh_vhost.management_url, secret))
    for verb in ("apply", "plan"):
        result = run_cli(verb, file, settings=wrong_http)
        assert result.code == 1
        assert secret not in result.out + result.err
        assert len(result.err.splitlines()) == 1
        assert "refused the credentials (401)" in result.err


def test_unreachable_broker_is_one_line_exit_1(
    tmp_path: Path, fresh_vhost: Settings, management: Management, run_cli: RunCli
) -> None:
    file = write(tmp_path, TOPOLOGY)
    secret = "guest"  # the real password must not leak either
    parts = urlsplit(fresh_vhost.url)
    closed_port = parts._replace(netloc=parts.netloc.rsplit(":", 1)[0] + ":1")
    nowhere = Settings(urlunsplit(closed_port), fresh_vhost.management_url)
    result = run_cli("apply", file, settings=nowhere)
    assert result.code == 1
    assert result.err.count("\n") == 1
    assert result.err.startswith(f"error: broker at {nowhere.safe_url} is unreachable")
    assert f":{secret}@" not in result.err
    assert "Traceback" not in result.err
    assert is_empty(management, fresh_vhost)
