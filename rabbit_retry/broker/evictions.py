"""The messages a change of the file takes out of their queue at once (pure): a length limit
lowered below what a classic queue holds, a TTL added or shortened on a queue with messages.

``plan`` names them with their count; ``apply`` makes such a change only with
``--accept-evictions``. Where they go is what the file says (``on_full`` / ``on_expire``,
topology/limits.py): the parking queue, or nowhere. A quorum queue over a lowered limit keeps
its messages and refuses new publishes until it is below it: nothing leaves, nothing is named.
A rename (``renamed_from``) whose moved messages take the new queue over its length limit
evicts too (``moved_in``): a classic queue its oldest; a quorum queue refuses the copies over
it (``Eviction.refused``), which stay in the old queue, accepted or not.

Counts come from what the broker shows (exact ready counts where ``apply`` reads them,
``provision._read``); a TTL's count is an upper bound: which messages are older than the new TTL
only the broker knows. ``apply`` counts the queues again just before it sets their policies,
and ``migrate`` just before it starts and again just before it refills a rebuilt queue
(``recount``, ``refilled``) or moves a renamed queue's messages: messages that arrived since
they read them leave too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from rabbit_retry.broker.diff import Change
from rabbit_retry.broker.hazards import lowest_limits, matches, top
from rabbit_retry.broker.inspect import LiveQueue, LiveState, with_exact_counts
from rabbit_retry.errors import ConflictError
from rabbit_retry.text import plural
from rabbit_retry.topology import naming
from rabbit_retry.topology.durations import label
from rabbit_retry.topology.plan import Binding, Plan, Queue


@dataclass(frozen=True)
class Eviction:
    queue: str
    setting: str  # the file's key: max_length, max_length_bytes, message_ttl
    was: str  # its live value, as the user reads it ("absent" when unset)
    becomes: str
    count: int  # messages that leave the queue (at most that many when ``exact`` is False)
    held: int  # messages the queue holds now
    exact: bool
    to: str | None  # the parking queue they move to; None: dropped (or refused)
    moved_from: str | None = None  # a rename's old queue, whose messages are moved in
    refused: bool = False  # a quorum queue refuses the moved copies: they stay in moved_from

    @property
    def change(self) -> str:
        if self.moved_from:
            return f"{self.setting} {self.becomes} with the messages of {self.moved_from} moved in"
        return f"{self.setting} {self.was} -> {self.becomes}"

    @property
    def detail(self) -> str:
        many = f"{self.count} of its {plural(self.held, 'message')}"
        if not self.exact:
            many = f"up to {many}"
        if self.refused:
            return (f"{self.change}: {many} do not fit; it refuses them (on_full: reject, "
                    f"with --accept-evictions too) and they stay in {self.moved_from}")
        fate = f"parked in {self.to}" if self.to else "dropped (the file says drop)"
        return f"{self.change}: {many} leave it at once, {fate}"

    def line(self) -> str:
        return f"evicts    queue    {self.queue}  ({self.detail})"

    def done(self, when: str = "the policy was set") -> str:
        """What ``apply`` says once it set the policy (``migrate`` once it refilled the queue:
        ``when``), with ``count`` read just before: what arrived in between left too, so an
        exact count is a floor and an upper bound may be passed."""
        many = f"{'at least' if self.exact else 'up to'} {self.count} of its " \
               f"{plural(self.held, 'message')}"
        fate = f"parked in {self.to}" if self.to else "dropped (the file says drop)"
        more = "left too" if self.exact else "may have left too"
        return (f"evicted from {self.queue}: {self.change}: {many} left it, {fate} (counted "
                f"just before {when}; messages that arrived in between {more})")

    def to_json(self) -> dict[str, Any]:
        return {"queue": self.queue, "setting": self.setting, "live": self.was,
                "file": self.becomes, "count": self.count, "exact": self.exact,
                "messages": self.held, "to": self.to, "detail": self.detail,
                "renamed_from": self.moved_from, "refused": self.refused}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _lowest(*values: Any) -> int | None:
    numbers = [n for n in map(_int, values) if n is not None]
    return min(numbers) if numbers else None


def _show(value: int | None, ttl: bool = False) -> str:
    if value is None:
        return "absent"
    return label(value) if ttl and value > 0 else str(value)


def _route(plan: Plan, queue: Queue) -> str | None:
    """Where ``queue``'s dead letters go: its parking queue, or None (dropped)."""
    parking = naming.parking_queue(queue.name)
    retry = naming.retry_exchange(queue.name)
    routed = any(b.source == retry and b.routing_key == queue.name and b.destination == parking
                 for b in plan.bindings)
    return parking if routed else None


def evictions(plan: Plan, live: LiveState) -> list[Eviction]:
    """Every eviction applying ``plan``'s policies to ``live`` makes at once, and every one a
    ``migrate`` makes when it refills a main queue under a lower ``x-max-length``."""
    files = {p.queue: p.definition for p in plan.policies}
    out: list[Eviction] = []
    for queue in plan.main_queues:
        there = live.queues.get(queue.name)
        if there is None or not there.messages_ready:
            continue
        was = _in_effect(live, queue)
        file = files.get(queue.name, {})
        out += _evicted(plan, queue, there, dict(file), was)
    return out


def recount(plan: Plan, live: LiveState, counts: Mapping[str, tuple[int, int]], *,
            accepted: bool, verb: str, then: Callable[[bool], str],
            find: Callable[[LiveState], list[Eviction]] | None = None,
            stuck: Callable[[], str] | None = None) -> list[Eviction]:
    """The evictions ``evictions`` (or ``find``) finds on the queues of ``counts`` (queue ->
    (ready, consumers)), counted exactly again just before the change that evicts: what arrived
    since ``live`` was read leaves too, and a limit that evicted nothing then may now. Without
    ``accepted``, one found raises ``ConflictError``: one line per queue, then what ``verb``
    did (``then``, told whether more than one queue was found) and how to make the change.
    One the queue refuses (``Eviction.refused``) raises whatever ``accepted`` says, with
    ``stuck`` in place of ``then``: no flag makes the broker take them."""
    now = with_exact_counts(live, counts)
    found = [e for e in (find or partial(evictions, plan))(now) if e.queue in counts]
    refused = [e for e in found if e.refused]
    if (refused and stuck) or (found and not accepted):
        shown = refused if refused and stuck else found
        lines = [f"queue {e.queue}: {e.detail}" for e in shown]
        tail = stuck() if refused and stuck else then(len(shown) > 1)
        raise ConflictError("\n".join([
            *lines, f"messages arrived after {verb} counted {plural(len(shown), 'queue')}: "
            f"{tail}"]))
    return found


def moved_in(plan: Plan, live: LiveState, old: str,
             moves: Iterable[tuple[str, str]]) -> list[Eviction]:
    """The evictions a rename (``renamed_from: old``) makes when it moves the messages of
    ``old``'s queues into the queues ``moves`` pairs them with (live queue, queue of the file):
    a main queue that then holds more than its length limit (the file's, or a live policy's
    lower one) evicts its oldest at once, its own first, parked or dropped as the file says; a
    quorum queue refuses the copies over it instead (``refused``: an upper bound, it may take a
    few more), which stay in ``old``. A TTL evicts nothing: a moved copy's starts again. With
    consumers on the queue, fewer may leave: an upper bound too."""
    arriving: dict[str, tuple[int, int]] = {}
    for source, target in moves:
        there = live.queues.get(source)
        if there is not None:
            count, size = arriving.get(target, (0, 0))
            arriving[target] = (count + there.messages_ready, size + there.message_bytes_ready)
    files = {p.queue: p.definition for p in plan.policies}
    out: list[Eviction] = []
    for queue in plan.main_queues:
        count, size = arriving.get(queue.name, (0, 0))
        if not count:
            continue
        there = live.queues.get(queue.name) or LiveQueue(queue.name, queue.queue_type, True,
                                                          False, {})
        full = replace(there, arguments={}, messages_ready=there.messages_ready + count,
                       message_bytes_ready=there.message_bytes_ready + size)
        file = dict(files.get(queue.name, {}))
        file.update(lowest_limits([file, _in_effect(live, queue)]))
        file.pop("message-ttl", None)
        out += [replace(e, moved_from=old, exact=e.exact and not there.consumers)
                for e in _evicted(plan, queue, full, file, {}, moving=True)]
    return out


def refilled(live: LiveState, queue: str) -> LiveState:
    """``live`` with ``queue`` as ``migrate`` refills it from its holding queue, which has no
    limit of its own: every message over the new ``x-max-length`` leaves it, whatever limit the
    old queue had (what arrived while it was rebuilt waited in the holding queue). Its limits
    by policy are the live ones: ``migrate`` sets no policy."""
    there = live.queues.get(queue) or LiveQueue(queue, "classic", True, False, {})
    return replace(live, queues={**live.queues, queue: replace(there, arguments={})})


def _in_effect(live: LiveState, queue: Queue) -> Mapping[str, Any]:
    """What the live policies set on ``queue`` now: the winning policy's definition (ours, or
    another with a higher priority: then ours, raised above it, brings its limits in at once),
    with an operator policy's lower limits merged in."""
    matching = [p for p in live.policies if matches(p, queue.name, queue.queue_type)]
    regular = top([p for p in matching if not p.operator])
    effective = dict(regular[0].definition) if regular else {}
    operators = [p.definition for p in top([p for p in matching if p.operator])[:1]]
    return {**effective, **lowest_limits([effective, *operators])}


def _evicted(plan: Plan, queue: Queue, there: LiveQueue, file: Mapping[str, Any],
             was: Mapping[str, Any], *, moving: bool = False) -> list[Eviction]:
    """``moving``: messages are moved into ``there`` (``moved_in``): a quorum queue refuses
    those over its length limit, and the limit's argument is the live queue's, not
    ``migrate``'s."""
    refused = moving and queue.queue_type == "quorum"
    to = None if refused else _route(plan, queue)
    ready = there.messages_ready
    # The live queue's arguments, or the file's where they differ: migrate rebuilds it so.
    args = queue.arguments
    out = []

    def evict(setting: str, old: int | None, new: int, count: int, exact: bool,
              ttl: bool = False) -> None:
        out.append(Eviction(queue.name, setting, _show(old, ttl), _show(new, ttl),
                            min(count, ready), ready, exact and not refused, to,
                            refused=refused and not ttl))

    # A full quorum queue refuses publishes: nothing leaves (moved copies are refused).
    if queue.queue_type != "quorum" or moving:
        live_args = there.arguments
        new = _lowest(file.get("max-length"), args.get("x-max-length"))
        old = _lowest(was.get("max-length"), live_args.get("x-max-length"))
        if new is not None and ready > new and (old is None or old > new):
            setting = ("max_length" if _int(file.get("max-length")) == new
                       else "x-max-length" if moving else "x-max-length (migrate)")
            evict(setting, old, new, ready - new, True)
        new_bytes = _lowest(file.get("max-length-bytes"), args.get("x-max-length-bytes"))
        old_bytes = _lowest(was.get("max-length-bytes"), live_args.get("x-max-length-bytes"))
        size = there.message_bytes_ready
        if (new_bytes is not None and size > new_bytes
                and (old_bytes is None or old_bytes > new_bytes)):
            # How many depends on their sizes, which only the broker knows: an upper bound.
            evict("max_length_bytes", old_bytes, new_bytes, ready, False)
    new_ttl, old_ttl = _int(file.get("message-ttl")), _int(was.get("message-ttl"))
    if new_ttl is not None and (old_ttl is None or old_ttl > new_ttl):
        evict("message_ttl", old_ttl, new_ttl, ready, False, ttl=True)
    return out


def dead_letter_routes(plan: Plan, changes: Sequence[Change],
                       queues: Iterable[str]) -> list[Change]:
    """The changes that move the route of ``queues``' own dead letters (key ``Q`` on
    ``Q.retry``) to ``Q.parking`` or nowhere, as the file says, with the parking queue it may
    need: what ``migrate`` makes before it refills a queue under a new limit, so that what does
    not fit is never sent round a tier (``apply`` makes the rest afterwards). A queue whose file
    routes them to a tier is left to ``apply``: its new first tier may not exist yet."""
    wanted = set(queues)

    def parks_or_drops(queue: Queue) -> bool:  # key Q bound to Q.parking, or to nothing
        return all(b.destination == naming.parking_queue(queue.name) for b in plan.bindings
                   if b.source == naming.retry_exchange(queue.name)
                   and b.routing_key == queue.name)

    names = {q.name for q in plan.main_queues if q.name in wanted and parks_or_drops(q)}

    def routes(change: Change) -> bool:
        item = change.item
        if isinstance(item, Binding):
            return (change.kind in ("create", "unbind") and item.routing_key in names
                    and item.source == naming.retry_exchange(item.routing_key))
        return (isinstance(item, Queue) and change.kind == "create" and item.role == "parking"
                and item.owner in names)

    return [c for c in changes if routes(c)]
