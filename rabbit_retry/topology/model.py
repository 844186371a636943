"""The topology schema (README, "Topology reference") as pydantic models.

Two layers: ``*Spec`` models mirror the file exactly (every key optional where the file may omit
it, unknown keys rejected); ``resolve`` merges ``defaults`` into every queue and builds the
resolved ``Topology`` that the compiler and the worker read (plain dataclasses in ``resolved``,
re-exported here).

In the file, a key written with no value (YAML null) means the same as leaving it out, and a
queue written with no body takes every default.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from rabbit_retry.topology.durations import parse_duration
from rabbit_retry.topology.resolved import (
    DEFAULT_POLICY_PRIORITY,
    BindingConfig,
    ExchangeConfig,
    ExchangeType,
    OnExpire,
    OnFull,
    OnPark,
    OrderedConfig,
    QueueConfig,
    QueueType,
    RetryPolicy,
    Topology,
)

DurationMs = Annotated[int, BeforeValidator(parse_duration)]

# Built-in policy for a queue whose file says nothing about retries.
DEFAULT_DELAYS_MS = (5_000, 30_000, 300_000)
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_QUEUE_TYPE: QueueType = "quorum"
SUPPORTED_VERSION = 1
DEFAULT_LANES = 4
# A handler called a million times is a loop, not a retry policy; a bound also keeps the
# retry-count header a small number for every client that reads it.
MAX_ATTEMPTS = 1_000_000
# What an AMQP argument can carry (a signed 64-bit integer): RabbitMQ takes larger numbers in
# a policy, and a limit no queue can reach is a typo.
MAX_INT64 = 2**63 - 1
# Each lane is a queue (and a held queue) that one worker consumes at a time: beyond this, the
# lanes cost the broker more than they spread.
MAX_LANES = 64


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # ``key:`` with nothing after it is YAML for null; read it as "not set" rather than
        # as a type error, for every key that has a default.
        if not isinstance(data, dict):
            return data
        optional = {name for name, field in cls.model_fields.items() if not field.is_required()}
        return {k: v for k, v in data.items() if not (v is None and k in optional)}


class RetrySpec(_Spec):
    delays: list[DurationMs] | None = Field(default=None, min_length=1)
    max_attempts: int | None = Field(default=None, ge=1, le=MAX_ATTEMPTS)


class BindingSpec(_Spec):
    exchange: str = Field(min_length=1)
    routing_key: str = ""
    arguments: dict[str, Any] = Field(default_factory=dict)


class ExchangeSpec(_Spec):
    type: ExchangeType
    durable: bool = True
    auto_delete: bool = False
    internal: bool = False
    arguments: dict[str, Any] = Field(default_factory=dict)


class ParkingSpec(_Spec):
    queue_type: QueueType | None = None


Overflow = Literal["drop-head", "reject-publish", "reject-publish-dlx"]
# The file's policy keys and the broker's policy definition keys they become.
POLICY_KEYS = {
    "max_length": "max-length",
    "max_length_bytes": "max-length-bytes",
    "overflow": "overflow",
    "delivery_limit": "delivery-limit",
    "message_ttl": "message-ttl",
}


class PolicySpec(_Spec):
    """Tunables the broker changes live: applied as one policy for exactly this queue."""

    max_length: int | None = Field(default=None, ge=0, le=MAX_INT64)
    max_length_bytes: int | None = Field(default=None, ge=0, le=MAX_INT64)
    overflow: Overflow | None = None
    delivery_limit: int | None = Field(default=None, ge=1, le=MAX_INT64)
    message_ttl: DurationMs | None = None
    priority: int | None = Field(default=None, ge=0, le=255)

    def definition(self) -> dict[str, Any]:
        return {
            key: value
            for field, key in POLICY_KEYS.items()
            if (value := getattr(self, field)) is not None
        }


class HeaderKeySpec(_Spec):
    header: str = Field(min_length=1, max_length=255)


class OrderedSpec(_Spec):
    """``ordered: {key: routing_key | {header: NAME}, lanes: N, on_park: hold | continue}``."""

    key: Literal["routing_key"] | HeaderKeySpec
    lanes: int = Field(default=DEFAULT_LANES, ge=1, le=MAX_LANES)
    on_park: OnPark = "hold"

    @field_validator("key", mode="before")
    @classmethod
    def _one_of_two(cls, key: Any) -> Any:
        # One line for either shape, rather than pydantic's one per member of the union.
        if key == "routing_key":
            return key
        header = key.get("header") if isinstance(key, dict) and set(key) == {"header"} else None
        if isinstance(header, str) and header:
            return HeaderKeySpec(header=header)
        raise ValueError(f"expected routing_key or {{header: NAME}}, got {key!r}")


class QueueSpec(_Spec):
    queue_type: QueueType | None = None
    bindings: list[BindingSpec] = Field(default_factory=list)
    retry: RetrySpec | None = None
    parking: ParkingSpec | None = None
    replicas: int | None = Field(default=None, ge=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    policy: PolicySpec | None = None
    ordered: OrderedSpec | None = None
    on_full: OnFull | None = None
    on_expire: OnExpire | None = None
    # The name this queue had on the broker: ``migrate`` moves the old queue's messages here.
    renamed_from: str | None = Field(default=None, min_length=1)


class DefaultsSpec(_Spec):
    queue_type: QueueType | None = None
    retry: RetrySpec | None = None
    parking: ParkingSpec | None = None
    replicas: int | None = Field(default=None, ge=1)


class TopologySpec(_Spec):
    version: int
    defaults: DefaultsSpec = Field(default_factory=DefaultsSpec)
    exchanges: dict[str, ExchangeSpec] = Field(default_factory=dict)
    queues: dict[str, QueueSpec] = Field(min_length=1)

    @field_validator("version")
    @classmethod
    def _known_version(cls, version: int) -> int:
        if version != SUPPORTED_VERSION:
            raise ValueError(f"unsupported version {version}")
        return version

    @field_validator("queues", mode="before")
    @classmethod
    def _bare_queue_is_all_defaults(cls, queues: Any) -> Any:
        # ``queues: {work: }``: a queue with every setting at its default.
        if isinstance(queues, dict):
            return {name: {} if body is None else body for name, body in queues.items()}
        return queues


def resolve(spec: TopologySpec, source: str = "<topology>") -> Topology:
    """Merge ``defaults`` (and the built-in defaults under them) into every queue."""
    queues = [_resolved_queue(name, queue, spec.defaults) for name, queue in spec.queues.items()]
    exchanges = tuple(
        ExchangeConfig(
            name=name,
            type=ex.type,
            durable=ex.durable,
            auto_delete=ex.auto_delete,
            internal=ex.internal,
            arguments=dict(ex.arguments),
        )
        for name, ex in spec.exchanges.items()
    )
    return Topology(exchanges=exchanges, queues=tuple(queues), source=source)


def _resolved_queue(name: str, queue: QueueSpec, defaults: DefaultsSpec) -> QueueConfig:
    default_retry = defaults.retry or RetrySpec()
    retry = queue.retry or RetrySpec()
    delays = retry.delays or default_retry.delays or DEFAULT_DELAYS_MS
    max_attempts = retry.max_attempts or default_retry.max_attempts or DEFAULT_MAX_ATTEMPTS
    queue_type = queue.queue_type or defaults.queue_type or DEFAULT_QUEUE_TYPE
    policy = queue.policy
    return QueueConfig(
        name=name,
        queue_type=queue_type,
        bindings=tuple(
            BindingConfig(b.exchange, b.routing_key, dict(b.arguments)) for b in queue.bindings
        ),
        retry=RetryPolicy(delays_ms=tuple(delays), max_attempts=max_attempts),
        arguments=dict(queue.arguments),
        # Parking follows the main queue (a quorum queue's parked messages are replicated
        # like its others) unless the file says otherwise.
        parking_type=(queue.parking or ParkingSpec()).queue_type
        or (defaults.parking or ParkingSpec()).queue_type
        or queue_type,
        replicas=queue.replicas or defaults.replicas,
        policy=policy.definition() if policy else {},
        policy_priority=(policy.priority if policy and policy.priority is not None
                         else DEFAULT_POLICY_PRIORITY),
        ordered=None if queue.ordered is None else OrderedConfig(
            None if queue.ordered.key == "routing_key" else queue.ordered.key.header,
            queue.ordered.lanes,
            queue.ordered.on_park,
        ),
        on_full=queue.on_full,
        on_expire=queue.on_expire,
        renamed_from=queue.renamed_from,
    )
