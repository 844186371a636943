"""``renamed_from``: what the file may say, what ``plan`` shows and ``apply`` leaves for
``migrate``, and what ``migrate`` moves where; no broker."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

import pytest
from test_check import found, queues
from test_diff import plan_of
from test_plan_selection import FILE, live_of

from rabbit_retry.broker.diff import (
    apply_work,
    blocking,
    deferred_notes,
    diff,
    nothing_to_do,
    pending,
    refusal,
)
from rabbit_retry.broker.inspect import LiveState
from rabbit_retry.broker.migrate import MigrationRun, Moved, _run_rename
from rabbit_retry.broker.migrate_plan import (
    Copies,
    describe_rename,
    plan_migrations,
    plan_renames,
)
from rabbit_retry.topology import naming
from rabbit_retry.topology.plan import Binding

RENAMED = FILE.replace("audit.log:", "audit.trail:\n    renamed_from: audit.log")


def old_broker(main: int = 300, tier: int = 20, parked: int = 10) -> LiveState:
    """audit.log applied from FILE, holding messages in itself, a tier and its parking queue."""
    live = live_of(plan_of(FILE))
    counts = {"audit.log": main, "audit.log.retry.30s": tier, "audit.log.parking": parked}
    held = {n: dataclasses.replace(q, messages=counts.get(n, q.messages))
            for n, q in live.queues.items()}
    return dataclasses.replace(live, queues=held)


# --- the file -------------------------------------------------------------------------------


def test_a_rename_from_a_name_the_file_no_longer_uses_is_valid() -> None:
    assert found(queues({"b": {"renamed_from": "a"}})) == []
    assert plan_of(RENAMED).renames == (("audit.log", "audit.trail"),)


@pytest.mark.parametrize(("old", "why"), [
    ("a", "'a' is a queue of the file"),
    ("b", "'b' is this queue's own name"),
    ("a.parking", "'a.parking' is a name rabbit-retry derives from queue 'a'"),
    ("a.retry.5s", "'a.retry.5s' is a name rabbit-retry derives from queue 'a'"),
    ("a.retry", "'a.retry' is a name rabbit-retry derives from queue 'a'"),
    ("a.migrating", "'a.migrating' is a name rabbit-retry derives from queue 'a'"),
    ("a.retry.anything", "'a.retry.anything' is a name rabbit-retry derives from queue 'a'"),
])
def test_a_rename_from_a_name_of_the_file_is_refused(old: str, why: str) -> None:
    [problem] = found(queues({"a": {"retry": {"delays": ["5s"]}}, "b": {"renamed_from": old}}))
    assert problem.path == ("queues", "b", "renamed_from")
    assert why in problem.message


def test_two_queues_renamed_from_one_and_an_ordered_queue_are_refused() -> None:
    [problem] = found(queues({"b": {"renamed_from": "a"}, "c": {"renamed_from": "a"}}))
    assert problem.path == ("queues", "c", "renamed_from")
    assert "queue 'b' is renamed from 'a' already" in problem.message
    [problem] = found(queues({"b": {"renamed_from": "a", "ordered": {"key": "routing_key"}}}))
    assert "not supported on an ordered queue" in problem.message


def test_a_rename_that_is_not_a_string_is_refused_with_its_line() -> None:
    from rabbit_retry.errors import InputError
    from rabbit_retry.topology import parse_topology

    with pytest.raises(InputError) as raised:
        parse_topology("version: 1\nqueues:\n  b:\n    renamed_from: 5\n", "t.yml")
    assert "t.yml:4" in str(raised.value) and "renamed_from" in str(raised.value)


# --- plan and apply -------------------------------------------------------------------------


def test_plan_shows_the_rename_with_its_counts_and_apply_leaves_it_for_migrate() -> None:
    plan = plan_of(RENAMED)
    changes = diff(plan, old_broker())
    [rename] = [c for c in changes if c.renamed_to]
    assert (rename.kind, rename.name, rename.owner) == ("migrate", "audit.log -> audit.trail",
                                                        "audit.trail")
    assert rename.detail == (
        "migrate moves its 300 messages (audit.log.parking: 10 parked, tiers: 20 retrying) "
        "into audit.trail and deletes the objects of audit.log")
    # The old queue is no longer said to be "renamed to ...?": the file says so.
    assert "renamed to" not in next(c for c in changes if c.name == "audit.log").detail
    assert json.loads(json.dumps(rename.to_json()))["renamed_to"] == "audit.trail"
    # apply creates audit.trail and its objects, refuses nothing, and notes the rename.
    work = apply_work(changes, targeted=False)
    assert not refusal(changes, "/", "f.yml") and not any(blocking(c) for c in changes)
    assert rename in work and pending(work)
    [note] = deferred_notes(changes, "f.yml")
    assert note.startswith("note: queue audit.log -> audit.trail: renamed in the file; "
                           "`rabbit-retry migrate f.yml` moves its 300 messages")
    # Once applied, only the rename is left: still pending, so --detailed-exitcode is not 0.
    applied = old_broker()
    applied = dataclasses.replace(
        applied, queues={**applied.queues, **live_of(plan).queues},
        exchanges={**applied.exchanges, **live_of(plan).exchanges},
        bindings=applied.bindings + live_of(plan).bindings, policies=live_of(plan).policies)
    left = apply_work(diff(plan, applied), targeted=False)
    assert nothing_to_do(left) and pending(left)
    # With the old queue gone, nothing is pending.
    after = live_of(plan)
    assert not any(c.renamed_to for c in diff(plan, after))
    assert not pending(apply_work(diff(plan, after), targeted=False))


def test_the_rename_is_listed_only_for_a_target_of_its_new_name() -> None:
    plan = plan_of(RENAMED)
    assert any(c.renamed_to for c in diff(plan, old_broker(), targets=["audit.trail"]))
    assert not any(c.renamed_to for c in diff(plan, old_broker(), targets=["orders.email"]))


# --- migrate --------------------------------------------------------------------------------


def test_migrate_moves_tiers_then_parking_then_the_old_queue_and_deletes_the_rest() -> None:
    plan = plan_of(RENAMED)
    changes = diff(plan, old_broker())
    assert plan_migrations(changes, old_broker(), plan.bindings) == []  # not a rebuild
    [rename] = plan_renames(changes, old_broker())
    assert (rename.old, rename.new) == ("audit.log", "audit.trail")
    assert rename.moves == (
        ("audit.log.retry.5s", "audit.trail"),
        ("audit.log.retry.30s", "audit.trail"),
        ("audit.log.retry.5m", "audit.trail"),
        ("audit.log.parking", "audit.trail.parking"),
        ("audit.log", "audit.trail"),
    )
    assert rename.exchanges == ("audit.log.retry",)
    assert rename.policy is None  # audit.log has no policy block
    lines = describe_rename(rename)
    assert lines[0].startswith("queue audit.log -> audit.trail: renamed in the file; ")
    assert "unbind audit.log from every exchange" in lines[1]


def test_a_resumed_rename_moves_only_what_is_left() -> None:
    """Stopped after the tiers and the parking queue were moved and deleted: the old queue,
    its holding queue if a migration of it was interrupted, its exchange and policy are left."""
    plan = plan_of(FILE.replace("orders.email:", "orders.mail:\n    renamed_from: orders.email"))
    live = live_of(plan_of(FILE))
    gone = {"orders.email.retry.10s", "orders.email.parking"}
    queues_left = {n: q for n, q in live.queues.items() if n not in gone}
    queues_left["orders.email.migrating"] = dataclasses.replace(
        queues_left["orders.email"], name="orders.email.migrating", arguments={})
    live = dataclasses.replace(live, queues=queues_left)
    [rename] = plan_renames(diff(plan, live), live)
    assert rename.moves == (("orders.email.migrating", "orders.mail"),
                            ("orders.email", "orders.mail"))
    assert rename.policy == "rabbit-retry:orders.email"


def test_migrate_waits_for_apply_to_make_the_new_queue_first() -> None:
    from rabbit_retry.cli.provision import _rename_unready

    plan = plan_of(RENAMED)
    live = old_broker()
    renames = plan_renames(diff(plan, live), live)
    why = _rename_unready(plan, live, renames, "f.yml")
    assert why is not None and why.startswith("queue audit.log -> audit.trail: ")
    assert "run `rabbit-retry apply f.yml` first; nothing was changed" in why
    applied = dataclasses.replace(
        live, queues={**live.queues, **live_of(plan).queues},
        exchanges={**live.exchanges, **live_of(plan).exchanges},
        bindings=live.bindings + live_of(plan).bindings, policies=live_of(plan).policies)
    assert _rename_unready(plan, applied, plan_renames(diff(plan, applied), applied),
                           "f.yml") is None


def test_status_counts_a_pending_rename_as_drift_of_the_new_queue() -> None:
    from rabbit_retry.status import drift_of

    plan = plan_of(RENAMED)
    [drift] = [d for d in drift_of(diff(plan, old_broker()), plan)
               if d.object == "queue" and " -> " in d.name]
    assert (drift.kind, drift.owner, drift.role) == ("different", "audit.trail", "rename")


class _Vhost:
    """Just enough of a vhost for ``_run_rename``: queues with their arguments and ready
    counts, exchanges and bindings; after each change it checks that every queue's dead
    letters still reach a queue, as the broker would route them (a tier's through the default
    exchange to its main queue, a main queue's through its retry exchange), and records the
    queues whose dead letters would have been dropped, with the change that left them so."""

    def __init__(self, live: LiveState) -> None:
        self.vhost = "/"
        self.arguments = {n: dict(q.arguments) for n, q in live.queues.items()}
        self.ready = {n: q.messages for n, q in live.queues.items()}
        self.exchanges = set(live.exchanges)
        self.bindings = {(b.source, b.destination, b.routing_key) for b in live.bindings}
        self.unrouted: list[tuple[str, str]] = []
        self.api = self
        self.closed = False
        self.is_closed = False

    def say(self, line: str) -> None:
        pass

    def _check(self, change: str) -> None:
        for name, arguments in self.arguments.items():
            if "x-dead-letter-exchange" not in arguments:
                continue
            exchange = arguments["x-dead-letter-exchange"]
            key = arguments.get("x-dead-letter-routing-key", name)
            routed = (key in self.arguments if exchange == "" else any(
                (exchange, d, key) in self.bindings for d in self.arguments))
            if not routed and (name, change) not in self.unrouted:
                self.unrouted.append((name, change))

    # MigrationRun
    async def count(self, queue: str) -> tuple[int, int] | None:
        return (self.ready[queue], 0) if queue in self.arguments else None

    def bindings_to(self, queue: str) -> list[Binding]:
        return [Binding(s, d, k) for s, d, k in sorted(self.bindings) if d == queue]

    async def rebind(self, queue: str, bindings: Sequence[Binding], *, bind: bool) -> None:
        for b in bindings:
            if bind:
                self.bindings.add((b.source, queue, b.routing_key))
            else:
                self.bindings.discard((b.source, queue, b.routing_key))
            self._check(f"{'bind' if bind else 'unbind'} {b.source} -> {queue}")

    async def peek(self, queue: str) -> Copies:
        return Copies()

    async def move(self, source: str, target: str, copies: Copies, *, marker: bool) -> Moved:
        moved, self.ready[source] = self.ready[source], 0
        self.ready[target] += moved
        return Moved(moved)

    async def channel(self) -> _Vhost:
        return self

    # the management API
    def queue(self, vhost: str, name: str) -> dict[str, str] | None:
        return {"type": "classic"} if name in self.arguments else None

    def request(self, method: str, path: str) -> Any:
        return SimpleNamespace(status_code=204)

    # a channel
    async def queue_delete(self, queue: str, **_: object) -> None:
        assert self.ready[queue] == 0
        del self.arguments[queue]
        self.bindings = {b for b in self.bindings if b[1] != queue}
        self._check(f"delete {queue}")

    async def exchange_delete(self, exchange: str, **_: object) -> None:
        self.exchanges.discard(exchange)
        self.bindings = {b for b in self.bindings if b[0] != exchange}
        self._check(f"delete exchange {exchange}")

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(("old", "new"), [
    ("audit.log", "audit.trail"),  # its dead letters go to its first tier
    ("orders.email", "orders.mail"),  # ... to its parking queue (on_full: park)
])
def test_a_rename_never_leaves_a_queue_of_the_old_name_without_a_dead_letter_route(
        old: str, new: str) -> None:
    """The old queue's dead letters (one that expires or overflows in it, or passes a quorum
    queue's delivery limit) go through its retry exchange to its first tier or parking queue,
    which the rename deletes before it: once they were gone, such a message had no route and
    the broker dropped it. Its tiers expire into it, so it cannot go first either: its retry
    exchange is routed to where its queues are moved before anything is deleted."""
    plan = plan_of(FILE.replace(f"  {old}:", f"  {new}:\n    renamed_from: {old}"))
    live = old_broker() if old == "audit.log" else live_of(plan_of(FILE))
    live = dataclasses.replace(
        live, queues={**live.queues, **live_of(plan).queues},
        exchanges={**live.exchanges, **live_of(plan).exchanges},
        bindings=live.bindings + live_of(plan).bindings)
    [rename] = plan_renames(diff(plan, live), live)
    vhost = _Vhost(live)
    held = sum(n for q, n in vhost.ready.items() if q == old or q.startswith(f"{old}."))
    before = vhost.ready[new] + vhost.ready[naming.parking_queue(new)]
    moved = asyncio.run(_run_rename(cast(MigrationRun, vhost), rename))

    assert vhost.unrouted == []
    assert not any(q == old or q.startswith(f"{old}.") for q in vhost.arguments)
    assert naming.retry_exchange(old) not in vhost.exchanges
    assert moved.moved == held
    assert vhost.ready[new] + vhost.ready[naming.parking_queue(new)] == before + held


class _VhostLosing(_Vhost):
    """A ``_Vhost`` whose queue ``gone`` is deleted by hand once ``_run_rename`` has looked
    ``looks`` times whether it is there (0: before it starts); a bind to a queue that is not
    there fails as the broker's does."""

    def __init__(self, live: LiveState, gone: str, looks: int) -> None:
        super().__init__(live)
        self.gone, self.looks = gone, looks
        self.changes: list[str] = []
        self._forget()

    def _forget(self) -> None:
        if self.looks <= 0 and self.gone in self.arguments:
            del self.arguments[self.gone]
            self.bindings = {b for b in self.bindings if b[1] != self.gone}

    async def count(self, queue: str) -> tuple[int, int] | None:
        if queue == self.gone:
            self.looks -= 1
        there = await super().count(queue)
        self._forget()
        return there

    async def rebind(self, queue: str, bindings: Sequence[Binding], *, bind: bool) -> None:
        import aiormq.exceptions

        if bindings and queue not in self.arguments:
            raise aiormq.exceptions.ChannelNotFoundEntity(
                f"NOT_FOUND - no queue '{queue}' in vhost '/'")
        self.changes += [f"{'bind' if bind else 'unbind'} {b.source} -> {queue}"
                         for b in bindings]
        await super().rebind(queue, bindings, bind=bind)


def _orders_renamed() -> tuple[LiveState, Any]:
    """orders.email (on_full: park: its retry exchange routes to its parking queue) renamed
    orders.mail, both applied."""
    plan = plan_of(FILE.replace("  orders.email:",
                                "  orders.mail:\n    renamed_from: orders.email"))
    live = live_of(plan_of(FILE))
    live = dataclasses.replace(
        live, queues={**live.queues, **live_of(plan).queues},
        exchanges={**live.exchanges, **live_of(plan).exchanges},
        bindings=live.bindings + live_of(plan).bindings)
    [rename] = plan_renames(diff(plan, live), live)
    return live, rename


def test_a_rename_whose_new_parking_queue_is_gone_is_refused_before_anything_changes() -> None:
    """orders.mail.parking deleted by hand after migrate read the broker: the redirect's bind to
    it failed with the broker's 404 (``renaming ... stopped: NOT_FOUND - no queue ...; run
    migrate again``), after orders.email was unbound. Now: one line naming it, exit 3,
    nothing changed."""
    from rabbit_retry.errors import EXIT_CONFLICT, ConflictError

    live, rename = _orders_renamed()
    vhost = _VhostLosing(live, "orders.mail.parking", looks=0)
    bindings = set(vhost.bindings)
    with pytest.raises(ConflictError) as refused:
        asyncio.run(_run_rename(cast(MigrationRun, vhost), rename))
    assert str(refused.value) == (
        "queue orders.email -> orders.mail: orders.mail.parking is not on the broker (deleted "
        "after migrate read it?); run apply with the file first, which declares it, then "
        "migrate again; nothing was changed")
    assert refused.value.exit_code == EXIT_CONFLICT
    assert vhost.changes == [] and vhost.bindings == bindings
    assert "orders.mail.parking" not in vhost.arguments  # not declared behind apply's back


def test_a_parking_queue_deleted_while_the_rename_runs_stops_it_in_one_line() -> None:
    """Deleted after the check, before the redirect binds it: the route to the old parking
    queue stays, so what the old queue dead-letters still lands somewhere."""
    from rabbit_retry.errors import BrokerError

    live, rename = _orders_renamed()
    vhost = _VhostLosing(live, "orders.mail.parking", looks=1)
    with pytest.raises(BrokerError) as stopped:
        asyncio.run(_run_rename(cast(MigrationRun, vhost), rename))
    assert str(stopped.value) == (
        "orders.email.retry: cannot route to orders.mail.parking: it is not on the broker "
        "(deleted while migrate ran?); orders.email.parking keeps its messages and still gets "
        "what orders.email dead-letters; run apply with the file, then migrate again")
    assert ("orders.email.retry", "orders.email.parking", "orders.email") in vhost.bindings
    # (orders.mail's own dead letters lost their route with the deletion by hand.)
    assert [q for q, _ in vhost.unrouted if q.startswith("orders.email")] == []
