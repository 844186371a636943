"""The test broker's RabbitMQ: exchanges and bindings, classic and quorum queues, dead-lettering
with the headers each version writes, message TTLs on a virtual clock, delivery limits and
overflow (test-only; synchronous: ``amqp`` puts aiormq's face on it).

What each version does, as captured from real brokers (tests/unit/fixtures/deliveries-*.json,
docs/versions.md) and read in RabbitMQ's source:

- **Dead-letter history.** 3.x writes it into the message's headers when it dead-letters: one
  ``x-death`` table per (queue, reason), a repeat moved to the front with its ``count`` plus
  one, ``x-first-death-*`` on the first death (an ``x-death`` a client published counts as
  history). 4.x keeps it beside the message and renders it at each delivery: the same tables
  (newest first), ``x-first-death-*`` and ``x-last-death-*``, an ``x-death`` written by a
  client ignored and replaced; the headers then come sorted by name. Both drop a per-message
  ``expiration`` and note it as ``original-expiration``.
- **Returns on quorum queues** (a channel closed with the delivery unacked, a requeue). 3.x
  counts each in ``x-delivery-count``; a dead-letter cycle starts the message at zero again.
  4.0 counts each and counts the ``nack`` that dead-letters too; the count travels with the
  message and shows when the queue has none of its own. 4.3 keeps ``x-delivery-count`` across
  dead-lettering, does not count a ``nack(requeue)`` there but in ``x-acquired-count``, and
  counts a ``reject(requeue=false)`` (not a ``nack``) in both before dead-lettering it. Beyond
  the queue's delivery limit (4.x: 20 unless set) the message is dead-lettered with reason
  ``delivery_limit``. Classic queues count nothing: only the ``redelivered`` flag.
- **Dead-letter cycles.** A message dead-lettered (other than by a rejection) back into a queue
  it already died in, with no rejection since, is dropped.
- **Single active consumer** (``x-single-active-consumer``): only the queue's earliest consumer
  still registered gets deliveries; when it goes (cancelled, its channel closed), the next one
  takes over, and its returned deliveries with it.
- **Exchange-to-exchange bindings** route on with the same routing key and headers; a
  destination reached twice takes the message once.
- **``x-consistent-hash``** (RabbitMQ's plugin, taken as enabled): each binding's key is its
  weight, buckets numbered in binding order, a message hashed on its routing key or on the header
  its ``hash-header`` argument names, then jump-consistent-hashed onto the buckets. The hash
  function is not Erlang's ``phash2``: which queue a key lands in differs from RabbitMQ's, that
  the same key always lands in the same queue (while the bindings stay) does not.

Not modelled: priorities, ``CC``/``BCC`` routing, clustering, and the moment a delivery is in
flight (a cancelled consumer here never has one on its way).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from rabbit_retry.testing import frames
from rabbit_retry.topology.plan import Exchange

Counting = Literal["3.x", "4.0", "4.3"]


@dataclass(frozen=True, slots=True)
class Version:
    """What one RabbitMQ version does that the worker's decisions depend on."""

    label: str  # "4.3"
    server: str  # the server's ``version`` property, as the tested broker reports it
    counting: Counting
    default_delivery_limit: int | None
    max_message_size: int  # bytes of body

    @property
    def annotations(self) -> bool:
        """Dead-letter history kept beside the message and rendered at delivery (4.x)."""
        return self.counting != "3.x"


VERSIONS = {
    "3.10": Version("3.10", "3.10.8", "3.x", None, 128 * 1024 * 1024),
    "4.0": Version("4.0", "4.0.5", "4.0", 20, 16 * 1024 * 1024),
    "4.3": Version("4.3", "4.3.6", "4.3", 20, 16 * 1024 * 1024),
}

EXCHANGE_TYPES = ("direct", "fanout", "topic", "headers", "x-consistent-hash")


class BrokerError(Exception):
    """A channel-level refusal: ``code`` is the AMQP reply code (404, 406, ...)."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code
        self.text = text


def _not_found(kind: str, name: str, vhost: str) -> BrokerError:
    return BrokerError(404, f"NOT_FOUND - no {kind} '{name}' in vhost '{vhost}'")


@dataclass(frozen=True, slots=True)
class Death:
    """One (queue, reason) of a 4.x message's dead-letter history."""

    queue: str
    reason: str
    exchange: str
    routing_keys: tuple[str, ...]
    count: int
    first_ms: int
    ttl: int | None  # the per-message TTL it had, as ``original-expiration``


@dataclass(frozen=True, slots=True)
class Content:
    """A message as it travels between queues: body, content header (the wire), where it was
    last published or dead-lettered to, and what 4.x keeps beside it."""

    body: bytes
    header: bytes
    exchange: str
    routing_keys: tuple[str, ...]
    ttl: int | None  # per-message TTL in ms (``expiration``)
    deaths: tuple[Death, ...] = ()  # 4.x, newest first
    first_death: tuple[str, str, str] | None = None  # 4.x: reason, queue, exchange
    last_death: tuple[str, str, str] | None = None
    delivery_count: int = 0  # 4.x: x-delivery-count carried across dead-lettering
    acquired_count: int = 0  # 4.3: x-acquired-count, likewise


@dataclass(eq=False, slots=True)
class Entry:
    """A message in one queue."""

    content: Content
    seq: int
    expires_at: int | None  # virtual ms
    redelivered: bool = False  # classic queues' only memory of a return
    returns: int = 0  # quorum: this queue's x-delivery-count
    acquired: int = 0  # quorum 4.3: this queue's x-acquired-count


@dataclass(eq=False)
class Consumer:
    """A consumer as the queue sees it: its prefetch (0: unlimited) and how many of its
    deliveries are unacked; ``deliver`` hands an entry to its channel, ``cancelled`` tells the
    channel the broker cancelled it (its queue was deleted)."""

    tag: str
    queue: Queue
    prefetch: int
    deliver: Callable[[Entry], None]
    cancelled: Callable[[], None]
    unacked: int = 0

    @property
    def has_credit(self) -> bool:
        return self.prefetch == 0 or self.unacked < self.prefetch


@dataclass(frozen=True, slots=True)
class Binding:
    queue: str  # the destination: a queue, or with ``to_exchange`` an exchange
    routing_key: str
    arguments: Mapping[str, Any]
    to_exchange: bool = False


@dataclass(eq=False)
class Queue:
    name: str
    durable: bool
    exclusive: bool
    auto_delete: bool
    arguments: Mapping[str, Any]
    policy: Mapping[str, Any] = field(default_factory=dict)
    ready: list[Entry] = field(default_factory=list)  # in order (classic: returns by seq)
    returned: deque[Entry] = field(default_factory=deque)  # quorum: returns, delivered first
    consumers: list[Consumer] = field(default_factory=list)
    turn: int = 0  # round robin among consumers

    @property
    def kind(self) -> str:
        return str(self.arguments.get("x-queue-type", "classic"))

    @property
    def quorum(self) -> bool:
        return self.kind == "quorum"

    @property
    def single_active(self) -> bool:
        return self.arguments.get("x-single-active-consumer") is True

    def setting(self, argument: str, key: str, lowest: bool = True) -> Any:
        """A queue argument or the queue's policy key; where both are numbers, the lower."""
        mine, theirs = self.arguments.get(argument), self.policy.get(key)
        if mine is None:
            return theirs
        if theirs is not None and lowest and _is_int(mine) and _is_int(theirs):
            return min(mine, theirs)
        return mine

    def head(self) -> Entry | None:
        if self.returned:
            return self.returned[0]
        return self.ready[0] if self.ready else None

    def pop(self) -> Entry:
        return self.returned.popleft() if self.returned else self.ready.pop(0)

    def __len__(self) -> int:
        return len(self.ready) + len(self.returned)

    def entries(self) -> Iterator[Entry]:
        yield from self.returned
        yield from self.ready


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class Discarded:
    """A message the broker let go of without a consumer's verdict, and why."""

    queue: str
    reason: str
    content: Content


@dataclass(frozen=True, slots=True)
class Routed:
    """Where a publish went: the queues that took it, and those whose overflow rule refused it
    (its publisher gets a ``basic.nack``)."""

    queues: tuple[str, ...]
    refused: tuple[str, ...] = ()
    content: Content | None = None  # a dead-lettered message as it left for ``queues``


DEFAULT_EXCHANGES = (
    ("amq.direct", "direct"),
    ("amq.fanout", "fanout"),
    ("amq.topic", "topic"),
    ("amq.headers", "headers"),
    ("amq.match", "headers"),
)


class Memory:
    """One vhost of one broker, in memory. ``now_ms`` is the virtual clock: it moves only when
    ``expire`` is asked to move it. ``changed`` is called after anything that may let a
    delivery happen (``amqp`` schedules ``dispatch`` on it)."""

    def __init__(self, version: Version, *, start_ms: int, vhost: str = "/") -> None:
        self.version = version
        self.now_ms = start_ms
        self.vhost = vhost
        self.exchanges: dict[str, Exchange] = {"": Exchange("", "direct")}
        for name, kind in DEFAULT_EXCHANGES:
            self.exchanges[name] = Exchange(name, kind)
        self.bindings: dict[str, list[Binding]] = {}  # exchange -> its bindings
        self.queues: dict[str, Queue] = {}
        self.discarded: list[Discarded] = []
        self.changed: Callable[[], None] = lambda: None
        self._seq = itertools.count()

    # --- objects -------------------------------------------------------------------------------

    def exchange(self, name: str) -> Exchange:
        try:
            return self.exchanges[name]
        except KeyError:
            raise _not_found("exchange", name, self.vhost) from None

    def queue(self, name: str) -> Queue:
        try:
            return self.queues[name]
        except KeyError:
            raise _not_found("queue", name, self.vhost) from None

    def declare_exchange(
        self, name: str, kind: str, *, passive: bool = False, durable: bool = True,
        auto_delete: bool = False, internal: bool = False,
        arguments: Mapping[str, Any] | None = None,
    ) -> Exchange:
        if passive or name == "":
            return self.exchange(name)
        if kind not in EXCHANGE_TYPES:
            raise BrokerError(503, f"COMMAND_INVALID - unknown exchange type '{kind}'")
        current = self.exchanges.get(name)
        if current is None:
            current = self.exchanges[name] = Exchange(
                name, kind, durable, auto_delete, internal, dict(arguments or {})
            )
        elif (current.type, current.durable) != (kind, durable):
            raise BrokerError(
                406, f"PRECONDITION_FAILED - inequivalent arg 'type' for exchange '{name}' in "
                f"vhost '{self.vhost}': received '{kind}' but current is '{current.type}'"
            )
        return current

    def declare_queue(
        self, name: str, *, passive: bool = False, durable: bool = False,
        exclusive: bool = False, auto_delete: bool = False,
        arguments: Mapping[str, Any] | None = None, policy: Mapping[str, Any] | None = None,
    ) -> Queue:
        if passive:
            return self.queue(name)
        wanted = dict(arguments or {})
        current = self.queues.get(name)
        if current is not None:
            for key in sorted(set(wanted) | set(current.arguments)):
                if wanted.get(key) != current.arguments.get(key):
                    raise BrokerError(
                        406, f"PRECONDITION_FAILED - inequivalent arg '{key}' for queue "
                        f"'{name}' in vhost '{self.vhost}': received {wanted.get(key)!r} but "
                        f"current is {current.arguments.get(key)!r}"
                    )
            return current
        if wanted.get("x-queue-type") == "quorum" and not durable:
            raise BrokerError(
                406, f"PRECONDITION_FAILED - invalid property 'non-durable' for queue '{name}'"
            )
        queue = self.queues[name] = Queue(name, durable, exclusive, auto_delete, wanted,
                                          dict(policy or {}))
        return queue

    def bind(
        self, queue: str, exchange: str, routing_key: str,
        arguments: Mapping[str, Any] | None = None,
    ) -> None:
        self.queue(queue)
        binding = Binding(queue, routing_key, dict(arguments or {}))
        target = self.exchange(exchange)
        if exchange == "":
            raise BrokerError(403, "ACCESS_REFUSED - operation not permitted on the default "
                                   "exchange")
        bound = self.bindings.setdefault(target.name, [])
        if binding not in bound:
            bound.append(binding)
        self.changed()

    def unbind(
        self, queue: str, exchange: str, routing_key: str,
        arguments: Mapping[str, Any] | None = None,
    ) -> None:
        target = self.exchange(exchange)
        binding = Binding(queue, routing_key, dict(arguments or {}))
        if binding in self.bindings.get(target.name, []):
            self.bindings[target.name].remove(binding)

    def bind_exchange(
        self, destination: str, source: str, routing_key: str,
        arguments: Mapping[str, Any] | None = None, *, unbind: bool = False,
    ) -> None:
        """``exchange.bind`` (``unbind``: ``exchange.unbind``): ``source`` routes on to
        ``destination``."""
        self.exchange(destination)
        origin = self.exchange(source)
        if "" in (source, destination):
            raise BrokerError(403, "ACCESS_REFUSED - operation not permitted on the default "
                                   "exchange")
        binding = Binding(destination, routing_key, dict(arguments or {}), to_exchange=True)
        bound = self.bindings.setdefault(origin.name, [])
        if unbind:
            if binding in bound:
                bound.remove(binding)
        elif binding not in bound:
            bound.append(binding)

    def delete_queue(self, name: str) -> int:
        """Deletes ``name`` with its ready messages; its consumers are cancelled."""
        queue = self.queues.pop(name, None)
        if queue is None:
            return 0
        for exchange, bound in self.bindings.items():
            self.bindings[exchange] = [b for b in bound if b.to_exchange or b.queue != name]
        for consumer in list(queue.consumers):
            queue.consumers.remove(consumer)
            consumer.cancelled()
        return len(queue)

    def delete_exchange(self, name: str) -> None:
        if name == "" or name.startswith("amq."):
            raise BrokerError(403, f"ACCESS_REFUSED - operation not permitted on exchange "
                                   f"'{name}'")
        self.exchanges.pop(name, None)
        self.bindings.pop(name, None)
        for exchange, bound in self.bindings.items():
            self.bindings[exchange] = [b for b in bound if not (b.to_exchange and b.queue == name)]

    def purge(self, name: str) -> int:
        queue = self.queue(name)
        count = len(queue)
        queue.ready.clear()
        queue.returned.clear()
        return count

    # --- routing -------------------------------------------------------------------------------

    def route(
        self, exchange: Exchange, routing_key: str, headers: Mapping[str, Any] | None,
        _seen: set[str] | None = None,
    ) -> list[Queue]:
        """The queues a message published to ``exchange`` reaches (its alternate exchange's,
        when its own bindings match nothing; on through exchange-to-exchange bindings, each
        exchange once)."""
        names: list[str] = []
        seen = set() if _seen is None else _seen
        current: Exchange | None = exchange
        found: list[Queue] = []
        while current is not None and current.name not in seen:
            seen.add(current.name)
            if current.name == "":
                names = [routing_key] if routing_key in self.queues else []
                bound: list[Binding] = []
            elif current.type == "x-consistent-hash":
                bound = self._hashed(current, routing_key, headers)
            else:
                bound = [b for b in self.bindings.get(current.name, [])
                         if _matches(current.type, b, routing_key, headers)]
            names += [b.queue for b in bound if not b.to_exchange]
            for b in bound:
                if b.to_exchange and b.queue in self.exchanges:
                    found += self.route(self.exchanges[b.queue], routing_key, headers, seen)
            if names or found:
                break
            alternate = current.arguments.get("alternate-exchange")
            current = self.exchanges.get(alternate) if isinstance(alternate, str) else None
        queues = [self.queues[n] for n in dict.fromkeys(names) if n in self.queues]
        return list(dict.fromkeys(queues + found))

    def _hashed(
        self, exchange: Exchange, routing_key: str, headers: Mapping[str, Any] | None
    ) -> list[Binding]:
        """The one binding of a consistent-hash exchange a message goes to (none bound: none)."""
        buckets: list[Binding] = []
        for binding in self.bindings.get(exchange.name, []):
            weight = binding.routing_key
            buckets += [binding] * (int(weight) if weight.isdigit() else 0)
        if not buckets:
            return []
        header = exchange.arguments.get("hash-header")
        value = (headers or {}).get(header) if isinstance(header, str) else routing_key
        return [buckets[_jump_hash(_stable_hash(value), len(buckets))]]

    def publish(
        self, exchange: str, routing_key: str, body: bytes, header: bytes, *, returns: int = 0
    ) -> Routed:
        """A client's publish: ``header`` is the content header it sent. With ``returns``, each
        queue takes it as a delivery that came back that many times without a verdict."""
        properties = frames.unmarshal(header)
        ttl = parse_expiration(properties.expiration)
        if len(body) > self.version.max_message_size:
            raise BrokerError(
                406, f"PRECONDITION_FAILED - message size {len(body)} is larger than configured "
                f"max size {self.version.max_message_size}"
            )
        content = Content(body, header, exchange, (routing_key,), ttl)
        queues = self.route(self.exchange(exchange), routing_key, properties.headers)
        taken, refused = [], []
        for queue in queues:
            entry = self._enqueue(queue, content)
            if entry is None:
                refused.append(queue.name)
                continue
            taken.append(queue.name)
            if returns:
                queue.ready.remove(entry)
                if all(self._count_return(queue, entry, "close") for _ in range(returns)):
                    self._place_returned(queue, entry)
        if taken:
            self.changed()
        return Routed(tuple(taken), tuple(refused))

    def _enqueue(self, queue: Queue, content: Content) -> Entry | None:
        """Puts ``content`` at the end of ``queue``; None when the queue refused it."""
        limit = queue.setting("x-max-length", "max-length")
        limit_bytes = queue.setting("x-max-length-bytes", "max-length-bytes")
        overflow = queue.setting("x-overflow", "overflow", lowest=False) or "drop-head"

        def full() -> bool:
            return (_is_int(limit) and len(queue) >= limit) or (
                _is_int(limit_bytes)
                and sum(len(e.content.body) for e in queue.entries()) + len(content.body)
                > limit_bytes
            )

        if full():
            if overflow in ("reject-publish", "reject-publish-dlx"):
                if overflow == "reject-publish-dlx":
                    self._dead_letter(queue, Entry(content, -1, None), "maxlen")
                return None
            while len(queue) and full():
                self._dead_letter(queue, queue.pop(), "maxlen")
        ttls = [t for t in (queue.setting("x-message-ttl", "message-ttl"), content.ttl)
                if isinstance(t, int) and not isinstance(t, bool)]
        entry = Entry(content, next(self._seq),
                      self.now_ms + min(ttls) if ttls else None)
        if queue.quorum and self.version.counting == "4.3":
            entry.returns = content.delivery_count  # 4.3 keeps the count across queues
        queue.ready.append(entry)
        return entry

    # --- consuming -----------------------------------------------------------------------------

    def consume(self, queue: str, consumer: Consumer) -> None:
        self.queue(queue).consumers.append(consumer)
        self.changed()

    def cancel(self, consumer: Consumer) -> None:
        if consumer in consumer.queue.consumers:
            consumer.queue.consumers.remove(consumer)

    def get(self, name: str) -> Entry | None:
        """``basic.get``: the head of ``name`` (expired heads dead-lettered first)."""
        queue = self.queue(name)
        self._expire_heads(queue)
        return queue.pop() if len(queue) else None

    def dispatch(self) -> int:
        """Hands ready messages to consumers with credit, round robin; how many it handed."""
        handed = 0
        progress = True
        while progress:
            progress = False
            for queue in list(self.queues.values()):
                if not queue.consumers:
                    continue
                self._expire_heads(queue)
                if not len(queue):
                    continue
                consumer = self._next_consumer(queue)
                if consumer is None:
                    continue
                entry = queue.pop()
                consumer.unacked += 1
                consumer.deliver(entry)
                handed += 1
                progress = True
        return handed

    @staticmethod
    def _next_consumer(queue: Queue) -> Consumer | None:
        if queue.single_active:  # only the earliest consumer still there gets anything
            active = queue.consumers[0]
            return active if active.has_credit else None
        count = len(queue.consumers)
        for step in range(count):
            consumer = queue.consumers[(queue.turn + step) % count]
            if consumer.has_credit:
                queue.turn = (queue.turn + step + 1) % count
                return consumer
        return None

    def render(self, queue: Queue, entry: Entry) -> tuple[bytes, bool]:
        """The content header and ``redelivered`` flag of ``entry`` delivered from ``queue``."""
        content = entry.content
        if not self.version.annotations:
            if queue.quorum and entry.returns > 0:
                return _with_entries(content.header, [
                    ("x-delivery-count", frames.long(entry.returns))
                ]), True
            return content.header, entry.redelivered or entry.returns > 0
        added = _death_annotations(content)
        redelivered = entry.redelivered
        if queue.quorum:
            counts = self._return_counts(entry)
            added += counts
            redelivered = bool(counts)
        if not added:
            return content.header, redelivered
        names = {name for name, _ in added}
        kept = [(n, v) for n, v in frames.header_entries(content.header) or [] if n not in names]
        # RabbitMQ 4.x adds its annotations to the table and then sorts it by name.
        return frames.rewrite(content.header, sorted(added + kept, key=lambda e: e[0])), \
            redelivered

    def _return_counts(self, entry: Entry) -> frames.Entries:
        """A quorum queue's annotations of how often ``entry`` came back (4.x)."""
        content = entry.content
        delivered = entry.returns or (
            content.delivery_count if self.version.counting == "4.0" else 0
        )
        acquired = entry.acquired or content.acquired_count
        counts: frames.Entries = []
        if delivered:
            counts.append(("x-delivery-count", frames.long(delivered)))
        if acquired and self.version.counting == "4.3":
            counts.append(("x-acquired-count", frames.long(acquired)))
        return counts

    # --- settling ------------------------------------------------------------------------------

    def give_back(
        self, queue: Queue, entry: Entry, how: Literal["close", "reject", "nack"]
    ) -> None:
        """A delivery back to ``queue`` without a verdict: its channel closed, or it was
        requeued by ``reject`` or ``nack``."""
        if queue is not self.queues.get(queue.name):
            return  # the queue was deleted meanwhile
        if self._count_return(queue, entry, how):
            self._place_returned(queue, entry)
        self.changed()

    def _count_return(self, queue: Queue, entry: Entry, how: str) -> bool:
        """Counts one return of ``entry``; False when that took it past the delivery limit
        (it is dead-lettered then)."""
        if not queue.quorum:
            entry.redelivered = True
            return True
        entry.acquired += 1
        if how != "nack" or self.version.counting != "4.3":
            entry.returns += 1
        limit = queue.setting("x-delivery-limit", "delivery-limit")
        if limit is None:
            limit = self.version.default_delivery_limit
        # 4.x reads a negative limit as none; 3.10 drops at the first return.
        if _is_int(limit) and (limit >= 0 or not self.version.annotations) \
                and entry.returns > limit:
            self._dead_letter(queue, entry, "delivery_limit")
            return False
        return True

    @staticmethod
    def _place_returned(queue: Queue, entry: Entry) -> None:
        """Back at the head: a classic queue puts it where it was, a quorum queue delivers its
        returns before anything else."""
        if queue.quorum:
            queue.returned.append(entry)
        else:
            bisect.insort(queue.ready, entry, key=lambda e: e.seq)

    def reject(
        self, queue: Queue, entry: Entry, how: Literal["reject", "nack"] = "nack"
    ) -> Routed:
        """``nack``/``reject`` without requeue: dead-lettered with reason ``rejected``."""
        if queue is not self.queues.get(queue.name):
            return Routed(())
        if queue.quorum and self.version.counting == "4.0":
            entry.returns += 1  # 4.0 counts the nack or reject that dead-letters it
        elif queue.quorum and self.version.counting == "4.3" and how == "reject":
            # 4.3 counts a reject (not a nack) as a delivery, and the acquired count with it.
            entry.returns += 1
            entry.acquired = entry.returns
        return self._dead_letter(queue, entry, "rejected")

    # --- dead-lettering ------------------------------------------------------------------------

    def _dead_letter(self, queue: Queue, entry: Entry, reason: str) -> Routed:
        content = entry.content
        dlx = queue.setting("x-dead-letter-exchange", "dead-letter-exchange", lowest=False)
        if not isinstance(dlx, str):
            self._discard(queue, content, f"{reason}, and the queue has no dead-letter exchange")
            return Routed(())
        exchange = self.exchanges.get(dlx)
        if exchange is None:
            self._discard(queue, content, f"{reason}; dead-letter exchange '{dlx}' missing")
            return Routed(())
        dlrk = queue.setting("x-dead-letter-routing-key", "dead-letter-routing-key",
                             lowest=False)
        keys = (dlrk,) if isinstance(dlrk, str) else content.routing_keys
        dead = self._record_death(queue, entry, reason, dlx, keys)
        if dead is None:
            self._discard(queue, content, f"{reason}; RabbitMQ {self.version.label} cannot "
                                          "update the message's x-death (a client wrote it)")
            return Routed(())
        headers = frames.unmarshal(dead.header).headers
        targets: list[Queue] = []
        for key in keys:
            targets += [q for q in self.route(exchange, key, headers) if q not in targets]
        if reason != "rejected":
            cyclic = [q for q in targets if self._is_cycle(q.name, dead)]
            for target in cyclic:
                self._discard(queue, dead, f"{reason}; dead-letter cycle back into "
                                           f"'{target.name}' with no rejection in it")
            targets = [q for q in targets if q not in cyclic]
            if cyclic and not targets:
                return Routed(())
        if not targets:
            self._discard(queue, dead, f"{reason}; nothing bound to dead-letter exchange "
                                       f"'{dlx}' for {list(keys)}")
            return Routed(())
        for target in targets:
            self._enqueue(target, dead)
        self.changed()
        return Routed(tuple(t.name for t in targets), content=dead)

    def _discard(self, queue: Queue, content: Content, reason: str) -> None:
        self.discarded.append(Discarded(queue.name, reason, content))

    def _record_death(
        self, queue: Queue, entry: Entry, reason: str, dlx: str, keys: Sequence[str]
    ) -> Content | None:
        """The message as it leaves ``queue`` for ``dlx``: its history updated, its
        per-message TTL gone; None where 3.x would crash on a client's ``x-death``."""
        content = entry.content
        moved: dict[str, Any] = {"exchange": dlx, "routing_keys": tuple(keys), "ttl": None}
        if self.version.annotations:
            moved.update(self._death_annotations(queue.name, content, reason))
            if queue.quorum:
                if self.version.counting == "4.0":
                    moved["delivery_count"] = content.delivery_count + entry.returns
                else:
                    moved["delivery_count"] = entry.returns
                    moved["acquired_count"] = entry.acquired or content.acquired_count
            entries = frames.header_entries(content.header)
        else:
            entries = self._death_header(queue.name, content, reason)
            if entries is None:
                return None
        header = frames.rewrite(content.header, entries, drop_expiration=True)
        return replace(content, header=header, **moved)

    def _death_annotations(self, queue: str, content: Content, reason: str) -> dict[str, Any]:
        deaths = list(content.deaths)
        for index, death in enumerate(deaths):
            if (death.queue, death.reason) == (queue, reason):
                deaths.pop(index)
                deaths.insert(0, replace(death, count=death.count + 1))
                break
        else:
            deaths.insert(0, Death(queue, reason, content.exchange, content.routing_keys, 1,
                                   self.now_ms, content.ttl))
        this = (reason, queue, content.exchange)
        return {"deaths": tuple(deaths), "first_death": content.first_death or this,
                "last_death": this}

    def _death_header(self, queue: str, content: Content, reason: str) -> frames.Entries | None:
        """3.x: the headers with this death written into ``x-death``."""
        entries = frames.header_entries(content.header) or []
        info = [
            ("reason", frames.longstr(reason)),
            ("queue", frames.longstr(queue)),
            ("time", frames.timestamp(self.now_ms // 1000)),
            ("exchange", frames.longstr(content.exchange)),
            ("routing-keys", frames.array([frames.longstr(k) for k in content.routing_keys])),
        ]
        if content.ttl is not None:
            info.append(("original-expiration", frames.longstr(str(content.ttl))))
        at = next((i for i, (name, _) in enumerate(entries) if name == "x-death"), None)
        if at is None:
            first = [(f"x-first-death-{k}", frames.longstr(v))
                     for k, v in (("reason", reason), ("queue", queue),
                                  ("exchange", content.exchange))]
            fresh = frames.array([frames.table([("count", frames.long(1)), *info])])
            return [("x-death", fresh), *first, *entries]
        raw = entries[at][1]
        if raw[:1] != b"A":
            entries[at] = ("x-death", frames.array([frames.table([("count", frames.long(1)),
                                                                  *info])]))
            return entries
        deaths = _counted_on(frames.items(raw[1:]), queue, reason, info)
        if deaths is None:
            return None
        entries[at] = ("x-death", deaths)
        return entries

    def _is_cycle(self, target: str, content: Content) -> bool:
        """RabbitMQ's rule: a cycle back into ``target`` with no rejection since it died there."""
        history: list[tuple[object, object]] = [(d.queue, d.reason) for d in content.deaths]
        if not self.version.annotations:
            deaths = (frames.unmarshal(content.header).headers or {}).get("x-death")
            for death in deaths if isinstance(deaths, list) else []:
                if isinstance(death, Mapping):
                    history.append((death.get("queue"), death.get("reason")))
        for queue, reason in history:
            if reason == "rejected":
                return False
            if queue == target:
                return True
        return False

    # --- time ----------------------------------------------------------------------------------

    def next_expiry(self) -> int | None:
        """When the earliest queue head expires (virtual ms); None when none will."""
        times = [head.expires_at for q in self.queues.values()
                 if (head := q.head()) is not None and head.expires_at is not None]
        return min(times) if times else None

    def expire(self, until_ms: int) -> None:
        """Moves the clock to ``until_ms``, expiring heads at their own times on the way."""
        while (due := self.next_expiry()) is not None and due <= until_ms:
            self.now_ms = max(self.now_ms, due)
            for queue in list(self.queues.values()):
                self._expire_heads(queue)
        self.now_ms = max(self.now_ms, until_ms)

    def _expire_heads(self, queue: Queue) -> None:
        while (head := queue.head()) is not None and head.expires_at is not None \
                and head.expires_at <= self.now_ms:
            queue.pop()
            self._dead_letter(queue, head, "expired")


def _stable_hash(value: object) -> int:
    """The same number for the same value in every process (``hash`` of a str is salted)."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "big")


def _jump_hash(key: int, buckets: int) -> int:
    """Jump consistent hashing (Lamping and Veach), as the plugin spreads keys over buckets."""
    chosen, jump = -1, 0
    while jump < buckets:
        chosen = jump
        key = (key * 2862933555777941757 + 1) % 2**64
        jump = int((chosen + 1) * (2**31 / ((key >> 33) + 1)))
    return chosen


def _matches(kind: str, binding: Binding, key: str, headers: Mapping[str, Any] | None) -> bool:
    if kind == "fanout":
        return True
    if kind == "direct":
        return binding.routing_key == key
    if kind == "topic":
        return _topic(binding.routing_key.split("."), key.split("."))
    wanted = {k: v for k, v in binding.arguments.items() if not k.startswith("x-")}
    mode = binding.arguments.get("x-match", "all")
    have = dict(headers or {})
    if not str(mode).endswith("-with-x"):
        have = {k: v for k, v in have.items() if not k.startswith("x-")}
    hits = [k in have and (v is None or have[k] == v) for k, v in wanted.items()]
    if str(mode).startswith("any"):
        return any(hits)
    return all(hits)


def _topic(pattern: list[str], words: list[str]) -> bool:
    if not pattern:
        return not words
    if pattern[0] == "#":
        return any(_topic(pattern[1:], words[i:]) for i in range(len(words) + 1))
    if not words:
        return False
    return pattern[0] in ("*", words[0]) and _topic(pattern[1:], words[1:])


def parse_expiration(expiration: object) -> int | None:
    """A message's ``expiration`` property as milliseconds; ``BrokerError`` (406) when it is
    not a non-negative integer, as RabbitMQ refuses it."""
    if expiration is None or expiration == "":
        return None
    text = str(expiration)
    if not (text.isascii() and text.isdigit()):
        raise BrokerError(406, f"PRECONDITION_FAILED - invalid expiration '{text}'")
    return int(text)


def _death_table(death: Death) -> bytes:
    fields: frames.Entries = []
    if death.ttl is not None:
        fields.append(("original-expiration", frames.longstr(str(death.ttl))))
    fields += [
        ("count", frames.long(death.count)),
        ("reason", frames.longstr(death.reason)),
        ("queue", frames.longstr(death.queue)),
        ("time", frames.timestamp(death.first_ms // 1000)),
        ("exchange", frames.longstr(death.exchange)),
        ("routing-keys", frames.array([frames.longstr(k) for k in death.routing_keys])),
    ]
    return frames.table(fields)


def _with_entries(header: bytes, added: frames.Entries) -> bytes:
    """``header`` with ``added`` set: replaced in place where present, else appended."""
    new = dict(added)
    entries = [(n, new.pop(n) if n in new else v) for n, v in frames.header_entries(header) or []]
    return frames.rewrite(header, entries + list(new.items()))


def _death_annotations(content: Content) -> frames.Entries:
    """``x-death`` and the ``x-first-death-*`` / ``x-last-death-*`` headers (4.x)."""
    added: frames.Entries = []
    if content.deaths:
        added.append(("x-death", frames.array([_death_table(d) for d in content.deaths])))
    for prefix, death in (("first", content.first_death), ("last", content.last_death)):
        if death is not None:
            for name, text in zip(("reason", "queue", "exchange"), death, strict=True):
                added.append((f"x-{prefix}-death-{name}", frames.longstr(text)))
    return added


def _counted_on(tables: list[bytes], queue: str, reason: str,
                info: frames.Entries) -> bytes | None:
    """3.x's ``x-death`` array with this death counted: the entry of (``queue``, ``reason``)
    counted on and moved first, or a new one first; None where 3.x would crash (an entry not a
    table, a count not a number)."""
    if any(t[:1] != b"F" for t in tables):
        return None
    others = []
    updated: frames.Entries | None = None
    for fields in (frames.entries(t[1:]) for t in tables):
        values = {name: frames.value(v) for name, v in fields}
        count = values.get("count")
        if not _is_int(count):
            return None  # 3.x crashes counting on from it
        if updated is None and (values.get("queue"), values.get("reason")) == (queue, reason):
            assert isinstance(count, int)
            updated = sorted([(n, frames.long(count + 1) if n == "count" else v)
                              for n, v in fields])
        else:
            others.append(frames.table(fields))
    first_entry = updated if updated is not None else [("count", frames.long(1)), *info]
    return frames.array([frames.table(first_entry), *others])
