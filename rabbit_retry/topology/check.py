"""Rules a schema cannot express: references, reserved and derived names, queue arguments.

Pure: takes the parsed file, returns problems with the key path where each one lives, so the
loader can point at the line. Every rule here stops something the broker would refuse halfway
through ``apply``, or something that would quietly break the retry wiring.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rabbit_retry.text import clip, shorten
from rabbit_retry.topology import naming
from rabbit_retry.topology.durations import label
from rabbit_retry.topology.limits import limit_problems
from rabbit_retry.topology.model import RetrySpec, TopologySpec, resolve
from rabbit_retry.topology.resolved import BindingConfig, QueueConfig

Path = tuple[str | int, ...]

MAX_NAME_BYTES = 255  # AMQP short strings: routing keys
# The AMQP 0-9-1 name domain, which pamqp (under aio-pika) enforces on every frame that names a
# queue or an exchange: RabbitMQ takes more, but the provisioner and the worker could not use it.
AMQP_NAME_CHARACTERS = frozenset(string.ascii_letters + string.digits + "-_.:@#,/+ ")
MAX_EXCHANGE_NAME = 127
# Q.retry must fit MAX_EXCHANGE_NAME; tier and parking names stay far below 255 after that.
MAX_QUEUE_NAME = MAX_EXCHANGE_NAME - len(naming.RETRY_SUFFIX)
BUILTIN_EXCHANGES = frozenset(
    {"amq.direct", "amq.fanout", "amq.headers", "amq.match", "amq.topic", "amq.rabbitmq.trace"}
)
_BUILTIN_HEADERS = frozenset({"amq.headers", "amq.match"})

# Arguments the compiler sets itself; a file that sets them would break the retry wiring.
MANAGED_QUEUE_ARGUMENTS = {
    "x-queue-type": "set queue_type instead",
    "x-dead-letter-exchange": "rabbit-retry routes dead letters to the retry exchange",
    "x-dead-letter-routing-key": "rabbit-retry routes dead letters to the retry exchange",
    "x-dead-letter-strategy": "rabbit-retry sets at-least-once on quorum queues",
    "x-message-ttl": "expired messages would loop through the retry tiers; use retry.delays",
    "x-expires": "an expiring main queue would take its messages with it",
}
QUORUM_MANAGED = {"x-overflow": "quorum queues need reject-publish for at-least-once dead letters"}

# Arguments RabbitMQ refuses for one queue type (PRECONDITION_FAILED, checked on 3.10): caught
# here so the file is rejected before apply has created anything.
UNSUPPORTED_ARGUMENTS: dict[str, frozenset[str]] = {
    "quorum": frozenset(
        {"x-max-priority", "x-queue-mode", "x-queue-master-locator", "x-queue-version", "x-max-age"}
    ),
    "classic": frozenset(
        {
            "x-delivery-limit",
            "x-quorum-initial-group-size",
            "x-max-in-memory-length",
            "x-max-in-memory-bytes",
            "x-max-age",
        }
    ),
}
# The value rules the broker applies to well-known arguments, so a typo fails validation.
_NON_NEGATIVE_INT = frozenset(
    {
        "x-max-length",
        "x-max-length-bytes",
        "x-delivery-limit",
        "x-max-in-memory-length",
        "x-max-in-memory-bytes",
    }
)
_ENUM_ARGUMENTS = {
    "x-overflow": ("drop-head", "reject-publish", "reject-publish-dlx"),
    "x-queue-mode": ("default", "lazy"),
}
_INT64 = range(-(2**63), 2**63)
# Derived queue name -> the main queue it belongs to: (parking queues, tier queues).
_Owners = tuple[dict[str, str], dict[str, str]]


@dataclass(frozen=True)
class Problem:
    path: Path
    message: str


def check(spec: TopologySpec) -> list[Problem]:
    """Every problem in ``spec``, in file order as far as the key paths allow."""
    topology = resolve(spec)
    queues = {q.name: q for q in topology.queues}
    problems: list[Problem] = []
    for ename, exchange in spec.exchanges.items():
        path: Path = ("exchanges", ename)
        problems += _name_problems(path, "exchange", ename)
        owner = _owner_of_retry_exchange(ename, queues)
        if owner is not None:
            problems.append(
                Problem(
                    path,
                    f"exchange {shorten(ename)} collides with the retry exchange of queue "
                    f"{shorten(owner)}, which rabbit-retry declares itself",
                )
            )
        problems += _argument_problems((*path, "arguments"), exchange.arguments)
        alternate = exchange.arguments.get("alternate-exchange")
        if alternate is not None and not isinstance(alternate, str):
            problems.append(
                Problem((*path, "arguments", "alternate-exchange"), "must be an exchange name")
            )
    owners: _Owners = ({}, {})
    for queue in queues.values():
        owners[0][naming.parking_queue(queue.name)] = queue.name
        owners[1].update((tier, queue.name) for tier in _tier_names(queue))
    if spec.defaults.retry is not None:
        problems += _delay_problems(("defaults", "retry"), spec.defaults.retry)
    for queue in queues.values():
        problems += _queue_problems(queue, queues, spec, owners)
    problems += _lane_problems(queues, spec)
    problems += _rename_problems(queues, owners)
    return problems


def _rename_problems(queues: Mapping[str, QueueConfig], owners: _Owners) -> list[Problem]:
    """``renamed_from``: a name the file no longer uses, neither as a queue nor as a name
    derived from one, renamed into one queue only; not on an ordered queue (its lanes)."""
    problems = []
    taken: dict[str, str] = {}
    derived: dict[str, str] = {}
    for queue in queues.values():
        derived[naming.migrating_queue(queue.name)] = queue.name
        derived[naming.retry_exchange(queue.name)] = queue.name
        derived[naming.lanes_exchange(queue.name)] = queue.name
        for lane in range(queue.ordered.lanes if queue.ordered else 0):
            derived[naming.lane_queue(queue.name, lane)] = queue.name
            derived[naming.held_queue(queue.name, lane)] = queue.name
    for name in owners[0]:
        derived[name] = owners[0][name]
    for name in owners[1]:
        derived[name] = owners[1][name]
    for queue in queues.values():
        old = queue.renamed_from
        if old is None:
            continue
        path: Path = ("queues", queue.name, "renamed_from")
        name_problems = _name_problems(path, "queue", old)
        if name_problems:
            problems += name_problems
        elif queue.ordered is not None:
            problems.append(Problem(path, "not supported on an ordered queue (its lanes are not "
                                    "moved); rename it by hand, or drop `ordered:` first"))
        elif old == queue.name:
            problems.append(Problem(path, f"{shorten(old)} is this queue's own name"))
        elif old in queues:
            problems.append(Problem(path, f"{shorten(old)} is a queue of the file; a queue "
                                    "renamed from it must not be declared too"))
        elif (owner := derived.get(old) or _tier_namespace_owner(old, queues)) is not None:
            problems.append(Problem(path, f"{shorten(old)} is a name rabbit-retry derives from "
                                    f"queue {shorten(owner)}"))
        elif old in taken:
            problems.append(Problem(path, f"queue {shorten(taken[old])} is renamed from "
                                    f"{shorten(old)} already"))
        else:
            taken[old] = queue.name
    return problems


def _delay_problems(path: Path, retry: RetrySpec) -> list[Problem]:
    """Delays that get shorter: a list written out of order, or a typo (``[30s, 5s, 1m]``).
    A delay may repeat (``[5s, 5s, 1m]`` waits 5 s before the second and the third attempt,
    through one tier queue)."""
    delays = retry.delays or []
    for index in range(1, len(delays)):
        if delays[index] < delays[index - 1]:
            shorter, longer = label(delays[index]), label(delays[index - 1])
            return [
                Problem(
                    (*path, "delays", index),
                    f"delays must not decrease: {shorter} comes after {longer}; the n-th "
                    "failure waits delays[n-1], so list them from the shortest",
                )
            ]
    return []


def _lane_problems(queues: Mapping[str, QueueConfig], spec: TopologySpec) -> list[Problem]:
    """An ordered queue's lanes exchange, lane and held queues must not be names the file uses."""
    problems = []
    for queue in queues.values():
        if queue.ordered is None:
            continue
        lanes = naming.lanes_exchange(queue.name)
        if lanes in spec.exchanges:
            problems.append(Problem(("exchanges", lanes), f"exchange {shorten(lanes)} collides "
                                    f"with the lanes exchange of ordered queue "
                                    f"{shorten(queue.name)}"))
        for lane in range(queue.ordered.lanes):
            for derived in (naming.lane_queue(queue.name, lane),
                            naming.held_queue(queue.name, lane)):
                if derived in queues:
                    problems.append(Problem(("queues", derived), f"queue {shorten(derived)} "
                                            f"collides with a lane of ordered queue "
                                            f"{shorten(queue.name)}"))
    return problems


def _queue_problems(
    queue: QueueConfig, queues: Mapping[str, QueueConfig], spec: TopologySpec, owners: _Owners
) -> list[Problem]:
    path: Path = ("queues", queue.name)
    problems = _name_problems(path, "queue", queue.name)
    if not problems:
        problems += _derived_name_problems(path, queue, queues, owners)
    own_retry = spec.queues[queue.name].retry
    if own_retry is not None:
        problems += _delay_problems((*path, "retry"), own_retry)
    seen: dict[tuple[str, str, str], int] = {}
    for i, binding in enumerate(queue.bindings):
        bpath: Path = (*path, "bindings", i)
        problems += _exchange_reference_problems(
            (*bpath, "exchange"), binding.exchange, spec, queues
        )
        problems += _headers_binding_problems(bpath, binding.exchange, binding, spec)
        if len(binding.routing_key.encode()) > MAX_NAME_BYTES:
            problems.append(
                Problem(
                    (*bpath, "routing_key"),
                    f"routing key is "
                    f"{len(binding.routing_key.encode())} bytes; AMQP allows at most 255",
                )
            )
        problems += _argument_problems((*bpath, "arguments"), binding.arguments)
        identity = (binding.exchange, binding.routing_key, repr(sorted(binding.arguments.items())))
        if identity in seen:
            problems.append(Problem(bpath, f"the same binding as bindings[{seen[identity]}]"))
        seen.setdefault(identity, i)
    problems += _queue_argument_problems((*path, "arguments"), queue)
    problems += _replica_problems(path, queue, spec)
    problems += _policy_problems((*path, "policy"), queue)
    problems += [Problem(where, message) for where, message in limit_problems(queue)]
    return problems


def _headers_binding_problems(
    path: Path, exchange: str, binding: BindingConfig, spec: TopologySpec
) -> list[Problem]:
    """A binding to a headers exchange with a routing key and no header to match: the
    exchange ignores routing keys, so it takes every message, never what the key suggests."""
    declared = spec.exchanges.get(exchange)
    headers = exchange in _BUILTIN_HEADERS or (declared is not None and declared.type == "headers")
    if not headers or not binding.routing_key:
        return []
    if any(not str(key).startswith("x-") for key in binding.arguments):
        return []
    return [
        Problem(
            (*path, "routing_key"),
            f"exchange {shorten(exchange)} is a headers exchange: it ignores routing_key, so "
            "with no header to match this binding takes every message; write the headers to "
            "match under arguments (with x-match: all or any), or drop routing_key to take "
            "every message",
        )
    ]


# Policy key -> the queue argument that sets the same thing.
_POLICY_ARGUMENT = {
    "max-length": ("max_length", "x-max-length"),
    "max-length-bytes": ("max_length_bytes", "x-max-length-bytes"),
    "overflow": ("overflow", "x-overflow"),
    "delivery-limit": ("delivery_limit", "x-delivery-limit"),
    "message-ttl": ("message_ttl", "x-message-ttl"),
}


def _policy_problems(path: Path, queue: QueueConfig) -> list[Problem]:
    problems = []
    for key in queue.policy:
        field, argument = _POLICY_ARGUMENT[key]
        where: Path = (*path, field)
        if argument in queue.arguments:
            problems.append(Problem(where, f"also set as argument {argument!r}; set it once"))
        elif key == "overflow" and queue.queue_type == "quorum":
            problems.append(Problem(where, "quorum queues need reject-publish for at-least-once "
                                    "dead letters; rabbit-retry sets it"))
        elif key == "overflow" and queue.policy[key] == "reject-publish":
            problems.append(Problem(where, "reject-publish on a classic queue silently drops "
                                    "retried messages that return while the queue is full"))
        elif key == "delivery-limit" and queue.queue_type != "quorum":
            problems.append(Problem(where, "classic queues have no delivery limit"))
    return problems


def _replica_problems(path: Path, queue: QueueConfig, spec: TopologySpec) -> list[Problem]:
    # ``defaults.replicas`` reaches only the queues that have quorum queues; a queue that asks
    # for replicas itself and has none is a mistake worth one line.
    own = spec.queues[queue.name].replicas
    if own is not None and not queue.quorum_queues:
        return [
            Problem(
                (*path, "replicas"),
                "replicas applies to quorum queues; this queue and its parking queue are classic",
            )
        ]
    if queue.replicas is not None and "x-quorum-initial-group-size" in queue.arguments:
        return [
            Problem(
                (*path, "arguments", "x-quorum-initial-group-size"),
                "set replicas instead (it also reaches the retry tiers and a quorum parking "
                "queue); not both",
            )
        ]
    return []


def _name_problems(path: Path, kind: str, name: str) -> list[Problem]:
    if not name.strip():
        return [Problem(path, f"a {kind} name must not be empty or blank")]
    bad = sorted({ch for ch in name if ch not in AMQP_NAME_CHARACTERS})
    if bad:
        shown = " ".join(repr(ch) for ch in bad[:5])
        return [
            Problem(
                path,
                f"{kind} name {shorten(name)} has characters AMQP clients cannot send ({shown}); "
                "names may hold letters A-Z a-z, digits, spaces and - _ . : @ # , / +",
            )
        ]
    if kind == "queue" and " " in name:
        return [
            Problem(
                path,
                f"queue name {shorten(name)} has a space: a queue's name is typed on command "
                "lines (rabbit-retry parking show QUEUE, rabbitmqctl) and read in logs, where a "
                "space splits it in two; use - _ or . instead",
            )
        ]
    if kind == "queue" and name.startswith("-"):
        return [
            Problem(
                path,
                f"queue name {shorten(name)} starts with -: on a command line (rabbit-retry "
                "parking show QUEUE) it reads as an option; start it with a letter or a digit",
            )
        ]
    if name.startswith("amq."):
        return [
            Problem(
                path,
                f"{kind} name {shorten(name)}: names starting with amq. are reserved by RabbitMQ",
            )
        ]
    if kind == "queue" and name == naming.LOCK_QUEUE:
        return [
            Problem(
                path,
                f"queue name {name} is reserved: apply and migrate hold a queue of that name "
                "while they change the vhost",
            )
        ]
    if kind == "exchange" and len(name) > MAX_EXCHANGE_NAME:
        return [
            Problem(
                path,
                f"exchange name is {len(name)} characters long; AMQP allows at most "
                f"{MAX_EXCHANGE_NAME}",
            )
        ]
    if kind == "queue" and len(naming.retry_exchange(name)) > MAX_EXCHANGE_NAME:
        return [
            Problem(
                path,
                f"queue name is {len(name)} characters long; at most {MAX_QUEUE_NAME} fit, so "
                f"that its retry exchange (name + {naming.RETRY_SUFFIX!r}) stays within the "
                f"{MAX_EXCHANGE_NAME} characters AMQP allows for an exchange name",
            )
        ]
    return []


def _derived_name_problems(
    path: Path, queue: QueueConfig, queues: Mapping[str, QueueConfig], owners: _Owners
) -> list[Problem]:
    name = queue.name
    problems: list[Problem] = []
    parking_of, tier_of = owners
    if name in parking_of:
        problems.append(
            Problem(
                path,
                f"queue {shorten(name)} collides with the parking queue of queue "
                f"{shorten(parking_of[name])}",
            )
        )
    elif name in tier_of:
        problems.append(
            Problem(
                path,
                f"queue {shorten(name)} collides with a retry tier of queue "
                f"{shorten(tier_of[name])}",
            )
        )
    elif name.endswith(naming.MIGRATING_SUFFIX) and (
        held := _migrating_owner(name, queues, owners)
    ) is not None:
        problems.append(
            Problem(
                path,
                f"queue {shorten(name)} collides with the holding queue `rabbit-retry migrate` "
                f"uses for queue {shorten(held)}",
            )
        )
    elif (exchange_owner := _owner_of_retry_exchange(name, queues)) is not None:
        problems.append(
            Problem(
                path,
                f"queue {shorten(name)} would own names under "
                f"{shorten(naming.tier_prefix(exchange_owner))}, which are reserved for the retry "
                f"tiers of queue {shorten(exchange_owner)}",
            )
        )
    else:
        owner = _tier_namespace_owner(name, queues)
        if owner is not None:
            # Names under Q.retry. belong to Q's tiers: apply --prune deletes the unlisted ones.
            problems.append(
                Problem(
                    path,
                    f"queue {shorten(name)} is inside the names reserved for the retry tiers of "
                    f"queue {shorten(owner)} ({naming.tier_prefix(owner)}*)",
                )
            )
    return problems


def _migrating_owner(name: str, queues: Mapping[str, QueueConfig], owners: _Owners) -> str | None:
    """The queue of the file (or derived from it) whose holding queue ``name`` would be."""
    held = name[: -len(naming.MIGRATING_SUFFIX)]
    derived = held in queues or held in owners[0] or held in owners[1]
    return held if derived else None


def _tier_namespace_owner(name: str, queues: Mapping[str, QueueConfig]) -> str | None:
    """The queue ``Q`` of the file when ``name`` starts with ``Q.retry.``."""
    return next((q for q in naming.tier_namespace_owners(name) if q in queues), None)


def _tier_names(queue: QueueConfig) -> list[str]:
    return [naming.tier_queue(queue.name, ms) for ms in queue.retry.tiers_ms]


def _owner_of_retry_exchange(name: str, queues: Mapping[str, QueueConfig]) -> str | None:
    """The queue ``Q`` of the file when ``name`` is ``Q.retry``."""
    owner = naming.main_queue_of_retry_exchange(name)
    return owner if owner in queues else None


def _exchange_reference_problems(
    path: Path, exchange: str, spec: TopologySpec, queues: Mapping[str, QueueConfig]
) -> list[Problem]:
    if exchange in spec.exchanges or exchange in BUILTIN_EXCHANGES:
        return []
    if exchange.startswith("amq."):
        builtins = ", ".join(sorted(BUILTIN_EXCHANGES))
        return [Problem(path, f"{shorten(exchange)} is not a built-in exchange ({builtins})")]
    owner = _owner_of_retry_exchange(exchange, queues)
    if owner is not None:
        return [
            Problem(
                path,
                f"{shorten(exchange)} is the retry exchange of queue {shorten(owner)}; "
                "rabbit-retry binds it itself",
            )
        ]
    return [
        Problem(
            path,
            f"binding to exchange {shorten(exchange)}, which the file does not declare under "
            "exchanges",
        )
    ]


def _queue_argument_problems(path: Path, queue: QueueConfig) -> list[Problem]:
    problems: list[Problem] = []
    for key, value in queue.arguments.items():
        apath: Path = (*path, key)
        why = MANAGED_QUEUE_ARGUMENTS.get(key) or (
            QUORUM_MANAGED.get(key) if queue.queue_type == "quorum" else None
        )
        if why:
            problems.append(Problem(apath, f"argument {key!r} is managed: {why}"))
        elif key in UNSUPPORTED_ARGUMENTS[queue.queue_type]:
            problems.append(
                Problem(apath, f"argument {key!r} is not supported by {queue.queue_type} queues")
            )
        elif queue.queue_type == "classic" and key == "x-overflow" and value == "reject-publish":
            # Checked on 3.10: a message coming back from a classic tier to a full classic queue
            # that rejects publishes is dropped without a trace (at-most-once dead-lettering).
            problems.append(
                Problem(
                    apath,
                    "reject-publish on a classic queue silently drops retried messages that "
                    "return while the queue is full; leave x-overflow unset and write on_full: "
                    "park or drop, or use queue_type: quorum with on_full: reject",
                )
            )
        elif _is_argument_value(value):
            problems += _known_argument_problems(apath, key, value)
    problems += _argument_problems(path, queue.arguments)
    return problems


def _known_argument_problems(path: Path, key: str, value: Any) -> list[Problem]:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    allowed = _ENUM_ARGUMENTS.get(key)
    if key in _NON_NEGATIVE_INT and not (is_int and value >= 0):
        rule = "a whole number >= 0"
    elif key == "x-max-priority" and not (is_int and 0 <= value <= 255):
        rule = "a whole number 0-255"
    elif key == "x-quorum-initial-group-size" and not (is_int and value >= 1):
        rule = "a whole number >= 1"
    elif key == "x-single-active-consumer" and not isinstance(value, bool):
        rule = "true or false"
    elif allowed and value not in allowed:
        rule = f"one of {', '.join(allowed)}"
    else:
        return []
    return [Problem(path, f"argument {key!r} must be {rule}, got {_shorten_argument(value)}")]


def _argument_problems(path: Path, arguments: Mapping[str, Any]) -> list[Problem]:
    return [
        Problem(
            (*path, key),
            f"argument {key!r} must be a string, a number, true/false or a list "
            f"of those, got {_shorten_argument(value)}",
        )
        for key, value in arguments.items()
        if not _is_argument_value(value)
    ]


def _is_argument_value(value: Any) -> bool:
    """What an AMQP field table carries and a YAML file can say unambiguously."""
    if isinstance(value, bool | str | float):
        return True
    if isinstance(value, int):
        return value in _INT64
    if isinstance(value, list):
        return all(_is_argument_value(v) for v in value)
    return False


def _shorten_argument(value: Any) -> str:
    """An argument's value as a message quotes it; an integer AMQP cannot carry says so, and a
    list is written out, since its items are what is wrong."""
    if isinstance(value, int) and not isinstance(value, bool) and value not in _INT64:
        return "a number too large for AMQP"
    if isinstance(value, list):
        return clip(repr(value))
    return shorten(value)
