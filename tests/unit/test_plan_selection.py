"""What CI reads from ``plan``, without a broker: the part of a file ``--target`` selects, the
changes that make ``--detailed-exitcode`` say "pending", the compact listing, and the objects
of queues the file no longer declares (orphans)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import click
import pytest
from test_diff import by_name, live_exchange, live_queue, plan_of
from test_diff import live_of as applied

from rabbit_retry.broker.diff import (
    Change,
    apply_work,
    diff,
    listed,
    orphans,
    pending,
    select,
    unknown_targets,
)
from rabbit_retry.broker.inspect import LivePolicy, LiveState
from rabbit_retry.cli import provision
from rabbit_retry.errors import EXIT_CONFLICT, EXIT_INPUT, EXIT_PENDING, EXIT_RUNTIME
from rabbit_retry.topology import Plan
from rabbit_retry.topology.plan import Binding

# Two services on one exchange, one of them ordered-free with a policy block.
FILE = """
version: 1
exchanges:
  orders: {type: topic}
  audit: {type: fanout}
queues:
  orders.fraud-check:
    bindings: [{exchange: orders, routing_key: order.created}]
    retry: {delays: [5s, 30s], max_attempts: 3}
  orders.email:
    queue_type: classic
    bindings: [{exchange: orders, routing_key: "order.*"}]
    retry: {delays: [10s], max_attempts: 3}
    policy: {max_length: 1000}
    on_full: park
  audit.log:
    queue_type: classic
    bindings: [{exchange: audit}]
"""


def live_of(plan: Plan) -> LiveState:
    """The broker as if ``plan`` had been applied, its policies included."""
    live = applied(plan)
    return dataclasses.replace(live, policies=tuple(
        LivePolicy(p.name, p.pattern, p.apply_to, dict(p.definition), p.priority)
        for p in plan.policies))


def names(changes: list[Change]) -> list[tuple[str, str, str]]:
    return [(c.kind, c.object, c.name) for c in changes]


# --- --target -------------------------------------------------------------------------------


def test_a_target_selects_its_objects_the_bindings_feeding_it_and_their_exchange() -> None:
    plan = plan_of(FILE)
    part = select(plan, ["orders.email"])
    assert [e.name for e in part.exchanges] == ["orders", "orders.email.retry"]
    assert [q.name for q in part.queues] == [
        "orders.email", "orders.email.retry.10s", "orders.email.parking"]
    assert {(b.source, b.destination) for b in part.bindings} == {
        ("orders", "orders.email"),
        ("orders.email.retry", "orders.email.retry.10s"),
        ("orders.email.retry", "orders.email.parking"),  # on_full: park
    }
    assert [p.name for p in part.policies] == ["rabbit-retry:orders.email"]
    # Two targets: the union, in the file's order.
    both = select(plan, ["audit.log", "orders.email"])
    assert [e.name for e in both.exchanges] == [
        "orders", "audit", "orders.email.retry", "audit.log.retry"]


def test_a_conflict_outside_the_targets_does_not_concern_them() -> None:
    plan = plan_of(FILE)
    live = live_of(plan)
    # Someone changed the audit exchange by hand, and deleted a tier of orders.email.
    exchanges = dict(live.exchanges)
    exchanges["audit"] = live_exchange(next(e for e in plan.exchanges if e.name == "audit"),
                                       type="direct")
    queues = {n: q for n, q in live.queues.items() if n != "orders.email.retry.10s"}
    broken = dataclasses.replace(live, exchanges=exchanges, queues=queues)
    everything = diff(plan, broken)
    assert ("conflict", "exchange", "audit") in names(everything)  # apply refuses it all
    part = diff(plan, broken, targets=["orders.email"])
    assert [c for c in names(part) if c[0] != "unchanged"] == [
        ("create", "queue", "orders.email.retry.10s")]
    # The target that needs the changed exchange still sees the conflict.
    assert ("conflict", "exchange", "audit") in names(diff(plan, broken, targets=["audit.log"]))


def test_a_target_must_name_a_queue_of_the_file_or_an_orphan() -> None:
    plan = plan_of(FILE)
    old = plan_of(FILE.replace("audit.log:", "audit.trail:"))
    live = live_of(old)  # audit.trail was renamed audit.log in the file
    assert unknown_targets(plan, live, ["orders.email", "audit.trail"]) == []
    assert unknown_targets(plan, live, ["orders.email.parking", "nope"]) == [
        "orders.email.parking", "nope"]


# --- pending and the exit code ----------------------------------------------------------------


def test_pending_is_what_apply_would_change() -> None:
    plan = plan_of(FILE)
    assert pending(diff(plan, LiveState.empty()))
    in_sync = diff(plan, live_of(plan))
    assert not pending(in_sync) and not pending(in_sync, prune=True)
    # A policy changed by hand: an update is pending.
    live = live_of(plan)
    drifted = dataclasses.replace(live, policies=(LivePolicy(
        "rabbit-retry:orders.email", "^orders\\.email$", "queues", {"max-length": 5}, 10),))
    assert pending(diff(plan, drifted))


def test_obsolete_objects_are_pending_only_for_prune_and_only_when_empty() -> None:
    plan = plan_of(FILE)
    old = plan_of(FILE.replace("audit.log:", "audit.trail:"))
    live = live_of(plan)
    stale = dataclasses.replace(live, queues={**live.queues, **{
        q.name: live_queue(q) for q in old.queues_of("audit.trail")}})
    changes = diff(plan, stale)
    assert not pending(changes)
    assert pending(changes, prune=True)
    # An orphan is deleted (and pending) only when --target names its queue: another file
    # applied to the same vhost has queues this one does not declare.
    assert not pending(apply_work(changes, targeted=False), prune=True)
    targeted = diff(plan, stale, targets=["audit.trail"])
    assert pending(apply_work(targeted, targeted=True), prune=True)
    full = dataclasses.replace(stale, queues={**stale.queues, "audit.trail": live_queue(
        next(q for q in old.queues if q.name == "audit.trail"), messages=200)})
    assert not pending(diff(plan, full), prune=True)  # apply could not delete them


def test_the_exit_codes_are_distinct() -> None:
    codes = {0, EXIT_RUNTIME, EXIT_INPUT, EXIT_CONFLICT, EXIT_PENDING}
    assert len(codes) == 5 and EXIT_PENDING == 4


# --- the compact listing --------------------------------------------------------------------


def test_the_compact_plan_lists_changes_and_counts_the_rest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan = plan_of(FILE)
    live = live_of(plan)
    queues = {n: q for n, q in live.queues.items() if n != "orders.email.parking"}
    changes = diff(plan, dataclasses.replace(live, queues=queues))
    assert sum(1 for c in changes if listed(c)) == 1
    provision._print_changes(changes, "v")
    lines = capsys.readouterr().out.splitlines()
    unchanged = sum(1 for c in changes if c.kind == "unchanged")
    assert lines == [
        "create    queue    orders.email.parking  (classic, parking)",
        f"unchanged: {unchanged} objects not listed (--all lists them)",
        f"vhost 'v': 1 to create, {unchanged} unchanged, 0 to update, 0 in conflict, "
        "0 to migrate, 0 to unbind, 0 to prune, 0 obsolete but not empty",
    ]
    provision._print_changes(changes, "v", everything=True)
    assert len(capsys.readouterr().out.splitlines()) == len(changes) + 1


def test_an_unchanged_queue_with_a_note_is_listed() -> None:
    plan = plan_of(FILE)
    queue = next(q for q in plan.queues if q.name == "orders.email")
    assert not listed(Change("unchanged", "queue", queue.name, "", queue))
    assert listed(Change("unchanged", "queue", queue.name, "replicas: ...", queue))
    policy = next(iter(plan.policies))
    assert not listed(Change("unchanged", "policy", policy.name, "{max-length: 1000}", policy))


# --- orphans --------------------------------------------------------------------------------


@pytest.fixture
def renamed() -> Iterator[tuple[list[Change], LiveState]]:
    """audit.log renamed audit.trail in the file, after the old one was applied and got 200
    messages; the old one is still bound from audit."""
    old = plan_of(FILE)
    plan = plan_of(FILE.replace("audit.log:", "audit.trail:"))
    live = live_of(old)
    queues = dict(live.queues)
    queues["audit.log"] = dataclasses.replace(queues["audit.log"], messages=200)
    yield diff(plan, dataclasses.replace(live, queues=queues)), live


def test_a_renamed_queue_leaves_orphans_reported_with_counts_and_the_copy(
    renamed: tuple[list[Change], LiveState],
) -> None:
    changes, _ = renamed
    found = [c for c in changes if c.orphan]
    assert names(found) == [
        ("keep", "queue", "audit.log"),
        ("keep", "queue", "audit.log.retry.5s"),
        ("keep", "queue", "audit.log.retry.30s"),
        ("keep", "queue", "audit.log.retry.5m"),
        ("keep", "queue", "audit.log.parking"),
        ("keep", "exchange", "audit.log.retry"),
    ]
    main = by_name(changes, "audit.log")
    assert main.detail == (
        "not in the file (queue audit.log); 200 messages in it; still bound from audit []: it "
        "gets a copy of every message routed there; renamed to audit.trail? its messages stay "
        "here")
    assert by_name(changes, "audit.log.parking").detail == (
        "not in the file (queue audit.log); kept while its group holds messages")
    assert {c.owner for c in found} == {"audit.log"}
    assert json.loads(json.dumps(main.to_json()))["orphan"] is True


def test_an_empty_orphan_group_is_pruned_with_its_policy() -> None:
    old = plan_of(FILE)
    plan = plan_of(FILE.replace("orders.email:", "orders.mail:"))
    live = live_of(old)
    found = orphans(plan, live)
    assert names(found) == [
        ("prune", "queue", "orders.email"),
        ("prune", "queue", "orders.email.retry.10s"),
        ("prune", "queue", "orders.email.parking"),
        ("prune", "exchange", "orders.email.retry"),
        ("prune", "policy", "rabbit-retry:orders.email"),
    ]
    # Only ours: a queue that merely looks like a tier of no queue, or a user's queue named
    # like a parking queue, is not.
    stranger = live_queue(next(q for q in old.queues if q.name == "audit.log"),
                          name="someone.else", arguments={"x-message-ttl": 5})
    live = dataclasses.replace(live, queues={**live.queues, "someone.else": stranger})
    assert names(orphans(plan, live)) == names(found)


def test_a_queue_with_a_consumer_is_not_pruned() -> None:
    old = plan_of(FILE)
    plan = plan_of(FILE.replace("audit.log:", "audit.trail:"))
    live = live_of(old)
    queues = dict(live.queues)
    queues["audit.log"] = dataclasses.replace(queues["audit.log"], consumers=1)
    found = orphans(plan, dataclasses.replace(live, queues=queues))
    assert {c.kind for c in found} == {"keep"}
    assert "1 consumer" in by_name(found, "audit.log").detail


def test_orphans_are_found_against_the_whole_file_and_filtered_by_target(
    renamed: tuple[list[Change], LiveState],
) -> None:
    _, live = renamed
    plan = plan_of(FILE.replace("audit.log:", "audit.trail:"))
    # The other queues of the file are no orphans of a selection that leaves them out.
    assert not [c for c in diff(plan, live, targets=["orders.email"]) if c.orphan]
    assert {c.owner for c in diff(plan, live, targets=["audit.log"]) if c.orphan} == {
        "audit.log"}


def test_a_binding_from_an_exchange_keeps_the_lanes_case_apart() -> None:
    # Bindings into derived exchanges are not "still bound": only the file's exchanges feed.
    old = plan_of(FILE)
    plan = plan_of(FILE.replace("audit.log:", "audit.trail:"))
    live = live_of(old)
    only_retry = dataclasses.replace(live, bindings=tuple(
        b for b in live.bindings if b.source != "audit"))
    detail = by_name(orphans(plan, only_retry), "audit.log").detail
    assert "still bound" not in detail and "renamed" not in detail


def test_target_option_is_repeatable() -> None:
    option = next(p for p in provision.apply.params if p.name == "targets")
    assert isinstance(option, click.Option) and option.multiple
    assert {p.name for p in provision.plan.params} >= {
        "targets", "everything", "detailed_exitcode", "prune", "as_json"}
    assert {p.name for p in provision.migrate.params} >= {"targets", "lock_timeout"}


def test_binding_type_is_kept_for_json() -> None:
    binding = Binding("orders", "orders.email", "order.*")
    change = Change("create", "binding", "b", "", binding)
    assert change.to_json()["owner"] is None and change.to_json()["orphan"] is False
