"""What a service developer writes: a ``RetryConsumer`` subclass with one ``handle`` method.

``Delivery.payload`` is decoded lazily when the consumer has no ``model``: a consumer that only
reads ``body`` (protobuf, plain text) never pays for or trips over JSON decoding. The contract
"a body that fails JSON decoding is parked ``invalid``" holds for every consumer that asks for
the payload: reading ``payload`` of a body that is not JSON raises ``InvalidPayload``, and a
handler that fails after such a read is parked ``invalid`` (never retried), whatever it raised.
With a ``model``, the body is validated before the handler runs and an invalid body is parked
without calling the handler at all.

Both are generic over the payload type, so a type checker learns it from the consumer:
``class Charge(RetryConsumer[Order])`` with ``model = Order`` hands ``handle`` a
``Delivery[Order]`` whose ``payload`` is an ``Order``.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar, cast

from rabbit_retry.errors import InputError
from rabbit_retry.worker.batch import Batch, BatchResult
from rabbit_retry.worker.checks import require_exception_types
from rabbit_retry.worker.idempotency import Idempotency
from rabbit_retry.worker.pause import Pause

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from pydantic import TypeAdapter

if TYPE_CHECKING:
    # A default (``Any`` for a consumer without a model) matters to type checkers only, and
    # Python's own TypeVar takes one from 3.13: typing_extensions is not imported at run time.
    from typing_extensions import TypeVar as TypeVarWithDefault

    PayloadT = TypeVarWithDefault("PayloadT", default=Any)
else:
    PayloadT = TypeVar("PayloadT")


class _NotDecoded:
    """The type of ``NOT_DECODED``."""

    def __repr__(self) -> str:
        return "NOT_DECODED"


# ``Delivery(payload=NOT_DECODED)``: the body is decoded as JSON on the first read of
# ``payload``. Only a worker's own code (or a test) builds a Delivery.
NOT_DECODED: Final = _NotDecoded()


class Permanent(Exception):
    """Raise from ``handle`` to park the message at once, without retrying it."""


class HandlerTimeout(TimeoutError):
    """The handler ran longer than ``handler_timeout``: a transient failure."""


class InvalidPayload(ValueError):
    """The body is not JSON, so ``Delivery.payload`` has nothing to give."""


class Delivery(Generic[PayloadT]):
    """One message as the handler sees it.

    ``exchange`` and ``routing_key`` are where the message was first published, on every
    attempt: a retried message comes back through its queue's retry tiers, but a handler that
    branches on the routing key sees the same one each time. ``headers`` is read-only.
    """

    __slots__ = (
        "_invalid",
        "_payload",
        "attempt",
        "body",
        "correlation_id",
        "exchange",
        "headers",
        "max_attempts",
        "message_id",
        "queue",
        "routing_key",
    )

    # Positional or keyword: the worker builds one per message, positionally (a call by
    # keyword costs twice as much).
    def __init__(
        self,
        body: bytes,
        headers: Mapping[str, Any],
        message_id: str | None,
        correlation_id: str | None,
        routing_key: str,
        exchange: str,
        queue: str,
        attempt: int,
        max_attempts: int,
        payload: PayloadT | _NotDecoded = NOT_DECODED,
    ) -> None:
        self.body = body
        self.headers = headers
        self.message_id = message_id
        self.correlation_id = correlation_id
        self.routing_key = routing_key
        self.exchange = exchange
        self.queue = queue
        self.attempt = attempt
        self.max_attempts = max_attempts
        self._payload = payload
        self._invalid: InvalidPayload | None = None

    @property
    def payload(self) -> PayloadT:
        """The validated model instance, or the parsed JSON body when there is no model."""
        if isinstance(self._payload, _NotDecoded):
            import json  # loaded by the first consumer that reads a payload

            try:
                self._payload = cast(PayloadT, json.loads(self.body))
            except (ValueError, UnicodeDecodeError) as exc:
                self._invalid = InvalidPayload(f"body is not JSON: {exc}")
                raise self._invalid from exc
        return self._payload

    def __repr__(self) -> str:  # never the body: it may carry personal data
        return (
            f"<Delivery queue={self.queue!r} message_id={self.message_id!r} "
            f"attempt={self.attempt}/{self.max_attempts}>"
        )


def payload_error(delivery: Delivery[Any]) -> InvalidPayload | None:
    """The decoding error, once the handler read ``payload`` of a body that is not JSON."""
    return delivery._invalid


# ``async def middleware(delivery, call_next)``: runs around the handler; ``await
# call_next(delivery)`` runs the rest (the next middleware, then the handler).
Middleware = Callable[["Delivery[Any]", Callable[["Delivery[Any]"], Awaitable[Any]]],
                      Awaitable[Any]]


class RetryConsumer(Generic[PayloadT]):
    """Subclass, set ``queue``, write ``async def handle(self, delivery)`` (or a plain ``def``
    for blocking code: it runs in a thread pool of ``prefetch`` threads).

    ``handle`` returning means success (ack). ``Permanent``, an exception type listed in
    ``permanent_errors``, or a body that fails ``model`` parks the message at once. Any other
    exception, or running longer than ``handler_timeout`` seconds, is a transient failure: the
    message is retried through the queue's delay tiers until ``max_attempts``, then parked. A
    plain ``def`` that times out is counted as failed, but its thread runs on to its end
    (Python cannot stop a thread), holding one of the ``prefetch`` slots meanwhile.
    """

    queue: str = ""
    prefetch: int = 10
    handler_timeout: float | None = 30.0
    permanent_errors: tuple[type[BaseException], ...] = ()
    model: type[PayloadT] | None = None
    # Stop consuming while a downstream fails (README, "Outages and duplicates").
    pause: Pause | None = None
    # Handle each message key once within a window.
    idempotency: Idempotency | None = None
    # Deliveries acknowledged at most in one ``basic.ack`` frame (``multiple``); None: a quarter
    # of ``prefetch``. 1 acks each delivery on its own.
    ack_run: int | None = None
    # Around every handler call, outermost first: ``async def mw(delivery, call_next)`` (timing,
    # tracing, a context variable); under the handler's timeout, before any decision.
    middleware: tuple[Middleware, ...] = ()
    # Hand deliveries to ``handle_batch`` in batches (README, "Batch handlers") instead of one
    # at a time to ``handle``.
    batch: Batch | None = None

    async def on_start(self) -> None:
        """Called once before the worker consumes (open a pool, warm a cache); raising stops
        the worker with one line, before any message is taken."""

    async def on_stop(self) -> None:
        """Called once after the worker stopped consuming and its handlers finished (close what
        ``on_start`` opened); also after a failed start, if ``on_start`` had succeeded."""

    def handle(self, delivery: Delivery[PayloadT]) -> Awaitable[None] | None:
        """Handle one message: ``async def`` (awaited) or plain ``def`` (run in a thread)."""
        raise NotImplementedError(f"{type(self).__qualname__} must define handle()")

    async def handle_batch(
        self, deliveries: list[Delivery[PayloadT]]
    ) -> BatchResult | None:
        """Handle a batch (with ``batch = Batch(...)``): return None when all succeeded, or a
        ``BatchResult`` naming the deliveries that failed with their exceptions; raising fails
        every delivery of the batch."""
        raise NotImplementedError(f"{type(self).__qualname__} must define handle_batch()")

    @property
    def name(self) -> str:
        return type(self).__name__


def prefetch(consumer: RetryConsumer[Any]) -> int:
    """How many deliveries the consumer holds at once: its ``prefetch``; for a batch consumer
    that leaves it at the default, twice its batch size (one batch fills while one runs)."""
    rule = consumer.batch
    if rule is not None and not _sets(consumer, "prefetch"):
        return min(2 * rule.size, 65535)
    return consumer.prefetch


def _sets(consumer: RetryConsumer[Any], attribute: str) -> bool:
    """Whether the consumer (its instance or a class below ``RetryConsumer``) sets
    ``attribute``."""
    if attribute in vars(consumer):
        return True
    return any(attribute in vars(klass) for klass in type(consumer).__mro__
               if klass is not RetryConsumer and issubclass(klass, RetryConsumer))


def ack_run(consumer: RetryConsumer[Any]) -> int:
    """How many done deliveries one ack frame may settle (``RetryConsumer.ack_run``); a batch
    consumer's default is its batch size: a batch's successes go in one frame."""
    if consumer.ack_run:
        return consumer.ack_run
    if consumer.batch is not None:
        return consumer.batch.size
    return max(1, consumer.prefetch // 4)


def handler_call(
    consumer: RetryConsumer[Any], threads: Executor | None
) -> Callable[[Delivery[Any]], Awaitable[Any]]:
    """How the worker calls the handler: ``handle`` itself (``async def``), or its run in
    ``threads`` (blocking code), inside the consumer's middleware. A blocking handler runs in
    a copy of the delivery's context, as ``asyncio.to_thread`` runs a function: what the
    middleware set in a context variable, and the delivery's span, are current in it too."""
    call: Callable[[Delivery[Any]], Awaitable[Any]]
    if threads is None:
        call = consumer.handle  # type: ignore[assignment]
    else:
        handle = consumer.handle

        def call(delivery: Delivery[Any]) -> Awaitable[Any]:
            return asyncio.get_running_loop().run_in_executor(
                threads, contextvars.copy_context().run, handle, delivery)

    for middleware in reversed(consumer.middleware):
        call = partial(middleware, call_next=call)  # type: ignore[call-arg]
    return call


def is_blocking(consumer: RetryConsumer[Any]) -> bool:
    """Whether ``handle`` is blocking code, to run in a thread.

    An ``async def`` wrapped by a plain decorator (``functools.wraps`` around it) is not: its
    wrapper returns the coroutine at once, and the coroutine runs on the event loop. Whatever a
    handler returns that can be awaited is awaited (``settle_result``), so no shape of handler
    is acked without having run.
    """
    handle = consumer.handle
    return not (
        inspect.iscoroutinefunction(handle) or inspect.iscoroutinefunction(inspect.unwrap(handle))
    )


def check_consumer(consumer: RetryConsumer[Any]) -> TypeAdapter[Any] | None:
    """Refuse a misconfigured consumer with one line naming the attribute, before the first
    message (a consumer the worker cannot run must not start consuming); the model adapter."""
    name = consumer.name
    if not isinstance(consumer, RetryConsumer):
        raise InputError(f"{name} is not a RetryConsumer subclass instance")
    if not isinstance(consumer.queue, str) or not consumer.queue:
        raise InputError(f"{name}.queue: set it to the name of a queue in the topology file")
    if consumer.batch is not None or type(consumer).handle_batch is not RetryConsumer.handle_batch:
        _check_batch(consumer, name)
    else:
        _check_handle(consumer, name)
    _check_numbers(consumer, name)
    middleware = consumer.middleware
    if not isinstance(middleware, tuple) or not all(callable(m) for m in middleware):
        raise InputError(
            f"{name}.middleware: expected a tuple of async functions (delivery, call_next), "
            f"got {middleware!r}"
        )
    require_exception_types(f"{name}.permanent_errors", consumer.permanent_errors)
    for attribute, kind in (("pause", Pause), ("idempotency", Idempotency)):
        value = getattr(consumer, attribute)
        if value is None:
            continue
        if not isinstance(value, kind):
            raise InputError(
                f"{name}.{attribute}: expected {kind.__name__}(...) or None, got {value!r}"
            )
        value.check(name)
    return model_adapter(consumer)


def _check_handle(consumer: RetryConsumer[Any], name: str) -> None:
    """``handle`` can be called as the worker calls it: with one delivery."""
    handle = consumer.handle
    if type(consumer).handle is RetryConsumer.handle or not callable(handle):
        raise InputError(f"{name}: define async def handle(self, delivery) (or a plain def)")
    if inspect.isasyncgenfunction(handle) or inspect.isgeneratorfunction(handle):
        raise InputError(f"{name}.handle: a generator; define async def handle(self, delivery)")
    try:
        signature = inspect.signature(handle)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    try:
        signature.bind(None)
    except TypeError as exc:
        raise InputError(
            f"{name}.handle{signature}: the worker calls it with one delivery ({exc})"
        ) from None


def _check_batch(consumer: RetryConsumer[Any], name: str) -> None:
    """A batch consumer: ``batch`` and an ``async def handle_batch(self, deliveries)``, which
    the worker calls with a list; a prefetch that can hold a whole batch."""
    rule = consumer.batch
    if rule is None:
        raise InputError(f"{name}: handle_batch needs batch = Batch(size=N, wait=SECONDS)")
    if not isinstance(rule, Batch):
        raise InputError(f"{name}.batch: expected Batch(size=N, wait=SECONDS), got {rule!r}")
    rule.check(name)
    handle_batch = consumer.handle_batch
    if type(consumer).handle_batch is RetryConsumer.handle_batch:
        raise InputError(f"{name}: batch is set; define async def handle_batch(self, deliveries)")
    if not (inspect.iscoroutinefunction(handle_batch)
            or inspect.iscoroutinefunction(inspect.unwrap(handle_batch))):
        raise InputError(f"{name}.handle_batch: must be an async def")
    if type(consumer).handle is not RetryConsumer.handle:
        raise InputError(f"{name}: define handle_batch or handle, not both (batch is set)")
    if consumer.middleware:
        raise InputError(f"{name}.middleware: runs around handle, which a batch consumer does not"
                         " have; wrap the work inside handle_batch instead")
    if _sets(consumer, "prefetch") and consumer.prefetch < rule.size:
        raise InputError(
            f"{name}.prefetch = {consumer.prefetch} is below batch size {rule.size}: a batch"
            " could never fill (leave prefetch unset: twice the batch size)"
        )


def _check_numbers(consumer: RetryConsumer[Any], name: str) -> None:
    prefetch = consumer.prefetch
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or not 1 <= prefetch <= 65535:
        raise InputError(f"{name}.prefetch: expected an integer from 1 to 65535, got {prefetch!r}")
    run = consumer.ack_run
    if run is not None and (
        isinstance(run, bool) or not isinstance(run, int) or not 1 <= run <= 65535
    ):
        raise InputError(
            f"{name}.ack_run: expected an integer from 1 to 65535 or None, got {run!r}"
        )
    timeout = consumer.handler_timeout
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
    ):
        raise InputError(
            f"{name}.handler_timeout: expected a positive number of seconds or None, "
            f"got {timeout!r}"
        )


def declared_payload(consumer: RetryConsumer[Any]) -> Any:
    """The payload type of ``class C(RetryConsumer[Order])`` (None when it names none: no
    argument, a type variable, ``Any``)."""
    for klass in type(consumer).__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if getattr(base, "__origin__", None) is RetryConsumer:
                (argument,) = base.__args__
                if isinstance(argument, TypeVar) or argument is Any:
                    return None
                return argument
    return None


def model_adapter(consumer: RetryConsumer[Any]) -> TypeAdapter[Any] | None:
    """The validator of the consumer's payload: its ``model``, or the type argument of
    ``RetryConsumer[...]`` (said once is enough; said twice, both must agree). Built and
    checked now, forward references included: a model pydantic cannot build fails the start,
    not every message."""
    name = consumer.name
    declared, model = declared_payload(consumer), consumer.model
    if isinstance(model, str):
        raise InputError(f"{name}.model: {model!r} is a string; assign the class itself")
    if model is not None and declared is not None and model is not declared:
        raise InputError(
            f"{name}: model = {getattr(model, '__name__', model)!r} but the class says "
            f"RetryConsumer[{getattr(declared, '__name__', declared)}]; say it once, or agree"
        )
    target = model if model is not None else declared
    if target is None:
        return None
    from pydantic import TypeAdapter  # only a consumer with a model needs pydantic

    try:
        adapter = TypeAdapter(target)
        rebuild = getattr(adapter, "rebuild", None)  # pydantic >= 2.10
        if rebuild is not None:
            rebuild(raise_errors=True)
    except Exception as exc:
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"{name}.model: pydantic cannot build a validator for {target!r}: {what}"
            " (a type imported only under TYPE_CHECKING?)"
        ) from exc
    return adapter
