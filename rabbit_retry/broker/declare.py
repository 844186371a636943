"""Carrying out a diff over AMQP: declare what is missing, rewire, prune obsolete tiers.

Declarations run concurrently over a small pool of channels: an AMQP channel has one
synchronous method in flight at a time, and a quorum queue declaration waits for its Raft
cluster to start, so one channel would spend most of its time waiting. Objects that already
match are never redeclared, so a no-op apply sends nothing at all.

Order matters for correctness, not only for the broker: exchanges and queues first, then
bindings (the new first tier is bound with key ``Q`` before the old one is unbound, so no dead
letter is ever unroutable), then unbinds, then pruning.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiormq
import aiormq.exceptions
from aio_pika.abc import AbstractConnection
from pamqp import commands

from rabbit_retry.broker.connect import CONNECTION_ERRORS, connect
from rabbit_retry.broker.diff import Change, blocking
from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.settings import Settings, mask
from rabbit_retry.topology import naming
from rabbit_retry.topology.plan import Binding, Exchange, Policy, Queue

DEFAULT_CONCURRENCY = 16
# After unbinding a tier, how long to let publishes already routed to it land before it is
# deleted or counted (see _prune_one).
SETTLE_SECONDS = 0.5
# A broker that cannot create a queue (RabbitMQ 3.x out of file handles, a stuck node) never
# answers; better one clear line than a hang.
OPERATION_TIMEOUT = 60.0

Progress = Callable[[int], None]
_Operation = Callable[[aiormq.abc.AbstractChannel], Awaitable[Any]]


@dataclass
class ApplyReport:
    created: list[Change] = field(default_factory=list)
    unbound: list[Change] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    kept: list[tuple[str, int]] = field(default_factory=list)  # (tier, messages still in it)
    # Orphans (diff.orphans): queues deleted with their messages (--discard-messages), groups
    # left because they hold messages, and policies whose queues are all gone now (deleted
    # through the management API by the caller).
    discarded: list[tuple[str, int]] = field(default_factory=list)
    left: list[Change] = field(default_factory=list)
    policies: list[Change] = field(default_factory=list)


def _describe(change: Change) -> str:
    return f"{change.object} {change.name}"


def _fail(what: str, exc: BaseException) -> BrokerError:
    if isinstance(exc, TimeoutError):
        return BrokerError(f"{what}: no answer from the broker in {OPERATION_TIMEOUT:.0f}s")
    reason = mask(str(exc)) or type(exc).__name__
    return BrokerError(f"{what} failed: {reason}")


class ChannelPool:
    """Runs AMQP operations on up to ``size`` channels at once; the first failure stops the
    run and becomes one ``BrokerError`` naming its object."""

    def __init__(self, connection: AbstractConnection, size: int) -> None:
        self._connection = connection
        self._size = max(1, size)

    async def run(
        self, ops: Sequence[tuple[str, _Operation]], progress: Progress | None = None
    ) -> None:
        if not ops:
            return
        work: asyncio.Queue[tuple[str, _Operation]] = asyncio.Queue()
        for op in ops:
            work.put_nowait(op)

        async def worker() -> None:
            what = "opening a channel"
            try:
                channel = await _open(self._connection)
                while True:
                    try:
                        what, op = work.get_nowait()
                    except asyncio.QueueEmpty:
                        break
                    await op(channel)
                    if progress is not None:
                        progress(1)
                await channel.close()
            except CONNECTION_ERRORS as exc:
                raise _fail(what, exc) from exc

        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(min(self._size, len(ops))):
                    group.create_task(worker())
        except BaseExceptionGroup as group_error:
            # The first failure is the one to report; the others are its echoes (cancelled
            # workers, a connection closing under them).
            raise _first(group_error) from None


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first(exc)
        if isinstance(exc, BrokerError):
            return exc
    inner = group.exceptions[0]
    return _first(inner) if isinstance(inner, BaseExceptionGroup) else inner


def _declare_exchange(exchange: Exchange) -> _Operation:
    async def op(channel: aiormq.abc.AbstractChannel) -> None:
        await channel.exchange_declare(
            exchange.name,
            exchange_type=exchange.type,
            durable=exchange.durable,
            auto_delete=exchange.auto_delete,
            internal=exchange.internal,
            arguments=dict(exchange.arguments),
            timeout=OPERATION_TIMEOUT,
        )

    return op


def _declare_queue(queue: Queue) -> _Operation:
    async def op(channel: aiormq.abc.AbstractChannel) -> None:
        await channel.queue_declare(
            queue.name,
            durable=queue.durable,
            arguments=dict(queue.arguments),
            timeout=OPERATION_TIMEOUT,
        )

    return op


def _binding(binding: Binding, *, bind: bool) -> _Operation:
    async def op(channel: aiormq.abc.AbstractChannel) -> None:
        method: Callable[..., Awaitable[Any]]
        if binding.destination_type == "exchange":
            method = channel.exchange_bind if bind else channel.exchange_unbind
        else:
            method = channel.queue_bind if bind else channel.queue_unbind
        await method(
            binding.destination,
            binding.source,
            routing_key=binding.routing_key,
            arguments=dict(binding.arguments),
            timeout=OPERATION_TIMEOUT,
        )

    return op


def _refusal(kind: str, name: str) -> str | None:
    try:
        if kind == "exchange":
            commands.Exchange.Declare(exchange=name)
        else:
            commands.Queue.Declare(queue=name)
    except ValueError as exc:
        return str(exc)
    return None


def unsendable(changes: Sequence[Change]) -> list[str]:
    """Names the AMQP client will not put in a frame, one line each (derived names of a
    refused queue are not repeated).

    pamqp follows the AMQP 0-9-1 name rules, stricter than RabbitMQ's: names of letters,
    digits and ``-_.:@#,/+`` or space, exchange names of at most 127 characters. The same rules
    apply to consuming and publishing, so such a queue would be useless to the worker anyway.
    """
    names: dict[str, str] = {}  # name -> "exchange" | "queue", in the order met
    for change in changes:
        item = change.item
        if change.kind not in ("create", "unbind", "prune", "keep") or item is None:
            continue
        if isinstance(item, Policy):  # goes through the management API: any name will do
            continue
        if isinstance(item, Exchange):
            names.setdefault(item.name, "exchange")
        elif isinstance(item, Queue):
            names.setdefault(item.name, "queue")
        else:
            names.setdefault(item.source, "exchange")
            names.setdefault(item.destination, "queue")
    refused: list[tuple[str, str, str]] = []
    for name, kind in sorted(names.items(), key=lambda item: len(item[0])):  # Q before Q.retry
        reason = _refusal(kind, name)
        if reason and not any(name.startswith(r + ".") for _, r, _ in refused):
            refused.append((kind, name, reason))
    return [
        f"{kind} {name!r}: AMQP clients cannot use this name ({reason.lower()}); names may hold "
        "letters, digits, - _ . : @ # , / + and spaces, exchange names at most 127 characters"
        for kind, name, reason in refused
    ]


def _with_kind(changes: Sequence[Change], kind: str, object_kind: str) -> list[Change]:
    return [c for c in changes if c.kind == kind and c.object == object_kind]


def work_count(changes: Sequence[Change], *, prune: bool) -> int:
    """How many broker operations ``apply_changes`` will make (for a progress bar)."""
    kinds = {"create", "unbind"} | ({"prune", "keep"} if prune else set())
    return sum(1 for c in changes if c.kind in kinds and c.object != "policy")


async def apply_changes(
    settings: Settings,
    changes: Sequence[Change],
    live_bindings: Sequence[Binding] = (),
    *,
    prune: bool = False,
    discard: bool = False,
    concurrency: int = DEFAULT_CONCURRENCY,
    progress: Progress | None = None,
) -> ApplyReport:
    """Carry out ``changes`` (a conflict-free diff) on the broker of ``settings``.

    ``live_bindings`` are the bindings read with the diff; pruning a quorum tier unbinds them
    first and restores them if the tier turns out not to be empty. Orphans are pruned a queue
    group at a time (``_prune_orphans``); ``discard`` deletes those holding messages too.
    """
    if any(blocking(c) for c in changes):
        raise AssertionError("apply_changes called with conflicts; check the diff first")
    report = ApplyReport()
    if work_count(changes, prune=prune) == 0 and not (prune and any(c.orphan for c in changes)):
        return report
    problems = unsendable(changes)
    if problems:
        raise InputError("\n".join(problems))
    connection = await connect(settings, name="rabbit-retry apply")
    try:
        await _declare_and_bind(ChannelPool(connection, concurrency), changes, report, progress)
        if prune:
            # A kept quorum tier gets back the bindings it had, but never one just removed.
            gone = {_binding_of(c).key for c in report.unbound}
            remaining = [b for b in live_bindings if b.key not in gone]
            await _prune(connection, changes, remaining, report, discard, progress)
    finally:
        await connection.close()
    return report


async def _declare_and_bind(
    pool: ChannelPool, changes: Sequence[Change], report: ApplyReport,
    progress: Progress | None,
) -> None:
    """Declare the exchanges, then the queues, then bind, then unbind what the file dropped."""
    objects: list[tuple[str, _Operation]] = []
    for change in _with_kind(changes, "create", "exchange"):
        assert isinstance(change.item, Exchange)
        objects.append((f"declaring {_describe(change)}", _declare_exchange(change.item)))
    for change in _with_kind(changes, "create", "queue"):
        assert isinstance(change.item, Queue)
        objects.append((f"declaring {_describe(change)}", _declare_queue(change.item)))
    await pool.run(objects, progress)

    binds = _with_kind(changes, "create", "binding")
    lanes, others = _bind_operations(binds, progress)
    await pool.run(lanes, progress)  # before anything can route into a lanes exchange
    await pool.run(others, progress)
    report.created = [c for c in changes if c.kind == "create" and c.object != "policy"]

    unbinds = _with_kind(changes, "unbind", "binding")
    await pool.run(
        [(f"unbinding {c.name}", _binding(_binding_of(c), bind=False)) for c in unbinds],
        progress,
    )
    report.unbound = unbinds


_Operations = list[tuple[str, _Operation]]


def _bind_operations(
    binds: Sequence[Change], progress: Progress | None
) -> tuple[_Operations, _Operations]:
    """The operations that bind ordered queues' lanes, then one per other binding. One
    operation binds a queue's lanes one after another in lane order, so the lanes exchange
    numbers its buckets in lane order (concurrent binds would leave that order to chance, and
    taking lanes away later relies on it: the last lane's buckets must be the ring's last).
    They run first: no message reaches a lanes exchange before all its lanes are bound."""
    operations: _Operations = []
    lanes: dict[str, list[tuple[int, Binding]]] = {}
    for change in binds:
        binding = _binding_of(change)
        lane = naming.lane_number(binding.source, binding.destination)
        if lane is None or binding.destination_type != "queue":
            operations.append((f"binding {change.name}", _binding(binding, bind=True)))
        else:
            lanes.setdefault(binding.source, []).append((lane, binding))
    ordered = [(f"binding the lanes of {exchange}",
                _bind_in_order([b for _, b in sorted(bound, key=lambda pair: pair[0])], progress))
               for exchange, bound in lanes.items()]
    return ordered, operations


def _bind_in_order(bindings: Sequence[Binding], progress: Progress | None) -> _Operation:
    async def op(channel: aiormq.abc.AbstractChannel) -> None:
        for n, binding in enumerate(bindings):
            if n and progress is not None:
                progress(1)  # the pool counts the last one, as it counts every operation
            await _binding(binding, bind=True)(channel)

    return op


async def _prune(
    connection: AbstractConnection, changes: Sequence[Change], remaining: Sequence[Binding],
    report: ApplyReport, discard: bool, progress: Progress | None,
) -> None:
    """The queues the file no longer wants (deleted if empty, else kept), then the orphans a
    queue group at a time."""
    for change in changes:
        if change.kind not in ("prune", "keep") or change.orphan:
            continue
        assert isinstance(change.item, Queue)
        left = await _prune_one(connection, change.item, remaining)
        if left is None:
            report.pruned.append(change.name)
        else:
            report.kept.append((change.name, left))
        if progress is not None:
            progress(1)
    groups: dict[str | None, list[Change]] = {}
    for change in changes:
        if change.orphan:
            groups.setdefault(change.owner, []).append(change)
    for group in groups.values():
        await _prune_orphans(connection, group, remaining, report, discard=discard)
        if progress is not None:
            progress(sum(1 for c in group if c.object != "policy"))


async def _prune_orphans(
    connection: AbstractConnection,
    group: Sequence[Change],
    live_bindings: Sequence[Binding],
    report: ApplyReport,
    *,
    discard: bool,
) -> None:
    """Delete the objects of one queue the file no longer declares: its queues in the order
    messages flow (main and lanes first: nothing enters the others once they are gone), each
    only if empty and without consumers, then its exchanges and (by the caller) its policy. A
    group that held messages when planned is left whole, so none of them loses the way back
    through its tiers; so is the rest of a group once one of its queues is found not empty.
    With ``discard``, its queues are deleted with what they hold."""
    if not discard and any(c.kind == "keep" for c in group):
        report.left += [c for c in group if c.object == "queue"]
        return
    for change in group:
        if change.object != "queue":
            continue
        assert isinstance(change.item, Queue)
        if discard:
            left = await _delete(connection, change.item.name)
            if left:
                report.discarded.append((change.name, left))
            else:
                report.pruned.append(change.name)
            continue
        kept = await _prune_one(connection, change.item, live_bindings, unused=True)
        if kept is not None:
            report.kept.append((change.name, kept))
            return
        report.pruned.append(change.name)
    for change in group:
        if change.object == "exchange":
            channel = await _open(connection)
            try:
                await channel.exchange_delete(change.name, if_unused=True,
                                              timeout=OPERATION_TIMEOUT)
            except aiormq.exceptions.ChannelPreconditionFailed:
                report.kept.append((change.name, 0))
                return
            except CONNECTION_ERRORS as exc:
                raise _fail(f"deleting exchange {change.name}", exc) from exc
            if not channel.is_closed:
                await channel.close()
            report.pruned.append(change.name)
    report.policies += [c for c in group if c.object == "policy"]


async def _delete(connection: AbstractConnection, name: str) -> int:
    """Delete queue ``name`` whatever it holds; how many messages it held."""
    channel = await _open(connection)
    try:
        ok = await channel.queue_delete(name, timeout=OPERATION_TIMEOUT)
        return int(getattr(ok, "message_count", 0) or 0)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return 0
    except CONNECTION_ERRORS as exc:
        raise _fail(f"deleting queue {name}", exc) from exc
    finally:
        if not channel.is_closed:
            await channel.close()


def _binding_of(change: Change) -> Binding:
    assert isinstance(change.item, Binding)
    return change.item


async def _prune_one(
    connection: AbstractConnection, tier: Queue, live_bindings: Sequence[Binding],
    *, unused: bool = False,
) -> int | None:
    """Delete ``tier`` if it is empty (None); otherwise leave it as it was, return its count.
    With ``unused``, a queue with a consumer is left too (a worker still reads it).

    The tier is first cut off from routing: RabbitMQ confirms a publish on its way to a queue
    deleted under it, as if delivered, so a retry a worker still sends there (one running an
    older file) would be lost in that instant; unbound, its mandatory copy comes back to the
    worker instead. Nothing but routing puts messages into a tier, so once it is unbound (and
    publishes already routed have landed) its count can only fall. Then a classic tier is
    deleted with if-empty, which the broker checks atomically; quorum queues refuse if-empty
    (RabbitMQ answers NOT_IMPLEMENTED and closes the connection), so a quorum tier is counted,
    then deleted only if empty. A tier left in place gets its bindings back.
    """
    channel = await _open(connection)
    bindings = [b for b in live_bindings if b.destination == tier.name]
    try:
        for binding in bindings:
            await _binding(binding, bind=False)(channel)
        await asyncio.sleep(SETTLE_SECONDS if bindings else 0)
        if tier.queue_type != "quorum":
            try:
                await channel.queue_delete(tier.name, if_empty=True, if_unused=unused,
                                           timeout=OPERATION_TIMEOUT)
                return None
            except aiormq.exceptions.ChannelPreconditionFailed:
                # The broker closed the channel to say "not empty"; count on a new one.
                channel = await _open(connection)
        counted = await _count(channel, tier.name)
        if counted is None:
            return None
        left, consumers = counted
        if tier.queue_type == "quorum" and left == 0 and not (unused and consumers):
            await channel.queue_delete(tier.name, timeout=OPERATION_TIMEOUT)
            return None
        for binding in bindings:
            await _binding(binding, bind=True)(channel)
        return left
    except CONNECTION_ERRORS as exc:
        raise _fail(f"pruning queue {tier.name}", exc) from exc
    finally:
        if not channel.is_closed:
            await channel.close()


async def _open(connection: AbstractConnection) -> aiormq.abc.AbstractChannel:
    channel = await connection.channel(publisher_confirms=False)
    return await channel.get_underlay_channel()


async def _count(channel: aiormq.abc.AbstractChannel, queue: str) -> tuple[int, int] | None:
    """Messages and consumers of ``queue`` as the broker counts them now; None if it is
    already gone."""
    try:
        ok = await channel.queue_declare(queue, passive=True, timeout=OPERATION_TIMEOUT)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return None
    assert ok is not None
    return int(ok.message_count or 0), int(ok.consumer_count or 0)
