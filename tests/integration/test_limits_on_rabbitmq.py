"""Length limits and TTLs on a real broker, counted message by message: every message published
is in its queue, in its parking queue (with the reason it left), refused to its publisher, or
dropped where the file says ``drop``; none goes round a retry tier that the broker breaks by
dropping it (``Dead-letter queues cycle detected``). Runs on every version: the routes and the
overflow behaviours differ between classic and quorum queues and between 3.10, 4.0 and 4.3."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiormq import spec
from support.amqp import blocking, depth, drain, on_channel, publish, publish_each, publish_raw
from support.poll import wait_for

from rabbit_retry import contract
from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

N = 8


def _write(tmp_path: Path, text: str, name: str = "limits.yml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _queue(name: str, queue_type: str, body: str, delay: str = "2s") -> str:
    return (f"  {name}:\n    queue_type: {queue_type}\n    retry: {{delays: [{delay}]}}\n"
            f"{body}")


def _depths(settings: Settings, *queues: str) -> dict[str, int | None]:
    return {q: blocking(depth(settings, q)) for q in queues}


def _apply(run_cli: Callable[..., Any], settings: Settings, file: str, *more: str) -> Any:
    result = run_cli("apply", file, *more, settings=settings)
    assert result.code == 0, result.err
    return result


def _bodies(prefix: str, count: int = N) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(count)]


def _held_then_limited(tmp_path: Path, run_cli: Callable[..., Any], settings: Settings, q: str,
                       held: int, limit: str) -> str:
    """Classic queue ``q`` applied without a limit and ``held`` messages published to it; the
    file that gives it ``limit`` (``policy: {max_length: N}``, ``arguments: {x-max-length: N}``)
    and parks what does not fit, to plan, apply or migrate."""
    plain = _write(tmp_path, "version: 1\nqueues:\n" + _queue(q, "classic", ""), "plain.yml")
    _apply(run_cli, settings, plain)
    blocking(publish(settings, b"x", routing_key=q, count=held))
    return _write(tmp_path, "version: 1\nqueues:\n" + _queue(
        q, "classic", f"    {limit}\n    on_full: park\n"), "limited.yml")


def test_a_full_classic_queue_parks_or_drops_its_oldest_as_the_file_says_and_none_cycles(
    tmp_path: Path, fresh_vhost: Settings, run_cli: Callable[..., Any], management: Management,
) -> None:
    text = "version: 1\nqueues:\n" + _queue(
        "lim.park", "classic", "    policy: {max_length: 5}\n    on_full: park\n"
    ) + _queue(
        "lim.args", "classic", "    arguments: {x-max-length: 5}\n    on_full: park\n"
    ) + _queue(
        "lim.drop", "classic", "    policy: {max_length: 5}\n    on_full: drop\n"
    )
    _apply(run_cli, fresh_vhost, _write(tmp_path, text))
    mgmt = management
    wait_for(lambda: all((mgmt.queue(fresh_vhost.vhost, q) or {}).get("policy")
                         for q in ("lim.park", "lim.drop")), "the policies applied")
    for queue in ("lim.park", "lim.args", "lim.drop"):
        assert blocking(publish_each(fresh_vhost, _bodies(queue), routing_key=queue)) == []

    # Parked: the 3 oldest in the parking queue, the 5 newest in the queue: 8 of 8.
    for queue in ("lim.park", "lim.args"):
        parked = wait_for(lambda q=queue: _depths(fresh_vhost, f"{q}.parking")[f"{q}.parking"]
                          == 3, f"3 messages parked from {queue}")
        assert parked
        assert _depths(fresh_vhost, queue, f"{queue}.retry.2s") == {
            queue: 5, f"{queue}.retry.2s": 0}
    # Dropped, as the file says: 5 in the queue, none parked or waiting in a tier.
    assert _depths(fresh_vhost, "lim.drop", "lim.drop.parking", "lim.drop.retry.2s") == {
        "lim.drop": 5, "lim.drop.parking": 0, "lim.drop.retry.2s": 0}

    # In order, each message once, and each parked one says why it left. (Routed to the tier,
    # the 3 would have waited there and been dropped on their way back.)
    for queue in ("lim.park", "lim.args"):
        kept = blocking(drain(fresh_vhost, queue))
        assert [m.body for m in kept] == _bodies(queue)[3:]
    parked = blocking(drain(fresh_vhost, "lim.park.parking"))
    assert [m.body for m in parked] == _bodies("lim.park")[:3]
    assert [contract.parked_reason(m.headers) for m in parked] == ["queue-full"] * 3
    # An operator selects them by that reason, as `parking show` gives it (the broker wrote no
    # parked-reason header: the reason is its x-death's).
    for reason, left in (("expired", 3), ("queue-full", 0)):
        done = run_cli("parking", "purge", "lim.args", "--where", f"parked-reason={reason}",
                       "--yes", settings=fresh_vhost)
        assert done.code == 0, done.err
        assert _depths(fresh_vhost, "lim.args.parking") == {"lim.args.parking": left}, reason
    assert [m.body for m in blocking(drain(fresh_vhost, "lim.drop"))] == _bodies("lim.drop")[3:]


def test_a_full_quorum_queue_refuses_publishes_and_still_takes_back_its_retries(
    tmp_path: Path, fresh_vhost: Settings, run_cli: Callable[..., Any], management: Management,
) -> None:
    q = "lim.quorum"
    text = "version: 1\nqueues:\n" + _queue(
        q, "quorum", "    policy: {max_length: 5}\n    on_full: reject\n", delay="1s")
    _apply(run_cli, fresh_vhost, _write(tmp_path, text))
    mgmt = management
    wait_for(lambda: (mgmt.queue(fresh_vhost.vhost, q) or {}).get("policy"),
             "the policy applied")
    refused = blocking(publish_each(fresh_vhost, _bodies(q), routing_key=q))
    accepted = _bodies(q)[: N - len(refused)]
    # The publisher is told of each one refused: nothing quietly lost. (A quorum queue checks
    # its limit before each enqueue; some versions take one more than the limit.)
    assert refused == _bodies(q)[len(accepted):] and len(accepted) in (5, 6), refused
    assert _depths(fresh_vhost, q, f"{q}.parking") == {q: len(accepted), f"{q}.parking": 0}

    # A retry copy (as the worker sends one) waits its delay, then comes back to the full
    # queue: a quorum tier dead-letters at least once, so it reaches the queue, never nowhere.
    assert blocking(publish_each(fresh_vhost, [b"retried"], exchange=f"{q}.retry",
                                 routing_key="1s")) == []
    taken: list[bytes] = []

    def everything_back() -> bool:
        taken.extend(m.body for m in blocking(drain(fresh_vhost, q)))
        return len(taken) >= len(accepted) + 1

    wait_for(everything_back, "the accepted messages and the retried one")
    assert sorted(taken) == sorted([*accepted, b"retried"])
    assert _depths(fresh_vhost, q, f"{q}.parking", f"{q}.retry.1s") == {
        q: 0, f"{q}.parking": 0, f"{q}.retry.1s": 0}


def test_expired_messages_are_parked_from_classic_and_quorum_queues_saying_so(
    tmp_path: Path, fresh_vhost: Settings, run_cli: Callable[..., Any], management: Management,
) -> None:
    text = "version: 1\nqueues:\n" + "".join(
        _queue(f"lim.ttl.{kind}", kind, "    policy: {message_ttl: 300ms}\n"
                                        "    on_expire: park\n")
        for kind in ("classic", "quorum")) + _queue("lim.ttl.own", "classic",
                                                    "    on_expire: park\n")
    _apply(run_cli, fresh_vhost, _write(tmp_path, text))
    mgmt = management
    for kind in ("classic", "quorum"):
        q = f"lim.ttl.{kind}"
        wait_for(lambda q=q: (mgmt.queue(fresh_vhost.vhost, q) or {}).get("policy"),
                 "the policy applied")
        assert blocking(publish_each(fresh_vhost, _bodies(q), routing_key=q)) == []
    for kind in ("classic", "quorum"):
        q = f"lim.ttl.{kind}"
        wait_for(lambda q=q: _depths(fresh_vhost, f"{q}.parking")[f"{q}.parking"] == N,
                 f"{N} expired messages parked from {q}")
        assert _depths(fresh_vhost, q, f"{q}.retry.2s") == {q: 0, f"{q}.retry.2s": 0}
        parked = blocking(drain(fresh_vhost, f"{q}.parking"))
        assert sorted(m.body for m in parked) == sorted(_bodies(q))
        assert {contract.parked_reason(m.headers) for m in parked} == {"expired"}

    # A TTL the publisher set on each message (no TTL in the file): parked all the same.
    q = "lim.ttl.own"
    blocking(publish_raw(fresh_vhost, [
        (body, spec.Basic.Properties(delivery_mode=2, expiration="300")) for body in _bodies(q)
    ], routing_key=q))
    wait_for(lambda: _depths(fresh_vhost, f"{q}.parking")[f"{q}.parking"] == N,
             f"{N} expired messages parked from {q}")
    assert _depths(fresh_vhost, q, f"{q}.retry.2s") == {q: 0, f"{q}.retry.2s": 0}
    assert [m.body for m in blocking(drain(fresh_vhost, f"{q}.parking"))] == _bodies(q)


def test_lowering_a_live_limit_names_the_evicted_and_applies_only_when_accepted(
    tmp_path: Path, fresh_vhost: Settings, run_cli: Callable[..., Any], management: Management,
) -> None:
    q = "lim.live"
    limited = _held_then_limited(tmp_path, run_cli, fresh_vhost, q, 800,
                                 "policy: {max_length: 600}")

    planned = run_cli("plan", limited, settings=fresh_vhost)
    assert planned.code == 0, planned.err
    assert (f"evicts    queue    {q}  (max_length absent -> 600: 200 of its 800 messages leave "
            f"it at once, parked in {q}.parking)") in planned.out
    assert f"unbind    binding  {q}.retry -> {q}.retry.2s [{q}]" in planned.out
    assert f"create    binding  {q}.retry -> {q}.parking [{q}]" in planned.out
    as_json = run_cli("plan", limited, "--json", settings=fresh_vhost)
    [eviction] = json.loads(as_json.out)["evictions"]
    assert (eviction["queue"], eviction["count"], eviction["messages"], eviction["to"]) == (
        q, 200, 800, f"{q}.parking")

    refused = run_cli("apply", limited, settings=fresh_vhost)
    assert refused.code == 3
    assert refused.err.strip().splitlines() == [
        f"error: queue {q}: max_length absent -> 600: 200 of its 800 messages leave it at "
        f"once, parked in {q}.parking",
        "error: nothing was changed; pass --accept-evictions to make this change",
    ]
    mgmt = management
    assert (mgmt.queue(fresh_vhost.vhost, q) or {}).get("policy") is None
    assert _depths(fresh_vhost, q, f"{q}.parking") == {q: 800, f"{q}.parking": 0}

    accepted = _apply(run_cli, fresh_vhost, limited, "--accept-evictions")
    assert (f"evicted from {q}: max_length absent -> 600: at least 200 of its 800 messages left "
            f"it, parked in {q}.parking (counted just before the policy was set; messages that "
            "arrived in between left too)") in accepted.out
    wait_for(lambda: _depths(fresh_vhost, f"{q}.parking")[f"{q}.parking"] == 200,
             "200 messages parked")
    assert _depths(fresh_vhost, q, f"{q}.retry.2s") == {q: 600, f"{q}.retry.2s": 0}
    again = run_cli("plan", limited, settings=fresh_vhost)
    assert again.code == 0 and "evicts" not in again.out


@pytest.mark.parametrize("accept", [True, False])
def test_messages_that_arrive_while_apply_runs_are_counted_before_a_lower_limit_evicts_them(
    accept: bool, tmp_path: Path, fresh_vhost: Settings, run_cli: Callable[..., Any],
    management: Management, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """apply counted the queue when it read the broker and set the policy later: what arrived
    in between was evicted too and never counted (150 held, 100 arriving, a limit of 100:
    150 evicted, "50 of its 150" said), and a queue below the limit then, over it when the
    policy came, lost messages without --accept-evictions. The 100 are published once apply
    has read the queue and decided, as its policies are about to be set."""
    from rabbit_retry.cli import provision

    q = "lim.late"
    held = 150 if accept else 80
    limited = _held_then_limited(tmp_path, run_cli, fresh_vhost, q, held,
                                 "policy: {max_length: 100}")
    around_routes = provision.around_routes

    def arriving(*args: Any) -> Any:
        blocking(publish(fresh_vhost, b"late", routing_key=q, count=100))
        return around_routes(*args)

    monkeypatch.setattr(provision, "around_routes", arriving)
    if accept:
        done = _apply(run_cli, fresh_vhost, limited, "--accept-evictions")
        assert (f"evicted from {q}: max_length absent -> 100: at least 150 of its 250 messages "
                f"left it, parked in {q}.parking") in done.out
        return
    refused = run_cli("apply", limited, settings=fresh_vhost)  # 80 < 100: nothing to accept
    assert refused.code == 3, refused.out + refused.err
    assert refused.err.strip().splitlines() == [
        f"error: queue {q}: max_length absent -> 100: 80 of its 180 messages leave it at once, "
        f"parked in {q}.parking",
        "error: messages arrived after apply counted 1 queue: its policy was not set (what "
        "apply changed before stays); pass --accept-evictions to make this change",
    ]
    assert (management.queue(fresh_vhost.vhost, q) or {}).get("policy") is None
    assert _depths(fresh_vhost, q, f"{q}.parking") == {q: 180, f"{q}.parking": 0}


def test_why_a_classic_queue_may_not_refuse_publishes_a_returning_retry_is_dropped(
    fresh_vhost: Settings,
) -> None:
    """The broker behaviour behind refusing ``on_full: reject`` on a classic queue (declared by
    hand: the file refuses it). The quorum queue of the test above takes such a retry back."""
    q = "lim.classic.reject"
    tier = {"x-queue-type": "classic", "x-message-ttl": 300, "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": q}
    blocking(on_channel(
        fresh_vhost,
        lambda ch: ch.queue_declare(q, durable=True, arguments={
            "x-queue-type": "classic", "x-max-length": 2, "x-overflow": "reject-publish"}),
        lambda ch: ch.queue_declare(f"{q}.tier", durable=True, arguments=tier),
    ))
    assert blocking(publish_each(fresh_vhost, _bodies(q, 3), routing_key=q)) == [_bodies(q)[2]]
    assert blocking(publish_each(fresh_vhost, [b"retried"], routing_key=f"{q}.tier")) == []
    wait_for(lambda: _depths(fresh_vhost, f"{q}.tier")[f"{q}.tier"] == 0,
             "the retry dead-lettered from its tier")
    # It left the tier and is not in the queue: dropped, no publisher told.
    assert [m.body for m in blocking(drain(fresh_vhost, q))] == _bodies(q)[:2]


def test_migrate_under_a_lower_argument_limit_asks_then_parks_what_does_not_fit(
    tmp_path: Path, fresh_vhost: Settings, run_cli: Callable[..., Any],
) -> None:
    q = "lim.rebuilt"
    limited = _held_then_limited(tmp_path, run_cli, fresh_vhost, q, 300,
                                 "arguments: {x-max-length: 200}")
    line = (f"queue {q}: x-max-length (migrate) absent -> 200: 100 of its 300 messages leave it "
            f"at once, parked in {q}.parking")
    assert f"evicts    queue    {q}  ({line.split(': ', 1)[1]})" in run_cli(
        "plan", limited, settings=fresh_vhost).out

    refused = run_cli("migrate", limited, "--yes", settings=fresh_vhost)
    assert refused.code == 3
    assert refused.err.strip().splitlines()[-2:] == [
        f"error: {line}", "error: nothing was changed; pass --accept-evictions to make this "
        "change"]
    assert _depths(fresh_vhost, q, f"{q}.parking") == {q: 300, f"{q}.parking": 0}

    done = run_cli("migrate", limited, "--yes", "--accept-evictions", settings=fresh_vhost)
    assert done.code == 0, done.err
    wait_for(lambda: _depths(fresh_vhost, f"{q}.parking")[f"{q}.parking"] == 100,
             "100 messages parked")
    assert _depths(fresh_vhost, q, f"{q}.retry.2s") == {q: 200, f"{q}.retry.2s": 0}
    # The route first: what does not fit the rebuilt queue never goes round the tier.
    assert f"bound {q}.retry -> {q}.parking [{q}]" in done.out
    assert f"unbound {q}.retry -> {q}.retry.2s [{q}]" in done.out
    assert f"evicting from {line[len('queue '):]}" in done.out


@pytest.mark.parametrize("when,accept", [("run", True), ("run", False), ("start", False)])
def test_messages_that_arrive_while_migrate_runs_are_counted_before_a_refill_evicts_them(
    when: str, accept: bool, tmp_path: Path, fresh_vhost: Settings, run_cli: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """migrate counted the queue when it read the broker and refilled the rebuilt queue under
    its new x-max-length much later: what arrived in between (while it asked, or while it
    drained and released the queue) was evicted too and never counted (300 held, 100
    arriving, a limit of 200: 200 parked, "100 of its 300" said), and a queue below the limit
    then, over it at the refill, lost messages without --accept-evictions. The 100 are
    published once migrate has decided: as it starts ("start"), or as it releases the queue
    ("run": they land in the queue and are drained into the holding queue)."""
    from rabbit_retry.broker import migrate as migrating
    from rabbit_retry.cli import provision

    q = "lim.rebuilt.late"
    held = 300 if accept else 150
    limited = _held_then_limited(tmp_path, run_cli, fresh_vhost, q, held,
                                 "arguments: {x-max-length: 200}")
    if when == "start":
        routes = provision.dead_letter_routes

        def arriving(*args: Any) -> Any:
            blocking(publish(fresh_vhost, b"late", routing_key=q, count=100))
            return routes(*args)

        monkeypatch.setattr(provision, "dead_letter_routes", arriving)
    else:
        release = migrating._release

        async def arriving_while(*args: Any) -> None:
            await publish(fresh_vhost, b"late", routing_key=q, count=100)
            await release(*args)

        monkeypatch.setattr(migrating, "_release", arriving_while)
    more = ("--accept-evictions",) if accept else ()
    result = run_cli("migrate", limited, "--yes", *more, settings=fresh_vhost)
    if accept:
        assert result.code == 0, result.err
        wait_for(lambda: _depths(fresh_vhost, f"{q}.parking")[f"{q}.parking"] == 200,
                 "200 messages parked")
        assert _depths(fresh_vhost, q) == {q: 200}
        assert (f"evicted from {q}: x-max-length (migrate) absent -> 200: at least 200 of its "
                f"400 messages left it, parked in {q}.parking") in result.out
        return
    assert result.code == 3, result.out + result.err
    line = (f"error: queue {q}: x-max-length (migrate) absent -> 200: 50 of its 250 messages "
            f"leave it at once, parked in {q}.parking")
    if when == "start":
        assert result.err.strip().splitlines()[-2:] == [
            line, "error: messages arrived after migrate counted 1 queue: nothing was changed; "
            "pass --accept-evictions to make this change"]
        assert _depths(fresh_vhost, q, f"{q}.parking", f"{q}.migrating") == {
            q: 250, f"{q}.parking": 0, f"{q}.migrating": None}
        return
    assert result.err.strip().splitlines()[-2:] == [
        line, f"error: messages arrived after migrate counted 1 queue: {q} is rebuilt and its "
        f"messages wait in {q}.migrating; pass --accept-evictions and run migrate again to "
        "refill it"]
    assert _depths(fresh_vhost, q, f"{q}.parking", f"{q}.migrating") == {
        q: 0, f"{q}.parking": 0, f"{q}.migrating": 250}
    monkeypatch.undo()
    done = run_cli("migrate", limited, "--yes", "--accept-evictions", settings=fresh_vhost)
    assert done.code == 0, done.err
    wait_for(lambda: _depths(fresh_vhost, f"{q}.parking")[f"{q}.parking"] == 50,
             "50 messages parked")
    assert _depths(fresh_vhost, q, f"{q}.migrating") == {q: 200, f"{q}.migrating": None}
