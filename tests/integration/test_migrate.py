"""``rabbit-retry migrate`` on a real broker: classic to quorum and back, a changed immutable
argument, tiers and parking queues with their messages, the plan's words, the refusals, and a
worker that follows its queue through the migration."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import pytest
from support.amqp import blocking, depth_sync, drain_sync, persistent, publish, publish_stream
from support.poll import eventually
from support.provision import topology
from support.worker import running

from rabbit_retry import Delivery, RetryConsumer
from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

Q = "mig.orders"
TIERS = (f"{Q}.retry.1h", f"{Q}.retry.2h")


def _file(queue_type: str, arguments: str = "") -> str:
    return f"""\
version: 1
exchanges:
  shop: {{type: topic}}
queues:
  {Q}:
    queue_type: {queue_type}
    bindings: [{{exchange: shop, routing_key: "order.*"}}]
    retry: {{delays: [1h, 2h], max_attempts: 3}}
{arguments}"""


def _write(tmp_path: Path, text: str, name: str = "mig.yml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _ids(settings: Settings, queue: str) -> Counter[str]:
    return Counter(str(m.message_id) for m in drain_sync(settings, queue))


def _type(management: Management, settings: Settings, queue: str) -> str:
    info = management.queue(settings.vhost, queue)
    assert info is not None, queue
    return str(info["type"])


def _fill(settings: Settings) -> None:
    """300 messages through the exchange, 20 in each tier, 10 parked."""

    async def go() -> None:
        await publish_stream(settings, "order.created", 300,
                             lambda i: persistent(b"{}", message_id=f"main-{i}"), exchange="shop")
        for tier in TIERS:
            await publish_stream(settings, tier, 20,
                                 lambda i, t=tier: persistent(b"{}", message_id=f"{t}-{i}"))
        await publish_stream(settings, f"{Q}.parking", 10,
                             lambda i: persistent(b"{}", message_id=f"parked-{i}"))

    blocking(go())


def test_classic_to_quorum_keeps_every_message_of_the_queue_its_tiers_and_parking(
    tmp_path: Path, fresh_vhost: Settings, management: Management, run_cli: Callable[..., object]
) -> None:
    old = _write(tmp_path, _file("classic"), "old.yml")
    assert run_cli("apply", old, settings=fresh_vhost).code == 0  # type: ignore[attr-defined]
    _fill(fresh_vhost)
    new = _write(tmp_path, _file("quorum"), "new.yml")

    plan = run_cli("plan", new, settings=fresh_vhost)
    assert plan.code == 3  # type: ignore[attr-defined]
    lines = plan.out.splitlines()  # type: ignore[attr-defined]
    main_line = next(line for line in lines if line.startswith(f"migrate   queue    {Q} "))
    assert "type: live classic, file quorum" in main_line
    assert "migrate keeps its" in main_line
    # Q, its two tiers and its parking queue (which follows Q's type)
    assert sum(1 for line in lines if line.startswith("migrate ")) == 4
    assert "1 to migrate" not in plan.out  # type: ignore[attr-defined]
    assert "4 to migrate" in plan.out  # type: ignore[attr-defined]
    assert "`rabbit-retry migrate" in plan.err  # type: ignore[attr-defined]

    refused = run_cli("apply", new, settings=fresh_vhost)
    assert refused.code == 3  # type: ignore[attr-defined]
    assert f"`rabbit-retry migrate {new}` rebuilds these queues" in refused.err  # type: ignore[attr-defined]

    dry = run_cli("migrate", new, "--dry-run", settings=fresh_vhost)
    assert dry.code == 0, dry.err  # type: ignore[attr-defined]
    assert "dry run: nothing was changed" in dry.out  # type: ignore[attr-defined]
    assert f"  drain         move the messages of {Q} into {Q}.migrating" in dry.out  # type: ignore[attr-defined]
    # Tiers are held while their main queue is rebuilt: none can expire into a missing queue.
    assert (  # type: ignore[attr-defined]
        f"order: {TIERS[0]} (hold..drain), {TIERS[1]} (hold..drain), {Q} (hold..refill), "
        f"{TIERS[0]} (release..refill), {TIERS[1]} (release..refill), {Q}.parking (hold..refill)"
    ) in dry.out.splitlines()  # type: ignore[attr-defined]
    no_terminal = run_cli("migrate", new, settings=fresh_vhost)
    assert no_terminal.code == 2  # type: ignore[attr-defined]
    assert no_terminal.err == (  # type: ignore[attr-defined]
        "error: refusing to migrate without confirmation: stdin is not a terminal; pass --yes\n"
    )
    assert _type(management, fresh_vhost, Q) == "classic"
    assert depth_sync(fresh_vhost, Q) == 300

    done = run_cli("migrate", new, "--yes", settings=fresh_vhost)
    assert done.code == 0, done.err  # type: ignore[attr-defined]
    assert f"migrated 4 queues in vhost {fresh_vhost.vhost!r}" in done.out  # type: ignore[attr-defined]
    for name in (Q, *TIERS, f"{Q}.parking"):
        assert _type(management, fresh_vhost, name) == "quorum"
        assert management.queue(fresh_vhost.vhost, f"{name}.migrating") is None
    again = run_cli("plan", new, settings=fresh_vhost)
    assert again.code == 0, again.out  # type: ignore[attr-defined]

    # Publishing through the exchange reaches the new queue.
    blocking(publish(fresh_vhost, b"{}", exchange="shop", routing_key="order.paid",
                     message_id="after"))
    main = _ids(fresh_vhost, Q)
    assert main == Counter({f"main-{i}": 1 for i in range(300)} | {"after": 1})
    for tier in TIERS:
        assert _ids(fresh_vhost, tier) == Counter({f"{tier}-{i}": 1 for i in range(20)})
    assert _ids(fresh_vhost, f"{Q}.parking") == Counter({f"parked-{i}": 1 for i in range(10)})


def test_quorum_to_classic_and_a_new_immutable_argument(
    tmp_path: Path, fresh_vhost: Settings, management: Management, run_cli: Callable[..., object]
) -> None:
    old = _write(tmp_path, _file("quorum"), "old.yml")
    assert run_cli("apply", old, settings=fresh_vhost).code == 0  # type: ignore[attr-defined]
    blocking(publish_stream(fresh_vhost, "order.created", 50,
                            lambda i: persistent(b"{}", message_id=f"m-{i}"), exchange="shop"))
    limited = _write(tmp_path, _file("quorum", "    arguments: {x-delivery-limit: 7}\n"), "l.yml")
    done = run_cli("migrate", limited, "--yes", settings=fresh_vhost)
    assert done.code == 0, done.err  # type: ignore[attr-defined]
    assert "migrated 1 queue " in done.out  # type: ignore[attr-defined]
    info = management.queue(fresh_vhost.vhost, Q)
    assert info is not None and info["arguments"]["x-delivery-limit"] == 7

    classic = _write(tmp_path, _file("classic"), "c.yml")
    done = run_cli("migrate", classic, "--yes", settings=fresh_vhost)
    assert done.code == 0, done.err  # type: ignore[attr-defined]
    assert _type(management, fresh_vhost, Q) == "classic"
    assert _ids(fresh_vhost, Q) == Counter({f"m-{i}": 1 for i in range(50)})
    nothing = run_cli("migrate", classic, "--yes", settings=fresh_vhost)
    assert nothing.out.startswith("nothing to migrate")  # type: ignore[attr-defined]


class Seen(RetryConsumer):
    queue = Q
    handled: list[str] = []

    async def handle(self, delivery: Delivery) -> None:
        Seen.handled.append(str(delivery.message_id))


def test_a_worker_consuming_the_queue_follows_it_through_the_migration(
    tmp_path: Path, fresh_vhost: Settings, run_cli: Callable[..., object]
) -> None:
    old = _write(tmp_path, _file("classic"), "old.yml")
    assert run_cli("apply", old, settings=fresh_vhost).code == 0  # type: ignore[attr-defined]
    new_text = _file("quorum")
    new = _write(tmp_path, new_text, "new.yml")
    Seen.handled = []

    async def go() -> None:
        async with running([Seen()], topology(new_text, new), fresh_vhost):
            await publish(fresh_vhost, b"{}", exchange="shop", routing_key="order.x",
                          message_id="before")
            await eventually(lambda: "before" in Seen.handled, what="handled before")
            done = await asyncio.to_thread(run_cli, "migrate", new, "--yes",
                                           settings=fresh_vhost)
            assert done.code == 0, done.err  # type: ignore[attr-defined]
            assert f"{Q}: closed consumer connection " in done.out  # type: ignore[attr-defined]
            await publish(fresh_vhost, b"{}", exchange="shop", routing_key="order.x",
                          message_id="after")
            await eventually(lambda: "after" in Seen.handled, within=60,
                             what="handled after the migration")

    asyncio.run(go())
    assert Seen.handled.count("after") == 1


def test_a_policy_that_would_drop_held_messages_stops_migrate_before_anything_changes(
    tmp_path: Path, fresh_vhost: Settings, management: Management, run_cli: Callable[..., object]
) -> None:
    old = _write(tmp_path, _file("classic"), "old.yml")
    assert run_cli("apply", old, settings=fresh_vhost).code == 0  # type: ignore[attr-defined]
    path = f"/policies/{quote(fresh_vhost.vhost, safe='')}/short"
    management.request("PUT", path, json={"pattern": "^mig\\.orders\\.", "apply-to": "queues",
                                          "definition": {"message-ttl": 1}, "priority": 0})
    new = _write(tmp_path, _file("quorum"), "new.yml")
    refused = run_cli("migrate", new, "--yes", settings=fresh_vhost)
    assert refused.code == 3  # type: ignore[attr-defined]
    assert refused.err.splitlines() == [  # type: ignore[attr-defined]
        f"error: policy short (message-ttl) would apply to the holding queue {name}.migrating "
        "and could drop messages while they wait there; narrow its pattern first"
        for name in (Q, *TIERS, f"{Q}.parking")
    ] + ["error: nothing was changed"]
    assert _type(management, fresh_vhost, Q) == "classic"
    assert management.queue(fresh_vhost.vhost, f"{Q}.migrating") is None


def test_migrate_runs_the_open_file_guard_of_apply_before_anything_changes(
    tmp_path: Path, fresh_vhost: Settings, management: Management,
    run_cli: Callable[..., object], monkeypatch: pytest.MonkeyPatch,
) -> None:
    old = _write(tmp_path, _file("classic"), "old.yml")
    assert run_cli("apply", old, settings=fresh_vhost).code == 0  # type: ignore[attr-defined]
    new = _write(tmp_path, _file("quorum"), "new.yml")
    # A 3.x node whose open-file limit has room for two quorum queues, not the four this
    # migration adds (the main queue, its two tiers and its parking queue, which follows it).
    from rabbit_retry.broker.inspect import NodeCapacity
    from rabbit_retry.cli import provision

    small = NodeCapacity(version="3.10.8", fd_total=70, quorum_queues=0)
    monkeypatch.setattr(provision, "read_capacity", lambda api: small)
    dry = run_cli("migrate", new, "--dry-run", settings=fresh_vhost)
    assert dry.code == 0  # type: ignore[attr-defined]
    assert dry.err.startswith(  # type: ignore[attr-defined]
        "warning: migrate would refuse: refusing to declare 4 quorum queues")
    refused = run_cli("migrate", new, "--yes", settings=fresh_vhost)
    assert refused.code == 1  # type: ignore[attr-defined]
    assert refused.err.startswith(  # type: ignore[attr-defined]
        "error: refusing to declare 4 quorum queues: the broker would hold 4, and RabbitMQ "
        "3.10.8 with an open-file limit of 70 holds about 2")
    assert _type(management, fresh_vhost, Q) == "classic"
    assert management.queue(fresh_vhost.vhost, f"{Q}.migrating") is None
    # Positive control: with room for them, the same migration goes through.
    monkeypatch.setattr(provision, "read_capacity",
                        lambda api: NodeCapacity(version="3.10.8", fd_total=1024,
                                                 quorum_queues=0))
    done = run_cli("migrate", new, "--yes", settings=fresh_vhost)
    assert done.code == 0, done.err  # type: ignore[attr-defined]
    assert _type(management, fresh_vhost, Q) == "quorum"
